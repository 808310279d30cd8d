"""Correct under load: four times the slots in threads, and every answer equals the same prompt run alone.

Threads run at once through the graph itself on a real llama-server with its host
prompt cache on (``--cache-ram``); every request it answered is then sent again,
alone, to a fresh server with no host cache and ``cache_prompt: false``, and the
two answers' tokens are compared (greedy, judged by the alone run's top tokens
and their logprobs, ``fusion_graph_testing.answers``). A control runs the same
traffic on a server with the host cache off, to show what batching alone changes.
The full version, at 3x and 10x the slots over workers and boxes, is
``python -m bench.kv.crowd --check-answers``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatResult
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionContext, FusionSettings, build_graph
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph_testing import LlamaServer
from fusion_graph_testing.answers import Exchange, divergent
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input

pytestmark = pytest.mark.llama

#: Slots of the crowded server: 3 for conversations, the last for memory jobs.
SLOTS = 4
THREADS = 4 * (SLOTS - 1)
TURNS = 2
CONTEXT = FusionContext(mode="local", sub_runners="off", max_completion_tokens=16)


@tool
def note(text: str) -> str:
    """Keep a note."""
    return f"noted: {text}"


class ToolThenDone(ChatLlamaServer):
    """The real llama-server call; the answer then calls ``note`` once a turn (a random model never does)."""

    async def _agenerate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        result = await super()._agenerate(messages, *args, **kwargs)
        real = result.generations[0].message
        done = isinstance(messages[-1], ToolMessage)
        result.generations[0].message = AIMessage(
            content="done" if done else "",
            tool_calls=[]
            if done
            else [{"name": "note", "args": {"text": "x"}, "id": f"c{len(messages)}", "type": "tool_call"}],
            usage_metadata=real.usage_metadata if isinstance(real, AIMessage) else None,
            response_metadata=real.response_metadata,
        )
        return result


class Recording:
    """Every chat request the local model sent, with the answer llama-server gave (before any scripting)."""

    def __init__(self) -> None:
        self.exchanges: list[Exchange] = []

    async def __call__(self, response: httpx.Response) -> None:
        if not response.request.url.path.endswith("/chat/completions"):
            return
        await response.aread()
        self.exchanges.append(Exchange(json.loads(response.request.content), response.json()))


def crowded_server(binary: Path, model: Path, log: Path, cache_ram: int) -> LlamaServer:
    return LlamaServer(
        model,
        binary=binary,
        n_slots=SLOTS,
        ctx_size=SLOTS * 4096,
        extra_args=["--cache-ram", str(cache_ram)],
        log_path=log,
    )


async def crowd(server: LlamaServer) -> list[Exchange]:
    """``THREADS`` threads of ``TURNS`` turns at once through the graph; what each request got."""
    recording = Recording()
    local = ToolThenDone(
        model="tiny",
        base_url=server.openai_base_url,
        api_key="none",
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        http_async_client=httpx.AsyncClient(event_hooks={"response": [recording]}, timeout=300),
    )
    with FakeOpenAI([Reply(content="cloud")]) as cloud:
        graph = build_graph(
            local_model=local,
            settings=FusionSettings(
                cloud_base_url=cloud.base_url, cloud_api_key="sk-test", request_timeout=300
            ),
            tools=[note],
            checkpointer=InMemorySaver(),
        )

        async def thread(name: str) -> None:
            config: Any = {"configurable": {"thread_id": name}}
            for turn in range(TURNS):
                await graph.ainvoke(
                    user_input(f"{name}: question {turn} about slots"), config, context=CONTEXT
                )

        await asyncio.gather(*(thread(f"crowd-{i}") for i in range(THREADS)))
        assert cloud.requests == []
    assert len(recording.exchanges) == THREADS * TURNS * 2
    return recording.exchanges


@pytest.fixture(scope="module")
def alone_server(
    llama_server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """One slot, no host cache: each request runs alone, from an empty cache."""
    log = tmp_path_factory.mktemp("alone") / "alone.log"
    with LlamaServer(
        tiny_model, binary=llama_server_bin, n_slots=1, extra_args=["--cache-ram", "0"], log_path=log
    ) as server:
        yield server


@pytest.mark.parametrize("cache_ram", [256, 0], ids=["host-cache", "control-no-host-cache"])
async def test_every_answer_under_load_equals_the_same_request_run_alone(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path, alone_server: LlamaServer, cache_ram: int
) -> None:
    with crowded_server(llama_server_bin, tiny_model, tmp_path / "crowd.log", cache_ram) as server:
        exchanges = await crowd(server)
    async with httpx.AsyncClient(base_url=alone_server.openai_base_url, timeout=300) as client:
        bad = await divergent(client, exchanges)
    named = [e for e in exchanges if isinstance(e.body.get("id_slot"), int)]
    assert len(named) == len(exchanges), "every local request names a slot (inside its turn)"
    assert bad == [], (
        f"{len(bad)} of {len(exchanges)} answers differ from the same request run alone: {bad[:3]}"
    )
