"""Slot turns: at most one request a slot, first come first served, across event loops."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fusion_graph.coordination.slot_turns import SlotTurns
from fusion_graph.errors import SlotBusy


async def test_requests_on_one_slot_run_one_at_a_time_in_arrival_order() -> None:
    turns = SlotTurns()
    running: list[int] = []
    order: list[int] = []
    overlap = 0

    async def request(n: int) -> None:
        nonlocal overlap
        async with turns.hold(("box", 0), wait_s=10):
            running.append(n)
            overlap = max(overlap, len(running))
            order.append(n)
            await asyncio.sleep(0.01)
            running.remove(n)

    await asyncio.gather(*(request(n) for n in range(8)))
    assert overlap == 1
    assert order == list(range(8))
    assert not turns.busy(("box", 0))


async def test_other_slots_do_not_wait() -> None:
    turns = SlotTurns()
    async with turns.hold(("box", 0), wait_s=10), turns.hold(("box", 1), wait_s=0.01):
        assert turns.busy(("box", 0)) and turns.busy(("box", 1))


async def test_a_wait_that_runs_out_is_refused_and_the_turn_goes_on_to_the_next() -> None:
    turns = SlotTurns()
    release = asyncio.Event()

    async def holder() -> None:
        async with turns.hold("s", wait_s=1):
            await release.wait()

    task = asyncio.create_task(holder())
    await asyncio.sleep(0)
    with pytest.raises(SlotBusy, match="stayed busy"):
        async with turns.hold("s", wait_s=0.05):
            pass
    got: list[str] = []

    async def later() -> None:
        async with turns.hold("s", wait_s=5):
            got.append("later")

    waiting = asyncio.create_task(later())
    await asyncio.sleep(0.01)
    release.set()
    await asyncio.gather(task, waiting)
    assert got == ["later"]
    assert not turns.busy("s")


async def test_a_cancelled_waiter_gives_up_its_place_without_losing_the_turn() -> None:
    turns = SlotTurns()
    await turns.take("s", wait_s=1)
    cancelled = asyncio.create_task(turns.take("s", wait_s=5))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    turns.give_back("s")
    async with turns.hold("s", wait_s=0.1):  # nobody kept it
        assert turns.busy("s")


def test_a_turn_given_back_on_one_event_loop_wakes_a_waiter_on_another() -> None:
    turns = SlotTurns()
    taken = threading.Event()
    woke: list[str] = []

    async def first() -> None:
        await turns.take("s", wait_s=1)
        taken.set()
        await asyncio.sleep(0.1)
        turns.give_back("s")

    async def second() -> None:
        taken.wait(5)
        async with turns.hold("s", wait_s=5):
            woke.append("second")

    other = threading.Thread(target=lambda: asyncio.run(second()))
    other.start()
    asyncio.run(first())
    other.join(10)
    assert woke == ["second"]
