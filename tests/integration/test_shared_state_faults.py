"""The shared state through a database's life: stopped, restarted, stalled, its connections frozen.

A deployment's Postgres fails like any dependency. Every shared-state
operation is bounded (``shared_state_timeout_s``) and comes out as
``SharedStateUnavailable`` (callers place in this process and say so); after
the database answers again, shared placement resumes within
``RECONNECT_MAX_S`` plus one connect. The graph-level tests run turns across
each fault (under ``ainvoke`` and ``astream(stream_mode="messages")``): every
turn completes, the record says where placement fell back, and a memory job
whose claim could not be made runs later, once.

The server here is this module's own (``halt``/``resume`` keep its port), and
``FaultProxy`` stands between client and server for stalls.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from langchain_core.messages import BaseMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.store.memory import InMemoryStore

from fusion_graph import build_graph, memory
from fusion_graph.context import FusionContext
from fusion_graph.coordination.shared_base import SharedStateUnavailable
from fusion_graph.coordination.shared_state import RECONNECT_MAX_S, SharedState
from fusion_graph.coordination.slot_leases import LeaseAsk
from fusion_graph.memory.job_log import thread_entries
from fusion_graph.settings import FusionSettings
from fusion_graph_testing.fault_proxy import FaultProxy
from fusion_graph_testing.llama_server import LlamaServer
from fusion_graph_testing.postgres import PostgresCluster
from tests.plugins.fakes import ScriptedModel, user_input
from tests.plugins.postgres import start_cluster

#: The bound every operation here runs under (``shared_state_timeout_s``).
TIMEOUT_S = 2.0
#: The longest an operation may take: a connect and a statement, each bounded, and some slack.
OP_BOUND_S = 2 * TIMEOUT_S + 1.0
#: How soon the shared state must be used again once the database answers.
BACK_WITHIN_S = RECONNECT_MAX_S + 2 * TIMEOUT_S + 1.0
BOX = ("http://box:8080",)
GOOD = json.dumps({"items": [{"kind": "fact", "text": "The user prefers tabs."}]})
NS = memory.namespace("fusion", "anonymous")
Mode = Literal["ainvoke", "messages"]


@pytest.fixture(scope="module", name="cluster")
def cluster_fixture() -> Iterator[PostgresCluster]:
    """This module's own server: its tests stop and restart it."""
    cluster = start_cluster(prefix="fusion-pg-faults-")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(name="database")
def database_fixture(cluster: PostgresCluster) -> Iterator[str]:
    """A fresh database; the server is running again after the test, whatever it did."""
    url = cluster.create_database(f"faults_{uuid.uuid4().hex[:10]}")
    try:
        yield url
    finally:
        if not (cluster.server.data / "postmaster.pid").exists():
            cluster.resume()


@pytest.fixture(name="proxy")
def proxy_fixture(cluster: PostgresCluster) -> Iterator[FaultProxy]:
    with FaultProxy(cluster.port) as proxy:
        yield proxy


def through(proxy: FaultProxy, url: str, cluster: PostgresCluster) -> str:
    """``url`` with its port replaced by the proxy's."""
    return url.replace(f":{cluster.port}/", f":{proxy.port}/")


@pytest.fixture(name="state_of")
async def state_of_fixture() -> AsyncIterator[Callable[[str], SharedState]]:
    made: list[SharedState] = []

    def make(url: str) -> SharedState:
        state = SharedState(url, timeout_s=TIMEOUT_S)
        made.append(state)
        return state

    try:
        yield make
    finally:
        for state in made:
            await state.aclose()


async def bounded_failure(what: Awaitable[Any]) -> float:
    """Seconds ``what`` took to raise ``SharedStateUnavailable`` (and nothing else)."""
    began = time.monotonic()
    with pytest.raises(SharedStateUnavailable):
        await what
    return time.monotonic() - began


async def back_in(attempt: Callable[[], Awaitable[Any]]) -> float:
    """Seconds until ``attempt`` succeeds again (failing only with ``SharedStateUnavailable``)."""
    began = time.monotonic()
    while True:
        try:
            await attempt()
        except SharedStateUnavailable:
            assert time.monotonic() - began < 3 * BACK_WITHIN_S, "the shared state never came back"
            await asyncio.sleep(0.2)
            continue
        return time.monotonic() - began


async def every_operation_fails_cleanly(state: SharedState) -> list[float]:
    """Each operation of the shared state, each raising only ``SharedStateUnavailable`` in bounded time."""
    took = [
        await bounded_failure(state.leases.claim_slot(LeaseAsk("p", BOX, 4, "t-new", 60.0, preferred=0))),
        await bounded_failure(state.leases.box_of("p", "t-1")),
        await bounded_failure(state.jobs.claim_job("job-1", "w", 15.0)),
        await bounded_failure(state.jobs.renew_job("job-0", "w", 15.0)),
        await bounded_failure(state.jobs.finish_job("job-0", "w")),
        await bounded_failure(state.jobs.job_claims(["job-0"])),
        await bounded_failure(state.leases.release_slot("p", "t-1")),
    ]
    began = time.monotonic()
    with pytest.raises(SharedStateUnavailable):
        async with state.locks.thread_run("thread-1"):
            pass
    took.append(time.monotonic() - began)
    began = time.monotonic()
    with pytest.raises(SharedStateUnavailable):  # no turn: the placement then names no slot
        async with state.locks.slot_turn(BOX[0], 3, wait_s=TIMEOUT_S):
            pass
    took.append(time.monotonic() - began)
    began = time.monotonic()
    await state.health.publish_cooldown(
        "cloud:m", time.time() + 30, "503"
    )  # never raises: the board is this process's
    took.append(time.monotonic() - began)
    assert state.health.cooldown("cloud:m") is not None
    return took


async def test_a_stopped_database_fails_each_operation_cleanly_and_is_used_again_after_it_restarts(
    database: str, cluster: PostgresCluster, state_of: Callable[[str], SharedState]
) -> None:
    state = state_of(database)
    first = await state.leases.claim_slot(LeaseAsk("p", BOX, 4, "t-1", 60.0, preferred=0))
    assert await state.jobs.claim_job("job-0", "w", 15.0) == 1
    cluster.halt()
    took = await every_operation_fails_cleanly(state)
    print(f"\noperations with the database stopped: {', '.join(f'{t:.2f}' for t in took)} s")
    assert max(took) < OP_BOUND_S
    cluster.resume()
    back = await back_in(lambda: state.leases.box_of("p", "t-1"))
    print(f"shared state used again {back:.2f} s after the database answered")
    assert back < BACK_WITHIN_S
    again = await state.leases.claim_slot(LeaseAsk("p", BOX, 4, "t-1", 60.0, preferred=2))
    assert (again.box, again.slot) == (first.box, first.slot)  # the lease outlived the restart


async def test_the_first_operation_after_a_quick_restart_finds_no_stale_connection(
    database: str, cluster: PostgresCluster, state_of: Callable[[str], SharedState]
) -> None:
    state = state_of(database)
    await asyncio.gather(
        *(state.leases.claim_slot(LeaseAsk("p", BOX, 8, f"t-{i}", 60.0, preferred=i)) for i in range(4))
    )
    cluster.halt()
    cluster.resume()
    # The pool's connections all died with the old server: each is checked before use and replaced.
    claim = await state.leases.claim_slot(LeaseAsk("p", BOX, 8, "t-after", 60.0, preferred=5))
    assert not claim.guest
    assert await state.jobs.claim_job("after-restart", "w", 15.0) == 1


async def test_a_stalled_database_never_holds_an_operation_past_its_bound(
    database: str, cluster: PostgresCluster, proxy: FaultProxy, state_of: Callable[[str], SharedState]
) -> None:
    url = through(proxy, database, cluster)
    state = state_of(url)
    await state.leases.claim_slot(LeaseAsk("p", BOX, 4, "t-1", 60.0, preferred=0))
    assert await state.jobs.claim_job("job-0", "w", 15.0) == 1
    proxy.freeze()  # open connections go silent, new ones are accepted and never answered
    took = await every_operation_fails_cleanly(state)
    fresh = state_of(url)  # a process that first meets the database while it stalls
    took.append(
        await bounded_failure(fresh.leases.claim_slot(LeaseAsk("p", BOX, 4, "t-2", 60.0, preferred=1)))
    )
    print(f"\noperations with the database stalled: {', '.join(f'{t:.2f}' for t in took)} s")
    assert max(took) < OP_BOUND_S
    proxy.thaw()
    assert await back_in(lambda: state.leases.box_of("p", "t-1")) < BACK_WITHIN_S
    assert await back_in(lambda: fresh.leases.box_of("p", "t-1")) < BACK_WITHIN_S


async def test_pooled_connections_dropped_without_a_word_are_replaced_by_new_ones(
    database: str, cluster: PostgresCluster, proxy: FaultProxy, state_of: Callable[[str], SharedState]
) -> None:
    state = state_of(through(proxy, database, cluster))
    await state.leases.claim_slot(LeaseAsk("p", BOX, 4, "t-1", 60.0, preferred=0))
    accepted = proxy.accepted
    proxy.freeze(new=False)  # as after a NAT or a failover: the pool's connections are dead, new ones work
    began = time.monotonic()
    claim = None
    while claim is None:
        try:
            claim = await state.leases.claim_slot(LeaseAsk("p", BOX, 4, "t-2", 60.0, preferred=1))
        except SharedStateUnavailable:
            await asyncio.sleep(0.2)
    took = time.monotonic() - began
    print(f"\na new thread's slot claim after the pool's connections froze: {took:.2f} s")
    assert took < TIMEOUT_S + BACK_WITHIN_S
    assert proxy.accepted > accepted  # on a new connection


async def test_any_thread_id_langgraph_accepts_works_and_apps_on_one_database_never_meet(
    database: str,
) -> None:
    odd = ["nul\x00inside", "lone \udc80 surrogate", "x" * 2000, "ünïcödé 线程"]
    one, two = SharedState(database, namespace="app-one"), SharedState(database, namespace="app-two")
    try:
        for thread in odd:
            assert await one.jobs.claim_job(f"{thread}:0:1", "w1", 15.0) == 1
            async with one.locks.thread_run(thread) as held:
                assert held
                async with two.locks.thread_run(thread) as other:  # another app's thread of the same id
                    assert other
            # The other app's job of the same key is its own: claimed, not "taken over".
            assert await two.jobs.claim_job(f"{thread}:0:1", "w2", 15.0) == 1
            assert await one.jobs.finish_job(f"{thread}:0:1", "w1")
            assert (await two.jobs.job_claims([f"{thread}:0:1"]))[f"{thread}:0:1"].done is False
        a = await one.leases.claim_slot(LeaseAsk("p", BOX, 1, "holder", 60.0, preferred=0))
        b = await two.leases.claim_slot(LeaseAsk("p", BOX, 1, "holder-2", 60.0, preferred=0))
        assert not a.guest and not b.guest  # each app has its own table of the pool's one slot
    finally:
        await one.aclose()
        await two.aclose()


async def test_the_tables_stay_bounded_by_live_work_after_500_threads(database: str) -> None:
    import fusion_graph.coordination.shared_jobs as shared_jobs

    state = SharedState(database)
    try:
        for start in range(0, 500, 50):
            threads = [f"short-{i}" for i in range(start, start + 50)]
            await asyncio.gather(
                *(state.leases.claim_slot(LeaseAsk("p", BOX, 4, t, 60.0, preferred=0)) for t in threads)
            )
            assert all(await asyncio.gather(*(state.jobs.claim_job(f"{t}:0:1", "w", 15.0) for t in threads)))
            assert all(await asyncio.gather(*(state.jobs.finish_job(f"{t}:0:1", "w") for t in threads)))
        sizes = await state.table_sizes()
        assert sizes["fusion_slot_leases"] <= 4  # one row per slot, whatever the number of threads
        assert sizes["fusion_job_claims"] == 500  # finished, kept for CLAIM_RETENTION_S
        retention = shared_jobs.CLAIM_RETENTION_S
        shared_jobs.CLAIM_RETENTION_S = 0.0
        try:
            await asyncio.sleep(0.1)
            deleted_claims, _ = await state.cleanup()
        finally:
            shared_jobs.CLAIM_RETENTION_S = retention
        assert deleted_claims == 500
        assert (await state.table_sizes())["fusion_job_claims"] == 0
    finally:
        await state.aclose()


# -- the graph across the faults ------------------------------------------------------------------


class Hooked(ScriptedModel):
    """Scripted answers; ``hook`` runs during the next step's model call (a fault injected mid-call)."""

    hook: Callable[[], None] | None = None

    async def _fire(self) -> None:
        hook, self.hook = self.hook, None
        if hook is not None:
            await asyncio.to_thread(hook)

    async def _agenerate(self, messages: Any, stop: Any = None, run_manager: Any = None, **kw: Any) -> Any:
        await self._fire()
        return await super()._agenerate(messages, stop=stop, run_manager=run_manager, **kw)

    async def _astream(
        self, messages: Any, stop: Any = None, run_manager: Any = None, **kw: Any
    ) -> AsyncIterator[Any]:
        await self._fire()  # stream_mode="messages" streams the model's answer
        async for chunk in super()._astream(messages, stop=stop, run_manager=run_manager, **kw):
            yield chunk


async def run_turn(graph: Any, text: str, config: RunnableConfig, mode: Mode) -> list[BaseMessage]:
    """One turn under ``ainvoke`` or ``astream(stream_mode="messages")``; the thread's messages after it."""
    context = FusionContext(mode="local", memory_mode="background")
    if mode == "ainvoke":
        await graph.ainvoke(user_input(text), config, context=context)
    else:
        streamed = [
            chunk
            async for chunk in graph.astream(
                user_input(text), config, context=context, stream_mode="messages"
            )
        ]
        assert streamed, "the stream carried the turn's tokens"
    state = await graph.aget_state(config)
    return list(state.values["messages"])


@pytest.mark.parametrize("mode", ["ainvoke", "messages"])
async def test_turns_complete_across_a_database_stopped_during_the_model_call_and_the_memory_job_runs_once(
    database: str, cluster: PostgresCluster, tmp_path: Path, mode: Mode
) -> None:
    facts = [json.dumps({"items": [{"kind": "fact", "text": f"Fact {n}."}]}) for n in (2, 3)]  # no repeats
    local = Hooked(messages=iter(["one", GOOD, "two", facts[0], "three", facts[1]]), model_name="localfake")
    settings = FusionSettings(
        shared_state="postgres",
        shared_state_url=database,
        shared_state_timeout_s=TIMEOUT_S,
        memory_claim_lease_s=3.0,
    )
    store = InMemoryStore()
    config: RunnableConfig = {"configurable": {"thread_id": f"faults-{mode}"}}
    async with AsyncSqliteSaver.from_conn_string(str(tmp_path / "threads.sqlite")) as saver:
        graph = build_graph(local_model=local, tools=[], checkpointer=saver, store=store, settings=settings)
        try:
            messages = await run_turn(graph, "first", config, mode)
            assert messages[-1].content == "one"
            await memory.drain(timeout=30)
            local.hook = cluster.halt  # the database stops while the model answers
            began = time.monotonic()
            messages = await run_turn(graph, "second", config, mode)
            took = time.monotonic() - began
            assert messages[-1].content == "two" and took < 3 * OP_BOUND_S, took
            entries = await thread_entries(store, NS, config["configurable"]["thread_id"])
            assert [e["status"] for e in entries if e["turn"] == 1] == ["pending"]  # claimed once it can be
            cluster.resume()
            await memory.drain(timeout=60)
            messages = await run_turn(graph, "third", config, mode)
            assert messages[-1].content == "three"
            await memory.drain(timeout=30)
        finally:
            await graph.memory_runs.resolver.aclose()
        state = await graph.aget_state(config)
    log = state.values["route_log"]
    jobs = [r for r in log if r["kind"] == "memory"]
    assert sorted(r["turn"] for r in jobs) == [0, 1]  # each turn's job once (turn 2's waits for a next turn)
    assert all(r["memory"]["attempt"] == 1 for r in jobs)
    stored = [item.value for item in await store.asearch(NS, limit=100)]
    assert sorted((v["turn"], v["text"]) for v in stored) == [
        (0, "The user prefers tabs."),
        (1, "Fact 2."),
        (2, "Fact 3."),
    ]


@pytest.mark.parametrize("mode", ["ainvoke", "messages"])
async def test_local_turns_on_llama_server_fall_back_while_the_database_is_down_and_return_to_shared(
    database: str, cluster: PostgresCluster, proxy: FaultProxy, llama_server: LlamaServer, mode: Mode
) -> None:
    settings = FusionSettings(
        shared_state="postgres",
        shared_state_url=through(proxy, database, cluster),
        shared_state_timeout_s=TIMEOUT_S,
        local_base_url=llama_server.openai_base_url,
    )
    graph = build_graph(tools=[], settings=settings, checkpointer=InMemorySaver())
    config: RunnableConfig = {"configurable": {"thread_id": f"llama-faults-{mode}"}}
    context = FusionContext(mode="local", max_completion_tokens=16, sub_runners="off")
    placements: list[str] = []

    async def turn(text: str) -> None:
        began = time.monotonic()
        if mode == "ainvoke":
            out = await graph.ainvoke(user_input(text), config, context=context)
        else:
            async for _ in graph.astream(user_input(text), config, context=context, stream_mode="messages"):
                pass
            out = (await graph.aget_state(config)).values
        assert time.monotonic() - began < 60
        step = [r for r in out["route_log"] if r["kind"] in ("plan", "step")][-1]
        assert step["leg"] == "local" and step["provider"].startswith("local")
        placements.append(str(step.get("placement", {}).get("lease")))

    try:
        await turn("a first question")
        proxy.freeze()  # stalled
        await turn("a second question")
        proxy.thaw()
        cluster.halt()  # stopped
        await turn("a third question")
        cluster.resume()
        await asyncio.sleep(BACK_WITHIN_S)
        await turn("a fourth question")
    finally:
        await graph.memory_runs.resolver.aclose()
    print(f"\nplacements: {placements}")
    assert placements[0] == "shared" and placements[3] == "shared"
    # No turn across processes while it is down: the step names no slot (llama-server places it).
    assert placements[1].startswith("unplaced: the shared state's Postgres")
    assert placements[2].startswith("unplaced: the shared state's Postgres")


@pytest.mark.parametrize("mode", ["ainvoke", "messages"])
async def test_two_workers_never_name_one_slot_at_once_while_the_database_stops_and_comes_back(
    database: str, cluster: PostgresCluster, mode: Mode
) -> None:
    """Several threads a slot over two workers; the database stops mid-run, then comes back.

    A fake llama-server counts every request that arrives naming a slot another request in flight
    named (what corrupts a generation on the real server): none, before, during or after.
    """
    from fusion_graph_testing.fake_openai import FakeOpenAI, Reply

    with (
        FakeOpenAI([Reply(content="cloud")]) as cloud,
        FakeOpenAI([Reply(content="local", delay=0.05)]) as local,
    ):
        local.props = {
            "total_slots": 3,
            "default_generation_settings": {"n_ctx": 4096},
        }  # 2 conversation slots
        settings = FusionSettings(
            shared_state="postgres",
            shared_state_url=database,
            shared_state_timeout_s=TIMEOUT_S,
            local_base_url=local.base_url,
            cloud_base_url=cloud.base_url,
            cloud_api_key="sk-test",
        )
        workers = [build_graph(tools=[], settings=settings, checkpointer=InMemorySaver()) for _ in range(2)]
        context = FusionContext(mode="local", max_completion_tokens=16, sub_runners="off")
        placements: list[str] = []

        async def turn(worker: int, thread: str, text: str) -> None:
            graph = workers[worker]
            config: RunnableConfig = {"configurable": {"thread_id": thread}}
            if mode == "ainvoke":
                out = await graph.ainvoke(user_input(text), config, context=context)
            else:
                async for _ in graph.astream(
                    user_input(text), config, context=context, stream_mode="messages"
                ):
                    pass
                out = (await graph.aget_state(config)).values
            record = [r for r in out["route_log"] if r["kind"] == "plan"][-1]
            assert record["leg"] == "local", record
            placements.append(str(record.get("placement", {}).get("lease")))

        async def round_of_turns(label: str) -> None:
            await asyncio.gather(*(turn(i % 2, f"crowd-{i}", f"{label} {i}") for i in range(6)))

        try:
            await round_of_turns("before")
            cluster.halt()
            await round_of_turns("during")
            cluster.resume()
            await asyncio.sleep(BACK_WITHIN_S)
            await round_of_turns("after")
        finally:
            for graph in workers:
                await graph.memory_runs.resolver.aclose()
    assert local.slot_overlaps == 0
    assert cloud.requests == []
    assert placements[:6] == ["shared"] * 6 and placements[-6:] == ["shared"] * 6
    assert all(p.startswith("unplaced: ") for p in placements[6:12]), placements
    unnamed = [body for body in local.requests if "model" in body and "id_slot" not in body]
    assert len(unnamed) == 6  # the turns during the outage named no slot; every other one did
