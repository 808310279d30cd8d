"""The local leg against a real llama-server: slot affinity and measured prompt-cache reuse.

The local model is the real ``ChatLlamaServer`` talking to a real server; only
the *content* of its answers is scripted afterwards (a random-weight model never
decides to call a tool), so prefill, slots and cache numbers are all real.
The cloud leg is an OpenAI-compatible fake on loopback.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from langchain_core.messages import AIMessageChunk
from langchain_core.runnables import RunnableConfig
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import build_graph, make_workspace_tools
from fusion_graph.context import FusionContext
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph_testing import LlamaServer
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input
from tests.plugins.scripted_llama import Recorder, Script, ScriptedLlama, scripted_llama

pytestmark = pytest.mark.llama


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / name).write_text(f"contents of {name}\n" * 20)
    return tmp_path


@pytest.fixture
def cloud() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as fake:
        yield fake


def local_model(server: LlamaServer, recorder: Recorder, script: Script) -> ScriptedLlama:
    return scripted_llama(server.openai_base_url, script, http_async_client=recorder.client())


def cloud_model(fake: FakeOpenAI, recorder: Recorder) -> ChatOpenAI:
    return ChatOpenAI(
        model="cloud-fake",
        base_url=fake.base_url,
        api_key="none",
        http_async_client=recorder.client(),
    )


def records(result: dict[str, Any], kind: str | None = None, leg: str | None = None) -> list[dict[str, Any]]:
    return [
        r
        for r in result["route_log"]
        if (kind is None or r["kind"] == kind) and (leg is None or r["leg"] == leg)
    ]


def local_requests(bodies: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [b for b in bodies if b.get("model") == "tiny"]


async def test_consecutive_local_steps_reuse_cache_and_cloud_step_does_not_cost_it(
    own_llama_server: LlamaServer, cloud: FakeOpenAI, workspace: Path
) -> None:
    cloud.script([Reply(content="Plan: read a.txt", tool_calls=[("read_file", {"path": "a.txt"})])])
    local_rec, cloud_rec = Recorder(), Recorder()
    script: Script = [[("read_file", {"path": "b.txt"})], [("read_file", {"path": "c.txt"})], []]
    script += [[("list_dir", {"path": "."})], []]
    graph = build_graph(
        cloud_model=cloud_model(cloud, cloud_rec),
        local_model=local_model(own_llama_server, local_rec, script),
        tools=make_workspace_tools(workspace),
        checkpointer=InMemorySaver(),
    )
    config: RunnableConfig = {"configurable": {"thread_id": "thread-cache"}}
    context = FusionContext(cloud_share=30, mode="fusion")
    first = await graph.ainvoke(user_input("Summarise a, b and c"), config, context=context)

    assert [(r["kind"], r["leg"]) for r in first["route_log"]] == [
        ("plan", "cloud"),
        ("step", "local"),
        ("step", "local"),
        ("step", "local"),
    ]
    local = records(first, leg="local")
    slot = local[0]["slot"]
    assert slot is not None and all(r["slot"] == slot for r in local)
    for previous, current in itertools.pairwise(local):
        # Server-reported: the next step reused everything the previous step sent.
        assert current["cached_tokens"] >= previous["prompt_tokens"]
        assert current["processed_tokens"] == current["prompt_tokens"] - current["cached_tokens"]
        assert current["processed_tokens"] < previous["prompt_tokens"]

    # Turn 2: the plan runs on cloud in between; the local cache is untouched.
    second = await graph.ainvoke(user_input("Now list the directory"), config, context=context)
    turn2 = [r for r in second["route_log"] if r["turn"] == 1]
    assert [(r["kind"], r["leg"]) for r in turn2][:2] == [("plan", "cloud"), ("step", "local")]
    resumed = turn2[1]
    assert resumed["slot"] == slot
    assert resumed["cached_tokens"] >= local[-1]["prompt_tokens"]

    # Wire level: local requests pin the slot and ask for caching; cloud requests carry neither.
    local_bodies = local_requests(local_rec.bodies)
    assert len(local_bodies) == len(records(second, leg="local"))
    assert all(b["id_slot"] == slot and b["cache_prompt"] is True for b in local_bodies)
    assert cloud_rec.bodies and all("id_slot" not in b and "cache_prompt" not in b for b in cloud_rec.bodies)
    assert all("id_slot" not in b and "cache_prompt" not in b for b in cloud.requests)


async def test_two_threads_keep_separate_slots_and_caches(
    own_llama_server: LlamaServer, cloud: FakeOpenAI, workspace: Path
) -> None:
    local_rec, cloud_rec = Recorder(), Recorder()
    # mode=local: every inference is a local step, so the threads interleave on the server.
    script: Script = [[("read_file", {"path": "a.txt"})], [("read_file", {"path": "b.txt"})]]
    script += [[("read_file", {"path": "c.txt"})], [("list_dir", {"path": "."})], [], []]
    graph = build_graph(
        cloud_model=cloud_model(cloud, cloud_rec),
        local_model=local_model(own_llama_server, local_rec, script),
        tools=make_workspace_tools(workspace),
        checkpointer=InMemorySaver(),
    )
    context = FusionContext(mode="local")
    a: RunnableConfig = {"configurable": {"thread_id": "alpha"}}
    b: RunnableConfig = {"configurable": {"thread_id": "beta"}}
    # alpha: plan -> tool; beta: plan -> tool (on another slot); then each continues.
    await graph.ainvoke(user_input("alpha task " * 30), a, context=context, interrupt_after=["tools"])
    await graph.ainvoke(user_input("beta task " * 30), b, context=context, interrupt_after=["tools"])
    alpha = await graph.ainvoke(None, a, context=context, interrupt_after=["tools"])
    beta = await graph.ainvoke(None, b, context=context, interrupt_after=["tools"])

    slots = {records(alpha)[0]["slot"], records(beta)[0]["slot"]}
    assert len(slots) == 2, "two live threads must not share a slot"
    for state in (alpha, beta):
        plan, step = records(state)
        assert step["slot"] == plan["slot"]
        assert step["cached_tokens"] >= plan["prompt_tokens"], "the other thread evicted this one's cache"
    assert not cloud_rec.bodies and not cloud.requests


async def test_streamed_local_answer_keeps_usage_and_timings(own_llama_server: LlamaServer) -> None:
    model = ChatLlamaServer(
        model="tiny",
        base_url=own_llama_server.openai_base_url,
        api_key="none",
        max_tokens=4,
        stream_usage=True,
    )
    bound = model.bind(extra_body={"id_slot": 0, "cache_prompt": True})
    prompt = [("system", "You are terse. " * 20), ("user", "Say something " * 10)]
    first = await bound.ainvoke(prompt)
    # A chat model streams AIMessageChunk (which adds up), though Runnable types its output AIMessage.
    chunks = cast(list[AIMessageChunk], [chunk async for chunk in bound.astream(prompt)])
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert first.usage_metadata is not None and merged.usage_metadata is not None
    assert merged.usage_metadata["input_tokens"] == first.usage_metadata["input_tokens"]
    timings = merged.response_metadata.get("timings")
    assert isinstance(timings, dict), "llama-server timings were dropped from the stream"
    assert timings["cache_n"] >= first.usage_metadata["input_tokens"] - 1
    assert merged.usage_metadata.get("input_token_details", {}).get("cache_read") == timings["cache_n"]
