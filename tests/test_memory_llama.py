"""Memory jobs against a real llama-server: schema-valid JSON, the reserved slot, an intact cache."""

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
from fusion_graph_testing import LlamaServer
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.fakes import user_input
from tests.llama_fixtures import N_SLOTS
from tests.scripted_llama import Recorder, Script, scripted_llama

pytestmark = pytest.mark.llama


class TinyItem(BaseModel):
    """Enum and short strings: a random-weight model under a grammar always terminates."""

    kind: Literal["fact", "task"]
    text: str = Field(min_length=1, max_length=12)


class TinyMemories(BaseModel):
    items: list[TinyItem] = Field(max_length=2)


async def test_memory_job_on_the_reserved_slot_leaves_the_conversation_cache_intact(
    own_llama_server: LlamaServer, tmp_path: Path
) -> None:
    (tmp_path / "a.txt").write_text("alpha\n" * 30)
    (tmp_path / "b.txt").write_text("beta\n" * 30)
    recorder = Recorder()
    script: Script = [[("read_file", {"path": "b.txt"})], [], [("list_dir", {"path": "."})], []]
    local = scripted_llama(
        own_llama_server.openai_base_url, script, max_retries=0, http_async_client=recorder.client()
    )
    store = InMemoryStore()
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
        config: RunnableConfig = {"configurable": {"thread_id": "memory-thread"}}
        context = FusionContext(memory_max_tokens=256, memory_recall_limit=0)
        first = await graph.ainvoke(user_input("Read a and b"), config, context=context)
        second = await graph.ainvoke(user_input("Now list the files"), config, context=context)

    log = second["route_log"]
    turn1_local = [r for r in log if r["turn"] == 0 and r["kind"] == "step"]
    job = next(r for r in log if r["kind"] == "memory")
    turn2_local = next(r for r in log if r["turn"] == 1 and r["kind"] == "step")
    conversation_slot = turn1_local[0]["slot"]

    # The job ran locally on the reserved slot, the conversation elsewhere.
    assert job["leg"] == "local" and job["slot"] == N_SLOTS - 1
    assert conversation_slot is not None and conversation_slot != N_SLOTS - 1
    memory_bodies = [b for b in recorder.bodies if "response_format" in b]
    assert len(memory_bodies) == len([r for r in log if r["kind"] == "memory"]) == 2  # one per turn
    assert all(b["id_slot"] == N_SLOTS - 1 and b["cache_prompt"] is True for b in memory_bodies)
    # It returned schema-valid JSON, which was stored.
    assert job["extra"]["dropped"] is None, job["extra"]
    items = [i.value for i in await store.asearch(memory.namespace("fusion", "anonymous"), limit=10)]
    assert len(items) == sum(r["extra"]["stored"] for r in log if r["kind"] == "memory")
    for item in items:
        TinyItem.model_validate({"kind": item["kind"], "text": item["text"]})
    # The conversation's next local step still reuses its cached prefix (server-reported).
    before = turn1_local[-1]
    assert turn2_local["slot"] == conversation_slot
    assert turn2_local["cached_tokens"] >= before["prompt_tokens"]
    print(
        f"\nbefore memory job: prompt={before['prompt_tokens']} cached={before['cached_tokens']}; "
        f"memory job: slot={job['slot']} prompt={job['prompt_tokens']} "
        f"completion={job['completion_tokens']}; "
        f"next local step: prompt={turn2_local['prompt_tokens']} cached={turn2_local['cached_tokens']} "
        f"processed={turn2_local['processed_tokens']}"
    )
    assert first["messages"][-1].content == "done"
