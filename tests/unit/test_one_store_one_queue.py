"""Runs of a thread queue by the checkpoint store, not the saver object: no turn is lost.

Two graphs built with an ``AsyncSqliteSaver`` each, on one SQLite file, hold
the same threads. Keyed by the saver object, two concurrent turns on one thread
both started from the same checkpoint and one of them silently dropped out of
the thread's history; keyed by the file, the second waits for the first.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import CheckpointTuple
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

from fusion_graph import FusionContext, build_graph
from fusion_graph.run_queue import store_key
from tests.plugins.fakes import ScriptedModel, scripted, user_input

CONFIG: Any = {"configurable": {"thread_id": "shared"}}
NO_MEMORY = FusionContext(sub_runners="off")


class WatchedSaver(AsyncSqliteSaver):
    """A SQLite saver that says when it first read a checkpoint (its graph's run started)."""

    read: asyncio.Event

    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        self.read.set()
        return await super().aget_tuple(config)


class WaitingModel(ScriptedModel):
    """Answers once the other graph's run read the thread, or after a second (it never does, queued)."""

    other: asyncio.Event | None = None

    async def _agenerate(self, *args: Any, **kwargs: Any) -> Any:
        if self.other is not None:
            # Without a shared queue the other run reads the thread now, from the same checkpoint as this
            # one: waiting for that makes the lost turn certain. Queued behind this run, it never reads
            # it before this run ends, and the wait only runs out (nothing is asserted on time).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.other.wait(), 1.0)
        return await super()._agenerate(*args, **kwargs)


async def turn(graph: Any, text: str, how: str) -> None:
    if how == "ainvoke":
        await graph.ainvoke(user_input(text), CONFIG, context=NO_MEMORY)
    else:
        async for _ in graph.astream(user_input(text), CONFIG, context=NO_MEMORY, stream_mode="messages"):
            pass


@pytest.mark.parametrize("how", ["ainvoke", "astream"])
async def test_two_graphs_with_savers_of_their_own_on_one_sqlite_file_keep_both_turns(
    tmp_path: Path, how: str
) -> None:
    db = str(tmp_path / "threads.sqlite")
    async with (
        WatchedSaver.from_conn_string(db) as first_saver,
        WatchedSaver.from_conn_string(db) as second_saver,
    ):
        assert isinstance(first_saver, WatchedSaver) and isinstance(second_saver, WatchedSaver)
        first_saver.read, second_saver.read = asyncio.Event(), asyncio.Event()
        first = build_graph(
            cloud_model=WaitingModel(messages=iter(["answer one"]), model_name="c", other=second_saver.read),
            local_model=scripted("local", []),
            tools=[],
            checkpointer=first_saver,
        )
        second = build_graph(
            cloud_model=scripted("c", ["answer two"]),
            local_model=scripted("local", []),
            tools=[],
            checkpointer=second_saver,
        )
        await asyncio.gather(turn(first, "one", how), turn(second, "two", how))
        state = (await first.aget_state(CONFIG)).values

    pairs = [(type(m), m.content) for m in state["messages"]]
    one = [(HumanMessage, "one"), (AIMessage, "answer one")]
    two = [(HumanMessage, "two"), (AIMessage, "answer two")]
    assert pairs in (one + two, two + one), "a turn was lost (or the two interleaved)"
    assert [r["turn"] for r in state["route_log"]] == [0, 1]
    assert state["turn"] == 1


async def test_the_queue_key_is_the_sqlite_file_whatever_saver_or_path_reaches_it(tmp_path: Path) -> None:
    db = tmp_path / "threads.sqlite"
    (tmp_path / "link").symlink_to(tmp_path)
    async with (
        AsyncSqliteSaver.from_conn_string(str(db)) as one,
        AsyncSqliteSaver.from_conn_string(str(tmp_path / "link" / "threads.sqlite")) as via_link,
        AsyncSqliteSaver.from_conn_string(str(tmp_path / "other.sqlite")) as other,
        AsyncSqliteSaver.from_conn_string(":memory:") as memory_a,
        AsyncSqliteSaver.from_conn_string(":memory:") as memory_b,
    ):
        assert await store_key(one) == await store_key(via_link)
        assert await store_key(one) != await store_key(other)
        # An in-memory database is its connection's own: each saver is a store of its own.
        assert await store_key(memory_a) != await store_key(memory_b)
    savers = InMemorySaver(), InMemorySaver()
    assert await store_key(savers[0]) != await store_key(savers[1])
