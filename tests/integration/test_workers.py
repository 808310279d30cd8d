"""Several worker processes of one deployment on one Postgres, each with its own compiled graph.

Each ``GraphWorker`` is a separate Python process, as an app scaled out (or a
LangGraph server's workers) runs: a thread's consecutive turns go to different
workers, and everything a turn needs (its checkpoint, its slot, the providers'
health, its memory jobs) must come from the deployment's shared state
(``shared_state="postgres"``), not from the process that ran the last turn.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from fusion_graph.coordination.shared_state import SharedState
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from fusion_graph_testing.graph_worker import GraphWorker, prepare_database
from fusion_graph_testing.llama_server import LlamaServer
from tests.plugins.pool import POOL_MODEL, LlamaPool, start_llama_pool

#: Every step on the local leg; short answers keep the tiny model quick; no memory jobs.
LOCAL: dict[str, Any] = {"mode": "local", "max_completion_tokens": 16, "sub_runners": "off"}
THREADS = 8
#: The workers' shared-state namespace, so this test reads their rows.
NAMESPACE = "workers-test"


@asynccontextmanager
async def start_workers(
    database: str, env: Mapping[str, str], logs: Path, count: int = 2
) -> AsyncIterator[list[GraphWorker]]:
    await prepare_database(database)
    async with AsyncExitStack() as stack:
        workers = [
            await stack.enter_async_context(GraphWorker(database, env=env, log_path=logs / f"worker{i}.log"))
            for i in range(count)
        ]
        yield workers


def shared_env(database: str, **settings: str) -> dict[str, str]:
    return {
        "FUSION_SHARED_STATE": "postgres",
        "FUSION_SHARED_STATE_URL": database,
        "FUSION_SHARED_STATE_NAMESPACE": NAMESPACE,
        "FUSION_CLOUD_API_KEY": "sk-test",
        "FUSION_REQUEST_TIMEOUT": "60",
        **settings,
    }


def local_steps(log: list[dict[str, Any]], turn: int) -> list[dict[str, Any]]:
    return [r for r in log if r["turn"] == turn and r["kind"] != "memory" and r["leg"] == "local"]


@pytest.fixture(name="tight_pool")
def tight_pool_fixture(
    llama_server_bin: Path, tiny_model: Path, smg_bin: Path, tmp_path: Path
) -> Iterator[LlamaPool]:
    """Two boxes of 5 slots (4 for conversations each) behind a real gateway: 8 slots for 8 threads."""
    with start_llama_pool(
        tiny_model, llama_bin=llama_server_bin, smg_bin=smg_bin, logs=tmp_path, slots=5
    ) as pool:
        yield pool


async def alternate(
    workers: list[GraphWorker], threads: list[str], turns: int
) -> dict[str, list[dict[str, Any]]]:
    """Each thread's turns, each on the other worker than its last; all threads at once per turn."""
    logs: dict[str, list[dict[str, Any]]] = {}
    for k in range(turns):
        replies = await asyncio.gather(
            *(
                workers[(i + k) % len(workers)].turn(t, f"{t}: part {k} of the design review, briefly", LOCAL)
                for i, t in enumerate(threads)
            )
        )
        for thread, reply in zip(threads, replies, strict=True):
            logs[thread] = reply["route_log"]
    return logs


async def test_a_threads_turns_on_two_workers_find_its_history_in_one_llama_servers_cache(
    postgres_db: str, llama_server_9: LlamaServer, tmp_path: Path
) -> None:
    env = shared_env(postgres_db, FUSION_LOCAL_BASE_URL=llama_server_9.openai_base_url)
    threads = [f"shared-thread-{i}" for i in range(THREADS)]
    async with start_workers(postgres_db, env, tmp_path) as workers:
        logs = await alternate(workers, threads, turns=3)
    slots = {}
    for thread in threads:
        turns = [local_steps(logs[thread], k) for k in range(3)]
        assert all(len(t) == 1 for t in turns), (thread, turns)
        first, second, third = (t[0] for t in turns)
        assert first["slot"] == second["slot"] == third["slot"] != 8, (
            thread
        )  # one slot, never the reflection's
        assert first["placement"]["lease"] == "shared"
        slots[thread] = first["slot"]
        for before, after in ((first, second), (second, third)):
            # Warm: the later turn's prompt starts with the whole earlier one, found in the slot's cache.
            assert after["cached_tokens"] >= before["prompt_tokens"] - 1, (thread, before, after)
    assert len(set(slots.values())) == THREADS  # no two threads share a slot, whichever worker ran them


async def test_two_boxes_with_as_many_slots_as_threads_fill_evenly_and_every_thread_stays_warm(
    postgres_db: str, tight_pool: LlamaPool, tmp_path: Path
) -> None:
    env = shared_env(
        postgres_db,
        FUSION_LOCAL_BASE_URL=tight_pool.gateway.openai_base_url,
        FUSION_LOCAL_WORKERS=json.dumps(list(tight_pool.worker_urls)),
        FUSION_LOCAL_MODEL=POOL_MODEL,
    )
    threads = [f"boxed-thread-{i}" for i in range(THREADS)]
    async with start_workers(postgres_db, env, tmp_path) as workers:
        logs = await alternate(workers, threads, turns=2)
    boxes: dict[str, str] = {}
    for thread in threads:
        first, second = local_steps(logs[thread], 0)[0], local_steps(logs[thread], 1)[0]
        assert first["placement"]["box"] == second["placement"]["box"] and first["slot"] == second["slot"], (
            thread
        )
        assert second["cached_tokens"] >= first["prompt_tokens"] - 1, (thread, first, second)
        boxes[thread] = first["placement"]["box"]
    per_box = sorted(list(boxes.values()).count(box.rstrip("/")) for box in tight_pool.worker_urls)
    assert per_box == [4, 4], boxes  # even, whatever the gateway's tie-breaking would have done
    # Every request went straight to its box: the gateway served none of them.
    state = SharedState(postgres_db, namespace=NAMESPACE)
    try:
        table = await state.leases.slot_table(tight_pool.gateway.openai_base_url)
    finally:
        await state.aclose()
    assert len({(box, slot) for box, slot, _, live in table if live}) == THREADS


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_a_cloud_outage_seen_by_one_worker_keeps_every_worker_away(
    postgres_db: str, tmp_path: Path, how: str
) -> None:
    with FakeOpenAI([Reply(status=503)]) as cloud, FakeOpenAI([Reply(content="local answer")]) as local:
        env = shared_env(
            postgres_db,
            FUSION_CLOUD_BASE_URL=cloud.base_url,
            FUSION_LOCAL_BASE_URL=local.base_url,
            FUSION_PROVIDER_ALLOWED_FAILURES="0",  # the first 503 cools the provider down
            FUSION_PROVIDER_COOLDOWN_S="300",
        )
        context = {"cloud_share": 100, "sub_runners": "off"}
        stream = how == "messages"
        async with start_workers(postgres_db, env, tmp_path) as (a, b):
            first = await a.turn("outage-1", "hello", context, stream=stream)
            assert len(cloud.requests) == 1  # tried once, failed over to local
            plan = first["route_log"][0]
            assert (plan["routed_leg"], plan["leg"], plan["attempts"][0]["kind"]) == (
                "cloud",
                "local",
                "server_error",
            )
            second = await b.turn("outage-2", "hello", context, stream=stream)
            assert len(cloud.requests) == 1, "the other worker sent a request to the provider in cooldown"
            other = second["route_log"][0]
            assert (other["routed_leg"], other["leg"], other["attempts"]) == ("cloud", "local", [])


GOOD = json.dumps({"items": [{"kind": "fact", "text": "The user prefers tabs."}]})


async def memory_items(database: str) -> list[Any]:
    from langgraph.store.postgres.aio import AsyncPostgresStore

    from fusion_graph import memory

    async with AsyncPostgresStore.from_conn_string(database) as store:
        return await store.asearch(memory.namespace("fusion", "anonymous"), limit=100)


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_a_memory_job_pending_on_a_killed_worker_is_finished_once_by_another(
    postgres_db: str, tmp_path: Path, how: str
) -> None:
    held = threading.Event()
    jobs: list[dict[str, Any]] = []

    def local_reply(body: dict[str, Any]) -> Reply:
        if "response_format" not in body:
            return Reply(content="local answer")
        jobs.append(body)
        return Reply(content=GOOD, hold=held if len(jobs) == 1 else None)  # the first job hangs

    stream = how == "messages"
    context = {"memory_mode": "background", "cloud_share": 30}
    with FakeOpenAI([Reply(content="the plan's answer")]) as cloud, FakeOpenAI(local_reply) as local:
        env = shared_env(
            postgres_db,
            FUSION_CLOUD_BASE_URL=cloud.base_url,
            FUSION_LOCAL_BASE_URL=local.base_url,
            FUSION_MEMORY_CLAIM_LEASE_S="2",
        )
        try:
            async with start_workers(postgres_db, env, tmp_path) as (a, b):
                await a.turn("remembering", "I prefer tabs.", context, stream=stream)
                for _ in range(200):  # the job's request reached the model and hangs there
                    if jobs:
                        break
                    await asyncio.sleep(0.05)
                assert len(jobs) == 1
                await asyncio.to_thread(a.kill)  # the worker dies with the job in flight
                await asyncio.sleep(3)  # its claim lapses (no heartbeat any more)
                second = await b.turn("remembering", "And spaces?", context, stream=stream)
                await b.sweep()  # wait for the job the turn took over
                third = await b.turn("remembering", "Thanks.", context, stream=stream)
        finally:
            held.set()
    assert len(jobs) >= 2  # the killed worker's job ran again on the other one
    items = await memory_items(postgres_db)
    written = [item for item in items if item.value.get("turn") == 0]
    assert len(written) == 1 and written[0].value["text"] == "The user prefers tabs."  # written once
    folded = [r for r in third["route_log"] if r["kind"] == "memory" and r["turn"] == 0 and r["provider"]]
    assert len(folded) == 1 and folded[0]["memory"]["attempt"] == 2  # in the thread's log once, by the re-run
    texts = [m["text"] for m in third["messages"] if m["type"] == "human"]
    assert texts.count("I prefer tabs.") == 1 and texts.count("And spaces?") == 1  # nothing lost or doubled
    assert len(second["route_log"]) < len(third["route_log"])


async def test_a_second_run_of_a_thread_in_another_process_is_refused_and_writes_nothing(
    postgres_db: str, tmp_path: Path
) -> None:
    held = threading.Event()

    def cloud_reply(body: dict[str, Any]) -> Reply:
        return Reply(content="first answer", hold=held)

    with FakeOpenAI(cloud_reply) as cloud, FakeOpenAI([Reply(content="local")]) as local:
        env = shared_env(
            postgres_db, FUSION_CLOUD_BASE_URL=cloud.base_url, FUSION_LOCAL_BASE_URL=local.base_url
        )
        context = {"cloud_share": 100, "sub_runners": "off"}
        try:
            async with start_workers(postgres_db, env, tmp_path) as (a, b):
                first = asyncio.create_task(a.turn("busy", "first question", context))
                for _ in range(200):
                    if cloud.requests:
                        break
                    await asyncio.sleep(0.05)
                assert cloud.requests, "the first run never reached the cloud"
                with pytest.raises(
                    RuntimeError, match="ThreadBusy: thread 'busy' is running in another process"
                ):
                    await b.turn("busy", "second question", context)
                held.set()
                done = await first
        finally:
            held.set()
    texts = [m["text"] for m in done["messages"]]
    assert texts == ["first question", "first answer"]  # the refused run left nothing behind
    assert len(cloud.requests) == 1
