"""Memory sub-runners with scripted models: ordering, failure isolation, store writes, recall.

These run the jobs ``inline`` (inside the run) so each test reads them in ``route_log``;
fire-and-forget (``background``) runs and their durability are in ``test_background.py`` (and a
process killed mid-job in ``tests/integration/test_memory_durable.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.store.memory import InMemoryStore
from langgraph.store.sqlite.aio import AsyncSqliteStore

from fusion_graph import build_graph, memory
from fusion_graph.context import FusionContext
from fusion_graph.memory import MemoryJob
from fusion_graph.memory.job_call import PRIMER_PROMPT
from fusion_graph.memory.jobs import MEMORY_MESSAGE_NAME
from fusion_graph.prompts import SYSTEM_PROMPT
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph.settings import FusionSettings
from fusion_graph.sizing.turn import build_prompt
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import ScriptedModel, ai_calls, call, scripted, user_input

NS = memory.namespace("fusion", "anonymous")
INLINE = FusionContext(memory_mode="inline")
GOOD = json.dumps({"items": [{"kind": "fact", "text": "The user prefers tabs."}]})
CONFIG: RunnableConfig = {"configurable": {"thread_id": "t1"}}


@tool
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


TOOLS: list[BaseTool] = [echo]


def one_turn(local_answers: list[Any]) -> tuple[ScriptedModel, ScriptedModel]:
    cloud = scripted("cloudfake", [ai_calls(call("echo", {"text": "x"}, "c1"), content="1. echo")])
    return cloud, scripted("localfake", local_answers)


async def stored(store: Any, ns: tuple[str, ...] = NS) -> list[dict[str, Any]]:
    return [item.value for item in await store.asearch(ns, limit=100)]


async def test_reply_is_streamed_before_any_memory_work_and_items_are_stored() -> None:
    cloud, local = one_turn(["all done", GOOD])
    store = InMemoryStore()
    graph = build_graph(
        cloud_model=cloud, local_model=local, tools=TOOLS, checkpointer=InMemorySaver(), store=store
    )
    order: list[str] = []
    stream = graph.astream(user_input("remember my style"), CONFIG, stream_mode="updates", context=INLINE)
    async for update in stream:
        order += list(update)
    assert order[-2:] == ["local", "memory"], order
    final = await graph.aget_state(CONFIG)
    assert final.values["messages"][-1].content == "all done"
    items = await stored(store)
    assert items == [
        {
            "kind": "fact",
            "text": "The user prefers tabs.",
            "job": "turn_memories",
            "thread_id": "t1",
            "turn": 0,
            "step": 1,
            "at": items[0]["at"],
        }
    ]
    memory_records = [r for r in final.values["route_log"] if r["kind"] == "memory"]
    assert len(memory_records) == 1
    record = memory_records[0]
    assert (record["leg"], record["provider"], record["memory"]["stored"], record["memory"]["dropped"]) == (
        "local",
        "local:localfake",
        1,
        None,
    )
    # The job sent the conversation exactly as the steps send it (same prefix), then one instruction.
    step_prompt, job_prompt = local.prompts
    assert job_prompt[:-1] == build_prompt(SYSTEM_PROMPT, final.values["messages"])
    assert job_prompt[: len(step_prompt)] == step_prompt
    assert job_prompt[-1].text == memory.DEFAULT_JOBS[0].instructions


@pytest.mark.parametrize(
    ("answers", "why"),
    [
        (["all done", "not json", "still not json"], "invalid JSON after one repair"),
        (["all done"], "RuntimeError"),  # the script runs out: the model call itself fails
    ],
)
async def test_a_failing_job_leaves_the_turn_untouched(answers: list[Any], why: str) -> None:
    cloud, local = one_turn(answers)
    store = InMemoryStore()
    graph = build_graph(cloud_model=cloud, local_model=local, tools=TOOLS, store=store)
    out = await graph.ainvoke(user_input("go"), context=INLINE)
    assert out["messages"][-1].content == "all done"
    assert [r["kind"] for r in out["route_log"]][:3] == ["plan", "step", "memory"]
    last = out["route_log"][-1]
    assert last["kind"] == "memory" and why in last["memory"]["dropped"]
    assert (last["memory"]["stored"], last["memory"]["outcome"]) == (0, "dropped")
    assert await stored(store) == []


async def test_invalid_json_gets_one_repair_on_the_same_provider() -> None:
    cloud, local = one_turn(["all done", '{"items": [{"kind": "mood"', GOOD])
    store = InMemoryStore()
    graph = build_graph(cloud_model=cloud, local_model=local, tools=TOOLS, store=store)
    out = await graph.ainvoke(user_input("go"), context=INLINE)
    records = [r for r in out["route_log"] if r["kind"] == "memory"]
    assert [r["memory"]["repair"] for r in records] == [False, True]
    assert {r["provider"] for r in records} == {"local:localfake"}
    assert "not valid for the schema" in str(local.prompts[-1][-1].content)
    assert len(await stored(store)) == 1


async def test_sub_runners_off_runs_nothing() -> None:
    cloud, local = one_turn(["all done", GOOD])
    store = InMemoryStore()
    graph = build_graph(cloud_model=cloud, local_model=local, tools=TOOLS, store=store)
    out = await graph.ainvoke(
        user_input("go"), context=FusionContext(sub_runners="off", memory_mode="inline")
    )
    assert [r["kind"] for r in out["route_log"]] == ["plan", "step"]
    assert len(local.prompts) == 1
    assert await stored(store) == []


async def test_sub_runners_cloud_runs_the_job_on_cloud() -> None:
    cloud = scripted("cloudfake", [ai_calls(call("echo", {"text": "x"}, "c1")), GOOD])
    local = scripted("localfake", ["all done"])
    store = InMemoryStore()
    graph = build_graph(cloud_model=cloud, local_model=local, tools=TOOLS, store=store)
    out = await graph.ainvoke(
        user_input("go"), context=FusionContext(sub_runners="cloud", memory_mode="inline")
    )
    assert out["route_log"][-1]["kind"] == "memory" and out["route_log"][-1]["leg"] == "cloud"
    assert len(await stored(store)) == 1


async def test_next_turn_plan_prompt_includes_the_memories() -> None:
    store = InMemoryStore()
    await store.aput(NS, "a", {"kind": "decision", "text": "Use ruff for linting.", "at": "2026-01-01"})
    await store.aput(NS, "b", {"kind": "task", "text": "Port the CLI to typer.", "at": "2026-01-02"})
    cloud, local = one_turn(["done", json.dumps({"items": []})])
    graph = build_graph(
        cloud_model=cloud, local_model=local, tools=TOOLS, store=store, checkpointer=InMemorySaver()
    )
    out = await graph.ainvoke(user_input("what next?"), CONFIG, context=INLINE)
    plan_prompt = cloud.prompts[0]
    recalled = plan_prompt[-1]
    assert isinstance(recalled, HumanMessage) and recalled.name == MEMORY_MESSAGE_NAME
    assert "Use ruff for linting." in recalled.text and "Port the CLI to typer." in recalled.text
    # It stays in the thread right after the user's message, so later steps share the prefix.
    texts = [m.text for m in out["messages"]]
    assert texts.index(recalled.text) == texts.index("what next?") + 1
    assert local.prompts[0][: len(plan_prompt)] == plan_prompt


async def test_recall_limit_bounds_the_memories() -> None:
    store = InMemoryStore()
    for index in range(12):
        await store.aput(NS, f"k{index}", {"kind": "fact", "text": f"fact number {index}"})
    cloud, local = one_turn(["done", json.dumps({"items": []})])
    graph = build_graph(cloud_model=cloud, local_model=local, tools=TOOLS, store=store)
    await graph.ainvoke(user_input("hi"), context=FusionContext(memory_recall_limit=3, memory_mode="inline"))
    recalled = cloud.prompts[0][-1].text
    assert recalled.count("\n- ") == 3
    assert "fact number 11" in recalled and "fact number 0" not in recalled  # newest first


async def test_memories_persist_across_processes_with_a_persistent_store(tmp_path: Path) -> None:
    path = str(tmp_path / "memories.sqlite")
    async with AsyncSqliteStore.from_conn_string(path) as store:
        await store.setup()
        cloud, local = one_turn(["done", GOOD])
        graph = build_graph(cloud_model=cloud, local_model=local, tools=TOOLS, store=store)
        await graph.ainvoke(user_input("I like tabs"), context=INLINE)
    # A new graph and a new store object on the same file, as a restarted process would have.
    async with AsyncSqliteStore.from_conn_string(path) as store:
        cloud, local = one_turn(["done", json.dumps({"items": []})])
        graph = build_graph(cloud_model=cloud, local_model=local, tools=TOOLS, store=store)
        await graph.ainvoke(user_input("format this file"), context=INLINE)
    assert "The user prefers tabs." in cloud.prompts[0][-1].text


async def test_every_k_steps_runs_memory_beside_the_next_step() -> None:
    other = json.dumps({"items": [{"kind": "fact", "text": "Lint with ruff."}]})  # a repeat is stored once
    cloud = scripted("cloudfake", [ai_calls(call("echo", {"text": "a"}, "c1")), GOOD, other])
    local = scripted(
        "localfake",
        [ai_calls(call("echo", {"text": "b"}, "l1")), ai_calls(call("echo", {"text": "c"}, "l2")), "done"],
    )
    store = InMemoryStore()
    graph = build_graph(cloud_model=cloud, local_model=local, tools=TOOLS, store=store)
    context = FusionContext(memory_every_k_steps=2, sub_runners="cloud", memory_mode="inline")
    out = await graph.ainvoke(user_input("long task"), context=context)
    kinds = [(r["kind"], r["step"]) for r in out["route_log"]]
    # A mid-turn job beside step 2 (it saw the state after step 1), and one after the reply.
    assert sorted(kinds) == sorted(
        [("plan", 0), ("step", 1), ("step", 2), ("memory", 1), ("step", 3), ("memory", 3)]
    )
    assert out["messages"][-1].content == "done"
    assert [item["step"] for item in await stored(store)] == [1, 3]


def local_server(body: dict[str, Any]) -> Reply:
    """The local fake: the priming completion, the memory job (JSON), or the step's answer."""
    if body["messages"] == [{"role": "user", "content": PRIMER_PROMPT}]:
        return Reply(content="x")
    return Reply(content=GOOD) if "response_format" in body else Reply(content="done")


async def test_local_memory_job_is_primed_on_the_reflection_slot_and_keeps_the_steps_prefix() -> None:
    job = MemoryJob("turn_memories", memory.TurnMemories)
    with (
        FakeOpenAI([Reply(content="Plan", tool_calls=[("echo", {"text": "x"})])]) as cloud_fake,
        FakeOpenAI(local_server) as local_fake,
    ):
        graph = build_graph(
            cloud_model=ChatOpenAI(model="c", base_url=cloud_fake.base_url, api_key="x", max_retries=0),
            local_model=ChatLlamaServer(model="l", base_url=local_fake.base_url, api_key="x", max_retries=0),
            tools=TOOLS,
            store=InMemoryStore(),
            memory_jobs=[job],
            settings=FusionSettings(local_slots=4),
        )
        out = await graph.ainvoke(user_input("go"), context=INLINE)
    step_body, primer_body, memory_body = local_fake.requests
    conversation_slot = out["route_log"][1]["slot"]
    assert step_body["id_slot"] == conversation_slot and conversation_slot != 3
    # First a one-token request on the reserved last slot (no tools: it shares nothing), then the job.
    assert primer_body["messages"] == [{"role": "user", "content": PRIMER_PROMPT}]
    # A one-token budget, sent under the name every step's budget is sent under.
    budget = "max_completion_tokens" if "max_completion_tokens" in memory_body else "max_tokens"
    assert (primer_body[budget], "tools" in primer_body) == (1, False)
    assert primer_body["id_slot"] == 3 and primer_body["cache_prompt"] is True
    assert memory_body["id_slot"] == 3 and memory_body["cache_prompt"] is True
    assert memory_body["response_format"]["type"] == "json_schema"
    schema = memory_body["response_format"]["json_schema"]["schema"]
    assert schema["properties"]["items"]["maxItems"] == 8
    # The same tools and the same messages as the step, so the rendered prefix is the same.
    assert memory_body["tools"] == step_body["tools"] and memory_body["tool_choice"] == "none"
    assert memory_body["messages"][: len(step_body["messages"])] == step_body["messages"]
    assert memory_body["messages"][len(step_body["messages"])] == {"role": "assistant", "content": "done"}
    assert memory_body["messages"][-1] == {"role": "user", "content": job.instructions}
    record = out["route_log"][-1]
    assert (record["slot"], record["memory"]["primed"], record["memory"]["stored"]) == (3, True, 1)
    assert isinstance(out["messages"][-1], AIMessage)
