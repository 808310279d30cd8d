"""Memory jobs on a real llama-server: warm prompts on the reserved slot, the conversation's cache intact."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from langchain_core.runnables import RunnableConfig
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.store.memory import InMemoryStore
from pydantic import BaseModel, Field

from fusion_graph import build_graph, make_workspace_tools, memory
from fusion_graph.context import FusionContext
from fusion_graph.memory import MemoryJob
from fusion_graph.memory.job_log import thread_entries
from fusion_graph.routing.records import RouteRecord
from fusion_graph_testing import LlamaServer
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input
from tests.plugins.llama import N_SLOTS
from tests.plugins.scripted_llama import Recorder, Script, scripted_llama

pytestmark = pytest.mark.llama

THREAD = "memory-thread"
#: The issue's target: from a thread's second job on, at least this share of a job's prompt is cached.
WARM = 0.8


class TinyItem(BaseModel):
    """Enum and short strings: a random-weight model under a grammar always terminates."""

    kind: Literal["fact", "task"]
    text: str = Field(min_length=1, max_length=12)


class TinyMemories(BaseModel):
    items: list[TinyItem] = Field(max_length=2)


def cached_share(record: RouteRecord) -> float:
    prompt, cached = record["prompt_tokens"], record["cached_tokens"]
    assert prompt and cached is not None, record
    return cached / prompt


async def test_memory_jobs_are_warm_on_the_reserved_slot_and_leave_the_conversation_cache_intact(
    own_llama_server: LlamaServer, tmp_path: Path
) -> None:
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.txt").write_text(f"{name} line\n" * 30)
    recorder = Recorder()
    script: Script = [
        [("read_file", {"path": "b.txt"})],
        [],
        [("list_dir", {"path": "."})],
        [],
        [("read_file", {"path": "c.txt"})],
        [],
    ]
    local = scripted_llama(
        own_llama_server.openai_base_url, script, max_retries=0, http_async_client=recorder.client()
    )
    store = InMemoryStore()
    turns = ["Read a and b", "Now list the files", "Read c too"]
    with FakeOpenAI([Reply(content="Plan", tool_calls=[("read_file", {"path": "a.txt"})])]) as cloud_fake:
        cloud = ChatOpenAI(model="cloud-fake", base_url=cloud_fake.base_url, api_key="x", max_retries=0)
        graph = build_graph(
            cloud_model=cloud,
            local_model=local,
            tools=make_workspace_tools(tmp_path),
            checkpointer=InMemorySaver(),
            store=store,
            memory_jobs=[MemoryJob("tiny_memories", TinyMemories)],
        )
        config: RunnableConfig = {"configurable": {"thread_id": THREAD}}
        context = FusionContext(memory_max_tokens=256, memory_mode="background", sub_runners="local")
        outs = []
        for text in turns:
            outs.append(await graph.ainvoke(user_input(text), config, context=context))
            await memory.drain(timeout=120)  # each job ends before the next turn, for exact numbers

    ns = memory.namespace("fusion", "anonymous")
    entries = await thread_entries(store, ns, THREAD, statuses=("pending", "done", "folded"))
    # Marked folded once a later node saw their records in route_log; the last one is only done.
    assert [(e["turn"], e["status"]) for e in entries] == [(0, "folded"), (1, "folded"), (2, "done")]
    jobs = [e["records"][-1] for e in entries]
    log = outs[-1]["route_log"]
    steps = [r for r in log if r["kind"] == "step"]
    conversation_slot = steps[0]["slot"]

    # The jobs ran locally on the reserved slot, the conversation elsewhere; each stored valid JSON.
    assert all(j["leg"] == "local" and j["slot"] == N_SLOTS - 1 for j in jobs)
    assert conversation_slot is not None and conversation_slot != N_SLOTS - 1
    assert all(j["memory"]["dropped"] is None and j["memory"]["primed"] for j in jobs), [
        j["memory"] for j in jobs
    ]
    items = [i.value for i in await store.asearch(ns, limit=20)]
    assert len(items) == sum(j["memory"]["stored"] for j in jobs)
    for item in items:
        TinyItem.model_validate({"kind": item["kind"], "text": item["text"]})
    # Each job's request carries the steps' tools, no tool calls, the schema, the reserved slot.
    step_bodies = [b for b in recorder.bodies if "response_format" not in b]
    memory_bodies = [b for b in recorder.bodies if "response_format" in b]
    assert len(memory_bodies) == 3
    for body in memory_bodies:
        assert body["tools"] == step_bodies[0]["tools"] and body["tool_choice"] == "none"
        assert body["id_slot"] == N_SLOTS - 1 and body["cache_prompt"] is True
    # Warm: from the second job on, most of each job's prompt came from llama-server's cache.
    shares = [cached_share(j) for j in jobs]
    assert all(share >= WARM for share in shares[1:]), shares
    # Fire-and-forget, folded once: each job's record is in route_log by the next turn, exactly once.
    folded = [r["memory"]["job_key"] for r in log if r["kind"] == "memory"]
    assert folded == [f"{THREAD}:0:{entries[0]['step']}", f"{THREAD}:1:{entries[1]['step']}"]
    # The conversation's next local step still reuses its own cached prefix (server-reported).
    for turn in (1, 2):
        before = [r for r in steps if r["turn"] == turn - 1][-1]
        after = next(r for r in steps if r["turn"] == turn)
        assert after["slot"] == conversation_slot
        assert after["cached_tokens"] >= before["prompt_tokens"], (before, after)
    print()
    for job, step in zip(jobs, [[r for r in steps if r["turn"] == t][-1] for t in range(3)], strict=True):
        print(
            f"turn {job['turn']}: last step prompt={step['prompt_tokens']} cached={step['cached_tokens']}; "
            f"memory job slot={job['slot']} prompt={job['prompt_tokens']} cached={job['cached_tokens']} "
            f"({cached_share(job):.1%}) processed={job['processed_tokens']} "
            f"completion={job['completion_tokens']}"
        )
    for turn in (1, 2):
        after = next(r for r in steps if r["turn"] == turn)
        print(
            f"turn {turn} first step: prompt={after['prompt_tokens']} cached={after['cached_tokens']} "
            f"processed={after['processed_tokens']}"
        )
    assert outs[0]["messages"][-1].content == "done"
