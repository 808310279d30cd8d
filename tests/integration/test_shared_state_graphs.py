"""Whole turns through graphs with shared state on a real PostgreSQL server.

Odd thread ids (a lone surrogate, a NUL byte, 2,000 characters) are hashed into
every shared-state key; the Postgres checkpointer and store hold neither a lone
surrogate nor a NUL byte, so those are refused before anything is written. And
two apps with their own checkpointer and store on one shared-state database,
with default settings, never hold back each other's memory jobs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import psycopg
import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.store.memory import InMemoryStore
from langgraph.store.postgres.aio import AsyncPostgresStore

from fusion_graph import FusionContext, memory
from fusion_graph.coordination.shared_state import default_namespace
from fusion_graph.errors import InvalidThreadId
from fusion_graph.memory.job_log import thread_entries
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.served import graph_over, turn_state
from tests.unit.test_thread_ids import CONTEXT, NS, ODD_IDS, cloud_replies, local_reply


@pytest.fixture(name="no_database_uri")
def no_database_uri_fixture(monkeypatch: pytest.MonkeyPatch) -> None:
    """An embedded app's environment: no ``DATABASE_URI``, so the default namespace is ``default``."""
    monkeypatch.delenv("DATABASE_URI", raising=False)
    assert default_namespace() == "default"


@pytest.fixture(name="postgres_savers")
async def postgres_savers_fixture(postgres_db: str) -> AsyncIterator[tuple[Any, Any]]:
    """A Postgres checkpointer and store on the test's database, their tables made."""
    async with AsyncExitStack() as stack:
        saver = await stack.enter_async_context(AsyncPostgresSaver.from_conn_string(postgres_db))
        store = await stack.enter_async_context(AsyncPostgresStore.from_conn_string(postgres_db))
        await saver.setup()
        await store.setup()
        yield saver, store


async def turn(
    saver: Any, store: Any, thread: str, how: str, database: str
) -> tuple[dict[str, Any], list[Any]]:
    """A whole turn of ``thread``, shared state on ``database``, its memory job drained: state, job log."""
    with FakeOpenAI(cloud_replies()) as cloud, FakeOpenAI(local_reply) as local:
        graph = graph_over(
            cloud, local, saver=saver, store=store, shared_state="postgres", shared_state_url=database
        )
        try:
            config: Any = {"configurable": {"thread_id": thread}}
            state = await turn_state(graph, "look a up", how, CONTEXT, config)
            await memory.drain(timeout=30)
            return state, await thread_entries(store, NS, thread, statuses=("pending", "done", "folded"))
        finally:
            await graph.memory_runs.resolver.aclose()


async def job_claims(database: str) -> list[tuple[Any, ...]]:
    """Every row of the shared claims table: (owner, attempt, done); none before the graph made it."""
    async with await psycopg.AsyncConnection.connect(database) as conn:
        made = await (await conn.execute("SELECT to_regclass('fusion_job_claims')")).fetchone()
        if made is None or made[0] is None:
            return []
        cursor = await conn.execute("SELECT owner, attempt, done FROM fusion_job_claims ORDER BY owner")
        return list(await cursor.fetchall())


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
@pytest.mark.parametrize("label", ["surrogate", "nul"])
async def test_an_id_postgres_cannot_hold_is_refused_before_anything_is_written(
    label: str, how: str, postgres_db: str, postgres_savers: tuple[Any, Any]
) -> None:
    saver, store = postgres_savers
    thread = ODD_IDS[label]
    with FakeOpenAI(cloud_replies()) as cloud, FakeOpenAI(local_reply) as local:
        graph = graph_over(
            cloud, local, saver=saver, store=store, shared_state="postgres", shared_state_url=postgres_db
        )
        try:
            with pytest.raises(InvalidThreadId, match=r"AsyncPostgresSaver.*nothing was written"):
                await turn_state(graph, "look a up", how, CONTEXT, {"configurable": {"thread_id": thread}})
        finally:
            await graph.memory_runs.resolver.aclose()
    assert [c async for c in saver.alist(None)] == []  # no checkpoint of any thread
    assert await store.asearch((), limit=10) == []
    assert cloud.requests == local.requests == []
    assert await job_claims(postgres_db) == []


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_a_2000_character_id_runs_a_whole_turn_on_postgres_savers_and_shared_state(
    how: str, postgres_db: str, postgres_savers: tuple[Any, Any]
) -> None:
    saver, store = postgres_savers
    thread = ODD_IDS["long"]
    state, log = await turn(saver, store, thread, how, postgres_db)
    assert state["messages"][-1].content == "done"
    assert [r["kind"] for r in state["route_log"] if r["kind"] != "shadow"] == ["plan", "step"]
    assert state["route_log"][1].get("placement", {}).get("lease") == "shared"  # its slot claimed in Postgres
    assert [(e["status"], e["stored"]) for e in log] == [("done", 1)]
    assert [c async for c in saver.alist({"configurable": {"thread_id": thread}})]
    assert [done for _, _, done in await job_claims(postgres_db)] == [True]


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
@pytest.mark.parametrize("label", sorted(ODD_IDS))
async def test_every_odd_id_runs_a_whole_turn_with_shared_state_when_its_savers_hold_it(
    label: str, how: str, postgres_db: str
) -> None:
    thread = ODD_IDS[label]
    state, log = await turn(InMemorySaver(), InMemoryStore(), thread, how, postgres_db)
    assert state["messages"][-1].content == "done"
    assert state["route_log"][1].get("placement", {}).get("lease") == "shared"  # hashed into the slot table
    assert [(e["thread_id"], e["status"], e["stored"]) for e in log] == [(thread, "done", 1)]
    assert [done for _, _, done in await job_claims(postgres_db)] == [True]  # hashed into the claims


@pytest.mark.usefixtures("no_database_uri")
async def test_two_apps_on_one_database_with_default_settings_both_finish_their_memory_jobs(
    postgres_db: str,
) -> None:
    # Two embedded apps, each its own checkpointer and store, one shared-state database, the
    # default namespace, one thread id: each app's job is its own claim.
    apps = [(InMemorySaver(), InMemoryStore()), (InMemorySaver(), InMemoryStore())]
    for saver, store in apps:
        state, log = await turn(saver, store, "ticket-42", "ainvoke", postgres_db)
        assert state["messages"][-1].content == "done"
        assert [(e["status"], e["stored"]) for e in log] == [("done", 1)]
        assert [i.value["text"] for i in await store.asearch(NS)] == ["The user looked a up."]
    claims = await job_claims(postgres_db)
    assert [(attempt, done) for _, attempt, done in claims] == [(1, True), (1, True)]
    # A second turn of each app: nothing left pending, and each app's own claim stays its own.
    for saver, store in apps:
        _, log = await turn(saver, store, "ticket-42", "ainvoke", postgres_db)
        assert len(log) == 2 and "pending" not in {e["status"] for e in log}
    assert len(await job_claims(postgres_db)) == 4


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_two_apps_run_a_same_named_thread_at_once_without_waiting_for_each_other(
    postgres_db: str, tmp_path: Any, how: str
) -> None:
    """The thread-run lock is keyed by where the checkpoints live: app B's run of "ticket-42" goes on
    while app A's is still running (it would wait, then be refused with ThreadBusy, on a shared lock)."""
    import asyncio
    import threading

    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    from fusion_graph.run_queue import store_name

    held = threading.Event()
    context = FusionContext(mode="local", sub_runners="off")
    with (
        FakeOpenAI([Reply(content="cloud")]) as cloud,
        FakeOpenAI([Reply(content="a, held", hold=held)]) as slow,
        FakeOpenAI([Reply(content="b")]) as quick,
    ):
        async with (
            AsyncSqliteSaver.from_conn_string(str(tmp_path / "a.sqlite")) as saver_a,
            AsyncSqliteSaver.from_conn_string(str(tmp_path / "b.sqlite")) as saver_b,
        ):
            assert await store_name(saver_a) != await store_name(saver_b)
            shared = {"shared_state": "postgres", "shared_state_url": postgres_db}
            app_a = graph_over(cloud, slow, saver=saver_a, **shared)
            app_b = graph_over(cloud, quick, saver=saver_b, **shared)
            config: Any = {"configurable": {"thread_id": "ticket-42"}}
            try:
                first = asyncio.create_task(turn_state(app_a, "hello", how, context, config))
                while not slow.requests:  # app A's run holds its lock and waits on its model
                    await asyncio.sleep(0.01)
                second = await turn_state(app_b, "hello", how, context, config)
                assert not first.done()
                held.set()
                done = await first
            finally:
                held.set()
                for app in (app_a, app_b):
                    await app.memory_runs.resolver.aclose()
    assert second["messages"][-1].content == "b"
    assert done["messages"][-1].content == "a, held"
