"""The shared state on a real PostgreSQL server, as several worker processes use it.

Each ``SharedState`` is a worker's own (its connections, its loop thread, its
copy of the cooldowns); two of them on one database stand for two processes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from fusion_graph.coordination.shared_base import SharedStateUnavailable
from fusion_graph.coordination.shared_state import SharedState
from fusion_graph.coordination.slot_leases import LeaseAsk
from fusion_graph.errors import SlotBusy

BOXES = ("http://box-a:8080", "http://box-b:8080")


@pytest.fixture(name="pair")
async def pair_fixture(postgres_db: str) -> AsyncIterator[tuple[SharedState, SharedState]]:
    a, b = SharedState(postgres_db), SharedState(postgres_db)
    try:
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


async def test_slot_claims_from_two_workers_never_share_a_slot_and_fill_boxes_evenly(
    pair: tuple[SharedState, SharedState],
) -> None:
    a, b = pair
    holders = [f"t{i}" for i in range(8)]
    claims = await asyncio.gather(
        *(
            (a if i % 2 else b).leases.claim_slot(LeaseAsk("gw", BOXES, 4, holder, 60.0, preferred=i % 4))
            for i, holder in enumerate(holders)
        )
    )
    places = {(c.box, c.slot) for c in claims}
    assert len(places) == 8 and not any(c.guest for c in claims)
    assert sorted(sum(c.box == box for c in claims) for box in BOXES) == [4, 4]
    # The other worker renews the same lease instead of handing out another slot.
    again = await a.leases.claim_slot(LeaseAsk("gw", BOXES, 4, "t1", 60.0, preferred=0))
    assert (again.box, again.slot) == (claims[1].box, claims[1].slot)
    # A ninth thread finds every slot held: it borrows one without taking it.
    guest = await b.leases.claim_slot(LeaseAsk("gw", BOXES, 4, "t9", 60.0, preferred=0))
    assert guest.guest
    table = await a.leases.slot_table("gw")
    assert len(table) == 8 and {holder for _, _, holder, _ in table} == set(holders)


async def test_a_lapsed_lease_goes_to_a_new_thread_and_its_holder_gets_its_old_slot_back_when_free(
    pair: tuple[SharedState, SharedState],
) -> None:
    a, b = pair
    first = await a.leases.claim_slot(LeaseAsk("one", ("http://box:8080",), 2, "old", 0.2, preferred=0))
    await asyncio.sleep(0.5)
    assert await b.leases.box_of("one", "old") is None  # lapsed: idle for longer than its lease
    back = await a.leases.claim_slot(LeaseAsk("one", ("http://box:8080",), 2, "old", 60.0, preferred=1))
    assert (back.box, back.slot) == (first.box, first.slot)  # its cache may still be there
    other = await b.leases.claim_slot(
        LeaseAsk("one", ("http://box:8080",), 2, "new", 60.0, preferred=first.slot)
    )
    assert other.slot != first.slot


async def test_a_cooldown_announced_by_one_worker_reaches_the_other(
    pair: tuple[SharedState, SharedState],
) -> None:
    a, b = pair
    await b.leases.claim_slot(
        LeaseAsk("warm", ("http://box:8080",), 1, "x", 60.0, preferred=0)
    )  # b is connected, listening
    until = time.time() + 30
    await a.health.publish_cooldown("cloud:m@https://api.example", until, "APIStatusError: 503")
    for _ in range(100):
        if b.health.cooldown("cloud:m@https://api.example") is not None:
            break
        await asyncio.sleep(0.05)
    seen = b.health.cooldown("cloud:m@https://api.example")
    assert seen is not None and abs(seen[0] - until) < 1e-3 and "503" in (seen[1] or "")
    await a.health.publish_cooldown("cloud:m@https://api.example", None, None)
    for _ in range(100):
        if b.health.cooldown("cloud:m@https://api.example") is None:
            break
        await asyncio.sleep(0.05)
    assert b.health.cooldown("cloud:m@https://api.example") is None


async def test_a_memory_job_is_claimed_once_taken_over_when_its_lease_lapses_and_finished_once(
    pair: tuple[SharedState, SharedState],
) -> None:
    a, b = pair
    assert await a.jobs.claim_job("t:0:1", "worker-a", 60.0) == 1
    assert await b.jobs.claim_job("t:0:1", "worker-b", 60.0) is None  # running: nobody else takes it
    assert await a.jobs.renew_job("t:0:1", "worker-a", 0.2)
    await asyncio.sleep(0.5)  # worker a stopped renewing (its loop froze, it died)
    assert await b.jobs.claim_job("t:0:1", "worker-b", 60.0) == 2
    assert not await a.jobs.renew_job("t:0:1", "worker-a", 60.0)  # a learns it lost the job: writes nothing
    assert not await a.jobs.finish_job("t:0:1", "worker-a")
    assert await b.jobs.finish_job("t:0:1", "worker-b")
    assert await a.jobs.claim_job("t:0:1", "worker-a", 60.0) is None  # done: never run again
    claims = await a.jobs.job_claims(["t:0:1", "missing"])
    assert claims == {"t:0:1": ("worker-b", 2, True, False)}  # done: its lease ended with it


async def test_a_thread_runs_in_one_process_at_a_time(pair: tuple[SharedState, SharedState]) -> None:
    a, b = pair
    async with a.locks.thread_run("fusion:t") as held:
        assert held
        async with b.locks.thread_run("fusion:t") as other:
            assert not other
        async with b.locks.thread_run("fusion:u") as unrelated:
            assert unrelated
    async with b.locks.thread_run("fusion:t") as after:
        assert after


async def test_an_unreachable_database_is_reported_at_once_after_the_first_failure() -> None:
    state = SharedState("postgresql://nobody@127.0.0.1:9/none?connect_timeout=1")
    try:
        with pytest.raises(SharedStateUnavailable, match="cannot be reached"):
            await state.leases.claim_slot(LeaseAsk("p", ("http://b",), 1, "h", 60.0, preferred=0))
        began = time.monotonic()
        with pytest.raises(SharedStateUnavailable):
            await state.leases.box_of("p", "h")
        assert time.monotonic() - began < 1.0  # no second wait for the same dead database
    finally:
        await state.aclose()


async def test_requests_on_one_shared_slot_take_turns_across_workers(
    pair: tuple[SharedState, SharedState],
) -> None:
    a, b = pair
    order: list[str] = []

    async def job(state: SharedState, name: str, hold: float) -> None:
        async with state.locks.slot_turn("http://box-a:8080", 8, wait_s=10):
            order.append(f"{name} in")
            await asyncio.sleep(hold)
            order.append(f"{name} out")

    first = asyncio.create_task(job(a, "a", 0.5))
    await asyncio.sleep(0.2)  # a holds the slot
    await asyncio.gather(first, job(b, "b", 0.0))
    assert order == ["a in", "a out", "b in", "b out"]  # b waited for a's request to end
    # Another slot, or the same slot of another box, is not held up.
    async with (
        b.locks.slot_turn("http://box-a:8080", 7, wait_s=0.5),
        a.locks.slot_turn("http://box-b:8080", 8, wait_s=0.5),
    ):
        pass


async def test_a_slot_held_past_the_wait_is_refused_as_busy_not_as_a_database_failure(
    pair: tuple[SharedState, SharedState],
) -> None:
    a, b = pair
    async with a.locks.slot_turn("http://box-a:8080", 3, wait_s=5):
        with pytest.raises(SlotBusy, match="stayed busy"):
            async with b.locks.slot_turn("http://box-a:8080", 3, wait_s=0.3):
                pass
        # The database answered all along: placement is still shared, not fallen back.
        assert await b.leases.claim_slot(LeaseAsk("busy", ("http://box-a:8080",), 2, "t", 60.0, preferred=0))
    async with b.locks.slot_turn("http://box-a:8080", 3, wait_s=0.5):  # given back: free again
        pass


async def test_a_returning_thread_waits_for_its_home_box_and_an_idle_lease_goes_to_whoever_needs_it(
    pair: tuple[SharedState, SharedState],
) -> None:
    a, b = pair
    first = await a.leases.claim_slot(LeaseAsk("crowd", BOXES, 1, "t1", 60.0, preferred=0))
    second = await b.leases.claim_slot(LeaseAsk("crowd", BOXES, 1, "t2", 60.0, preferred=0))
    assert first.box != second.box
    await a.leases.release_slot("crowd", "t1")
    await b.leases.release_slot("crowd", "t2")
    taken = await b.leases.claim_slot(
        LeaseAsk("crowd", BOXES, 1, "t3", 60.0, preferred=0)
    )  # every slot held, both idle
    assert (taken.box, taken.took_from) == (first.box, "t1")  # the least recently used idle lease
    home_full = await a.leases.claim_slot(
        LeaseAsk("crowd", BOXES, 1, "t1", 60.0, preferred=0, stay_home=True)
    )
    assert home_full.home_full  # t3 runs on t1's home box: t1 waits rather than move
    moved = await a.leases.claim_slot(LeaseAsk("crowd", BOXES, 1, "t1", 60.0, preferred=0))
    assert (moved.box, moved.took_from) == (second.box, "t2")  # waited long enough: it moves, once
