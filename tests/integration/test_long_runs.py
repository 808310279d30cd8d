"""Long tool loops against a real llama-server whose slots hold 2,048 tokens.

The local model is the real ``ChatLlamaServer`` on a real server (the tiny
generated model, served with a tool-capable Qwen2.5 template, so tool schemas
are rendered and counted as in production); only the tool calls of its
answers are scripted. The cloud leg is an OpenAI-compatible fake on loopback.
Windows come from the server itself (``GET /props``), never from a setting,
except where a test shrinks the cloud window to make every window overflow.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from langchain_core.messages import ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import build_graph, make_workspace_tools
from fusion_graph.context import FusionContext
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph.providers.resolver import ProviderResolver
from fusion_graph.settings import FusionSettings
from fusion_graph.sizing.turn import CUT_KEY
from fusion_graph_testing import LlamaServer, write_chat_template
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input
from tests.plugins.scripted_llama import Recorder, Script, ScriptedLlama, scripted_llama

pytestmark = pytest.mark.llama

#: Tokens one slot of the module's server holds (``-c`` = 2 slots × this).
SLOT_WINDOW = 2048


@pytest.fixture(scope="module")
def small_server(
    llama_server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """Two slots of 2,048 tokens, with a template that renders tools and tool messages."""
    workdir = tmp_path_factory.mktemp("long-runs")
    template = write_chat_template(workdir)
    with LlamaServer(
        tiny_model,
        binary=llama_server_bin,
        n_slots=2,
        ctx_size=2 * SLOT_WINDOW,
        extra_args=["--chat-template-file", str(template)],
        log_path=workdir / "server.log",
    ) as server:
        yield server


@pytest.fixture
def cloud() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as fake:
        yield fake


def code_file(lines: int) -> str:
    """Python source: identifiers, punctuation and digits, the kind of text chars/4 undercounts."""
    body = [
        f"def handler_{i}(request, limit={i * 7}):\n"
        f"    items = [x for x in request.get('items', []) if x['id'] % {i + 3} == 0]\n"
        f"    return {{'status': {200 + i % 5}, 'count': len(items[:limit])}}\n"
        for i in range(lines)
    ]
    return "".join(body)


def counted_by(server: LlamaServer, replies: list[Reply]) -> Callable[[dict[str, Any]], Reply]:
    """The fake cloud's script, each reply reporting the prompt tokens llama-server counts for the request.

    A real cloud reports its own tokenizer's count; the fake's default (a word count) would make
    every cloud anchor meaningless. Once the script is done it answers "done".
    """
    queue = list(replies)

    def answer(body: dict[str, Any]) -> Reply:
        reply = queue.pop(0) if queue else Reply(content="done")
        rendered = {"messages": body["messages"], **({"tools": body["tools"]} if body.get("tools") else {})}
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            prompt = client.post("/apply-template", json=rendered).json()["prompt"]
            tokens = client.post(
                "/tokenize", json={"content": prompt, "add_special": True, "parse_special": True}
            )
        return dataclasses.replace(reply, prompt_tokens=len(tokens.json()["tokens"]))

    return answer


def cloud_model(fake: FakeOpenAI, recorder: Recorder) -> ChatOpenAI:
    return ChatOpenAI(
        model="cloud-fake", base_url=fake.base_url, api_key="none", http_async_client=recorder.client()
    )


def local_model(server: LlamaServer, recorder: Recorder, script: Script) -> ScriptedLlama:
    return scripted_llama(server.openai_base_url, script, http_async_client=recorder.client())


def steps(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in result["route_log"] if r["kind"] == "step"]


async def test_the_local_window_comes_from_the_server(small_server: LlamaServer, cloud: FakeOpenAI) -> None:
    resolver = ProviderResolver(
        cloud=cloud_model(cloud, Recorder()),
        local=ChatLlamaServer(model="tiny", base_url=small_server.openai_base_url, api_key="none"),
        settings=FusionSettings(),
    )
    chain = await resolver.chain(FusionContext())
    windows = {link.leg: await resolver.window(link) for link in chain.links}
    assert windows == {"local": SLOT_WINDOW, "cloud": 128_000}  # the fake cloud model has no profile
    await resolver.aclose()


async def test_tool_output_that_overflows_the_local_slot_runs_on_cloud_and_the_thread_goes_on(
    small_server: LlamaServer, cloud: FakeOpenAI, tmp_path: Path
) -> None:
    (tmp_path / "big.py").write_text(code_file(60))  # about 3,000 tokens: more than a slot holds
    cloud.script(
        [
            Reply(content="Plan: read big.py", tool_calls=[("read_file", {"path": "big.py"})]),
            Reply(content="big.py defines 60 handlers"),
            Reply(content="Plan: nothing to read"),
        ]
    )
    local_rec, cloud_rec = Recorder(), Recorder()
    graph = build_graph(
        cloud_model=cloud_model(cloud, cloud_rec),
        local_model=local_model(small_server, local_rec, [[]]),
        tools=make_workspace_tools(tmp_path),
        checkpointer=InMemorySaver(),
    )
    config: RunnableConfig = {"configurable": {"thread_id": "overflow"}}
    context = FusionContext(max_completion_tokens=512, sub_runners="off")
    first = await graph.ainvoke(user_input("What does big.py define?"), config, context=context)

    (step,) = steps(first)
    assert (step["routed_leg"], step["leg"]) == ("local", "cloud")
    assert "> local window 2,048: escalated to cloud" in step["reason"]
    assert step["sizing"]["fit"].startswith("prompt ")
    assert step["attempts"] == [], "the step was never sent to the slot it could not fit"
    assert step["sizing"]["estimate"] + 512 > SLOT_WINDOW
    assert local_rec.bodies == [], "llama-server never received a request it could not hold"
    assert first["messages"][-1].content == "big.py defines 60 handlers"

    # The thread is alive: the next turn runs (its plan on cloud, as every plan).
    second = await graph.ainvoke(user_input("Thanks"), config, context=context)
    assert second["messages"][-1].content == "Plan: nothing to read"
    assert [r["turn"] for r in second["route_log"]] == [0, 0, 1]


async def test_a_turn_that_overflows_every_window_compacts_and_completes(
    small_server: LlamaServer, cloud: FakeOpenAI, tmp_path: Path
) -> None:
    (tmp_path / "a.py").write_text(code_file(15))  # about 1,000 tokens as read_file shows it
    (tmp_path / "b.py").write_text(code_file(10))  # about 650
    plan = Reply(content="Plan: read a.py, then b.py", tool_calls=[("read_file", {"path": "a.py"})])
    cloud.script(counted_by(small_server, [plan]))
    local_rec = Recorder()
    script: Script = [[("read_file", {"path": "b.py"})], []]
    graph = build_graph(
        cloud_model=cloud_model(cloud, Recorder()),
        local_model=local_model(small_server, local_rec, script),
        tools=make_workspace_tools(tmp_path),
        checkpointer=InMemorySaver(),
        settings=FusionSettings(cloud_window_tokens=SLOT_WINDOW),  # no larger window anywhere
    )
    config: RunnableConfig = {"configurable": {"thread_id": "compact"}}
    context = FusionContext(max_completion_tokens=256, sub_runners="off")
    events: list[dict[str, Any]] = []
    async for event in graph.astream(
        user_input("Compare a.py and b.py"), config, context=context, stream_mode="custom"
    ):
        events.append(event)
    result = (await graph.aget_state(config)).values

    first, second = steps(result)
    assert first["leg"] == "local" and "compaction" not in first["sizing"]
    assert (
        "(the largest window): compacted" in second["reason"] and "fits after compaction" in second["reason"]
    )
    assert second["sizing"]["compaction"]["cleared_tool_outputs"] == 1, "only the oldest output was cleared"
    assert second["leg"] == "local" and second["attempts"] == []
    assert second["prompt_tokens"] + 256 <= SLOT_WINDOW, "the compacted prompt fits the slot (server's count)"
    assert [e["phase"] for e in events if e.get("event") == "fusion_route"].count("compaction") == 1
    outputs = [m for m in result["messages"] if isinstance(m, ToolMessage)]
    assert outputs[0].response_metadata["context_editing"]["cleared"] is True  # a.py, same id, same place
    assert "def handler_9(" in str(outputs[1].content)  # b.py, the most recent output, kept whole
    sent = local_rec.bodies[-1]["messages"]
    assert next(m["content"] for m in sent if m["role"] == "tool").startswith("[tool output cleared")
    assert result["messages"][-1].content == "done"


async def test_the_estimate_counts_like_the_server_on_a_code_heavy_step(
    small_server: LlamaServer, cloud: FakeOpenAI, tmp_path: Path
) -> None:
    (tmp_path / "mid.py").write_text(code_file(16))  # about 800 tokens of code
    script: Script = [[("read_file", {"path": "mid.py"})], []]
    graph = build_graph(
        cloud_model=cloud_model(cloud, Recorder()),
        local_model=local_model(small_server, Recorder(), script),
        tools=make_workspace_tools(tmp_path),
    )
    result = await graph.ainvoke(
        user_input("Read mid.py"),
        context=FusionContext(mode="local", max_completion_tokens=64, sub_runners="off"),
    )
    plan, step = result["route_log"]
    # A thread's first local request is counted by llama-server itself (/apply-template + /tokenize).
    assert plan["sizing"]["estimate_basis"] == "server"
    assert abs(plan["sizing"]["estimate"] - plan["prompt_tokens"]) <= 2
    code_share = (step["prompt_tokens"] - plan["prompt_tokens"]) / step["prompt_tokens"]
    assert code_share > 0.3, "premise: the step is code-heavy"
    # More than SERVER_COUNT_OVER tokens were appended since the anchor: the server counts them too.
    assert step["sizing"]["estimate_basis"] == "server"
    error = abs(step["sizing"]["estimate"] - step["prompt_tokens"]) / step["prompt_tokens"]
    assert error <= 0.03
    # Four characters a token (the old estimate) would have missed the code by far more.
    code = (tmp_path / "mid.py").read_text()
    assert abs(len(code) / 4 - (step["prompt_tokens"] - plan["prompt_tokens"])) / step["prompt_tokens"] > 0.10


def digit_heavy_file(lines: int) -> str:
    """Code that is mostly numbers: tables of constants, the text estimators undercount most."""
    return "".join(
        f"R{i:02d} = ({(i * 7919) % 100003}, {(i * 104729) % 10007}, {i * 31})  # {i * 0.25:.2f}\n"
        for i in range(lines)
    )


async def test_a_digit_heavy_step_is_counted_within_3_percent(
    small_server: LlamaServer, cloud: FakeOpenAI, tmp_path: Path
) -> None:
    (tmp_path / "table.py").write_text(digit_heavy_file(30))
    script: Script = [[("read_file", {"path": "table.py"})], []]
    graph = build_graph(
        cloud_model=cloud_model(cloud, Recorder()),
        local_model=local_model(small_server, Recorder(), script),
        tools=make_workspace_tools(tmp_path),
    )
    result = await graph.ainvoke(
        user_input("Read table.py"),
        context=FusionContext(mode="local", max_completion_tokens=64, sub_runners="off"),
    )
    plan, step = result["route_log"]
    appended = step["prompt_tokens"] - plan["prompt_tokens"]
    [tool_result] = [m for m in result["messages"] if m.type == "tool"]
    assert appended > 512, ("premise: the file is a large part of the step", tool_result.content[:300])
    error = abs(step["sizing"]["estimate"] - step["prompt_tokens"]) / step["prompt_tokens"]
    assert error <= 0.03, (step["sizing"]["estimate"], step["prompt_tokens"])
    assert step["signals"]["prompt_tokens"] == step["sizing"]["estimate"], (
        "context pressure, the score's largest term, uses that count"
    )


async def test_completions_respect_max_completion_tokens_on_both_legs(
    small_server: LlamaServer, cloud: FakeOpenAI
) -> None:
    cloud.script([Reply(content="cloud answer")])
    local_rec, cloud_rec = Recorder(), Recorder()
    local = ChatLlamaServer(
        model="tiny",
        base_url=small_server.openai_base_url,
        api_key="none",
        temperature=0,
        extra_body={
            "ignore_eos": True
        },  # the random model would otherwise stop at any EOS; kept beside the slot
        http_async_client=local_rec.client(),
    )
    graph = build_graph(cloud_model=cloud_model(cloud, cloud_rec), local_model=local, tools=[])
    local_run = await graph.ainvoke(
        user_input("Say a lot"),
        context=FusionContext(mode="local", max_completion_tokens=24, sub_runners="off"),
    )
    (record,) = local_run["route_log"]
    assert record["completion_tokens"] == 24
    assert local_rec.bodies[0]["max_completion_tokens"] == 24
    await graph.ainvoke(
        user_input("Say a lot"),
        context=FusionContext(mode="cloud", max_completion_tokens=24, sub_runners="off"),
    )
    assert cloud_rec.bodies[0]["max_completion_tokens"] == 24


async def test_a_2mb_tool_result_is_cut_and_the_next_step_gets_the_notice(
    small_server: LlamaServer, cloud: FakeOpenAI
) -> None:
    @tool
    def dump() -> str:
        """Return a huge log."""
        return "".join(f"{i:08d} GET /api/items?page={i % 97} 200 {i % 13}ms\n" for i in range(52_000))

    assert len(dump.invoke({})) > 2_000_000
    cloud.script([Reply(content="Plan: look at the log", tool_calls=[("dump", {})])])
    local_rec = Recorder()
    graph = build_graph(
        cloud_model=cloud_model(cloud, Recorder()),
        local_model=local_model(small_server, local_rec, [[]]),
        tools=[dump],
    )
    context = FusionContext(max_tool_output_tokens=400, max_completion_tokens=256, sub_runners="off")
    result = await graph.ainvoke(user_input("What is in the log?"), context=context)

    (output,) = [m for m in result["messages"] if isinstance(m, ToolMessage)]
    text = str(output.content)
    assert len(text) < 4_000 and text.startswith("00000000 GET") and text.endswith("ms\n")
    assert "tokens cut here" in text and "max_tool_output_tokens=400" in text
    assert output.response_metadata[CUT_KEY]["limit"] == 400
    (step,) = steps(result)
    assert step["breakdown"]["transient_notice"] == 20
    assert step["leg"] == "local" and step["prompt_tokens"] + 256 <= SLOT_WINDOW
    assert len(json.dumps(local_rec.bodies[0])) < 16_000
