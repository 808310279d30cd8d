"""Any thread id LangGraph accepts runs a whole turn, or is refused before anything is written.

LangGraph takes any string as a thread id. The graph hashes it wherever it
makes a key of it (slot affinity, the gateway's routing key, shadow picks, the
shared state), so the id itself only reaches the checkpointer and the store:
the in-memory ones hold any string; SQLite cannot encode a lone surrogate, and
its store keeps a NUL byte but its filters never find it again; PostgreSQL
(``tests/integration/test_shared_state_graphs.py``) holds neither. An id its
savers cannot keep is refused (``InvalidThreadId``) before anything is written
or sent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.store.memory import InMemoryStore
from langgraph.store.sqlite.aio import AsyncSqliteStore

from fusion_graph import FusionContext, memory
from fusion_graph.errors import InvalidInput, InvalidThreadId
from fusion_graph.inputs import check_thread_id
from fusion_graph.memory.job_log import thread_entries
from fusion_graph.nodes.shadow import picked
from fusion_graph.providers.slots import SlotPool, routing_key
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.served import graph_over, turn_state

#: Ids LangGraph accepts that are not plain text: a lone surrogate, a NUL byte, 2,000 characters.
ODD_IDS = {"surrogate": "t\ud800x", "nul": "a\x00b", "long": "x" * 2000}
MEMORIES = json.dumps({"items": [{"kind": "fact", "text": "The user looked a up."}]})
NS = memory.namespace("fusion", "anonymous")
#: Every memory job and a shadow check on every local step: every place the id goes.
CONTEXT = FusionContext(memory_mode="background", sub_runners="local", shadow_share=1.0)


def local_reply(body: dict[str, Any]) -> Reply:
    """llama-server's side: the memory job's JSON when a schema is asked for, else the turn's answer."""
    return Reply(content=MEMORIES if body.get("response_format") else "done")


def cloud_replies() -> list[Reply]:
    """The cloud plans one ``lookup`` (the turn's next step runs on local), then answers shadow checks."""
    return [Reply(content="plan", tool_calls=[("lookup", {"key": "a"})]), Reply(content="done")]


@asynccontextmanager
async def savers(kind: str, where: Path) -> AsyncIterator[tuple[Any, Any]]:
    """A checkpointer and a store of ``kind``: ``memory``, ``sqlite``, ``sqlite-saver`` (an in-memory store).

    SQLite files go under ``where``.
    """
    if kind == "memory":
        yield InMemorySaver(), InMemoryStore()
        return
    async with AsyncExitStack() as stack:
        saver = await stack.enter_async_context(AsyncSqliteSaver.from_conn_string(str(where / "cp.sqlite")))
        if kind == "sqlite-saver":
            yield saver, InMemoryStore()
            return
        store = await stack.enter_async_context(AsyncSqliteStore.from_conn_string(str(where / "st.sqlite")))
        await store.setup()
        yield saver, store


async def one_turn(kind: str, thread: str, how: str, where: Path) -> tuple[dict[str, Any], list[Any], Any]:
    """A whole turn of ``thread`` through the graph, its memory job drained: state, job log, checkpoints."""
    with FakeOpenAI(cloud_replies()) as cloud, FakeOpenAI(local_reply) as local:
        async with savers(kind, where) as (saver, store):
            graph = graph_over(cloud, local, saver=saver, store=store)
            config: Any = {"configurable": {"thread_id": thread}}
            state = await turn_state(graph, "look a up", how, CONTEXT, config)
            await memory.drain(timeout=30)
            log = await thread_entries(store, NS, thread, statuses=("pending", "done", "folded"))
            checkpoints = [c async for c in saver.alist(config)]
            return state, log, checkpoints


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
@pytest.mark.parametrize(
    ("kind", "label"),
    [
        ("memory", "surrogate"),
        ("memory", "nul"),
        ("memory", "long"),
        ("sqlite", "long"),
        ("sqlite-saver", "nul"),
    ],
)
async def test_an_odd_thread_id_its_savers_can_hold_runs_a_whole_turn_and_its_memory_job(
    kind: str, label: str, how: str, tmp_path: Path
) -> None:
    state, log, checkpoints = await one_turn(kind, ODD_IDS[label], how, tmp_path)
    assert state["messages"][-1].content == "done"
    assert [r["kind"] for r in state["route_log"] if r["kind"] != "shadow"] == ["plan", "step"]
    assert state["route_log"][1]["leg"] == "local"
    assert [(e["thread_id"], e["status"], e["stored"]) for e in log] == [(ODD_IDS[label], "done", 1)]
    assert checkpoints  # the thread is there to read back


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
@pytest.mark.parametrize(
    ("kind", "label", "refusal"),
    [
        ("sqlite", "surrogate", r"lone surrogate \(U\+D800\).*checkpointer \(AsyncSqliteSaver\)"),
        ("sqlite-saver", "surrogate", r"lone surrogate \(U\+D800\).*checkpointer \(AsyncSqliteSaver\)"),
        ("sqlite", "nul", r"NUL byte, .*store \(AsyncSqliteStore\).*SQLite's filters stop at it"),
    ],
)
async def test_an_id_sqlite_cannot_keep_is_refused_before_anything_is_written_or_a_model_asked(
    kind: str, label: str, refusal: str, how: str, tmp_path: Path
) -> None:
    thread = ODD_IDS[label]
    with FakeOpenAI(cloud_replies()) as cloud, FakeOpenAI(local_reply) as local:
        async with savers(kind, tmp_path) as (saver, store):
            graph = graph_over(cloud, local, saver=saver, store=store)
            with pytest.raises(InvalidThreadId, match=refusal) as refused:
                await turn_state(graph, "look a up", how, CONTEXT, {"configurable": {"thread_id": thread}})
            assert isinstance(refused.value, InvalidInput)
            assert "nothing was written" in str(refused.value)
            assert [c async for c in saver.alist(None)] == []  # no checkpoint of any thread
            assert await store.asearch((), limit=10) == []  # no job log entry
    assert cloud.requests == local.requests == []


def test_the_check_refuses_by_what_each_saver_holds() -> None:
    class PostgresLike(InMemorySaver):
        """Stands for a saver kept in PostgreSQL (only its module is looked at)."""

    PostgresLike.__module__ = "langgraph.checkpoint.postgres.aio"
    for thread in ODD_IDS.values():
        check_thread_id(thread, checkpointer=InMemorySaver(), store=InMemoryStore())
        check_thread_id(thread)  # neither: nothing is written
    check_thread_id(ODD_IDS["long"], checkpointer=PostgresLike())
    # A NUL byte: a PostgreSQL checkpointer refuses it, and any store but the in-memory one.
    with pytest.raises(InvalidThreadId, match=r"NUL byte, .*checkpointer \(PostgresLike\).*PostgreSQL"):
        check_thread_id(ODD_IDS["nul"], checkpointer=PostgresLike())
    with pytest.raises(InvalidThreadId, match=r"NUL byte, .*store \(object\).*SQLite's filters"):
        check_thread_id(ODD_IDS["nul"], checkpointer=InMemorySaver(), store=object())
    # A lone surrogate: anything but the in-memory ones.
    with pytest.raises(InvalidThreadId, match=r"lone surrogate.*store \(object\)"):
        check_thread_id(ODD_IDS["surrogate"], checkpointer=InMemorySaver(), store=object())
    check_thread_id(42, checkpointer=PostgresLike())  # not a string: written as its plain text


def test_the_hashes_of_an_id_are_those_of_its_text_and_take_a_lone_surrogate() -> None:
    # The bytes hashed for any valid id are its UTF-8, as before: slots and boxes of live threads stay.
    assert routing_key("ticket-42") == "t" + hashlib.sha256(b"fusion-thread\0ticket-42").hexdigest()[:24]
    for thread in ODD_IDS.values():
        assert routing_key(thread).startswith("t") and len(routing_key(thread)) == 25
        assert 0 <= SlotPool(4).preferred_slot(thread) < 3
        assert picked(thread, 0, 1, 1.0)
    assert routing_key("t\ud800x") != routing_key("t\ud801x")
