"""Shared placement and shared cooldowns without a database: the pure slot choice, the fallback, the board."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage

from fusion_graph.coordination.shared_base import SharedStateUnavailable
from fusion_graph.coordination.shared_state import SharedState
from fusion_graph.coordination.slot_leases import LeaseRow, LocalLeases, choose_slot
from fusion_graph.providers.chain import Ask, HealthPolicy, ProviderChain, ask, board_key
from fusion_graph.providers.models import Provider, build_local_model
from fusion_graph.providers.placement import NOWHERE, LeasedPlacement, Placement, ServerSlots
from fusion_graph.providers.pricing import FREE, Pricing
from fusion_graph.providers.slots import routing_key
from fusion_graph.routing.records import StepKind
from fusion_graph.routing.score import RouteDecision
from fusion_graph.settings import FusionSettings

BOXES = ("http://a", "http://b")


def row(box: str, slot: int, holder: str, *, live: bool = True, used: float = 0.0) -> LeaseRow:
    return LeaseRow(box, slot, holder, live, used)


def test_a_new_thread_takes_a_free_slot_on_the_box_with_the_fewest_threads() -> None:
    rows = [row("http://a", 0, "t1"), row("http://a", 1, "t2"), row("http://b", 0, "t3")]
    claim = choose_slot(rows, BOXES, 4, "t4", preferred=0)
    assert (claim.box, claim.slot, claim.guest) == ("http://b", 1, False)  # b has 1 thread, a has 2


def test_a_thread_keeps_its_live_slot_and_gets_its_lapsed_one_back_when_nobody_took_it() -> None:
    assert choose_slot([row("http://a", 2, "t1")], BOXES, 4, "t1", preferred=0).slot == 2
    lapsed = [row("http://b", 3, "t1", live=False, used=5.0)]
    claim = choose_slot(lapsed, BOXES, 4, "t1", preferred=0)
    assert (claim.box, claim.slot) == ("http://b", 3)  # its cache may still be there
    taken = [row("http://b", 3, "t1", live=False, used=5.0), row("http://b", 3, "t9")]
    assert (
        choose_slot(taken, BOXES, 4, "t1", preferred=3).box,
        choose_slot(taken, BOXES, 4, "t1", preferred=3).slot,
    ) != (
        "http://b",
        3,
    )


def test_when_every_slot_is_held_a_thread_borrows_the_least_recently_used_one_without_holding_it() -> None:
    rows = [
        row(box, slot, f"{box}{slot}", used=float(10 * slot + len(box))) for box in BOXES for slot in range(2)
    ]
    claim = choose_slot(rows, BOXES, 2, "newcomer", preferred=1)
    assert claim.guest and (claim.box, claim.slot) == ("http://a", 0)


async def test_an_unreachable_shared_state_places_on_no_slot_and_says_so() -> None:
    """Without the database no turn can be had across processes: the request names no slot at all."""
    settings = FusionSettings(local_slots=4, local_base_url="http://127.0.0.1:9/v1")
    link = Provider("local:local", "local", build_local_model(settings), Pricing.flat(FREE))

    async def no_props(link: Provider) -> Any:
        return None

    state = SharedState("postgresql://nobody@127.0.0.1:9/none?connect_timeout=1")
    placer = LeasedPlacement(state, ServerSlots(settings, no_props), boxes=(), box_model=None)
    try:
        placed = await placer.place(link, "thread-1")
        async with placed.hold() as sent:
            assert sent.slot is None and sent.body("local") is None
            # While it runs, this process names no slot for anyone (it may be on any idle slot).
            other = await placer.place(link, "thread-2")
            assert other.slot is None
            assert "still running" in str(other.notes["lease"])
    finally:
        await state.aclose()
    assert placed.slot is None
    assert str(placed.notes["lease"]).startswith("unplaced: the shared state's Postgres cannot be reached")


class Board:
    """A health board in memory: what another worker announced, and what this one announces."""

    def __init__(self) -> None:
        self.shared: dict[str, tuple[float, str | None]] = {}
        self.announced: list[tuple[str, float | None]] = []

    def cooldown(self, provider: str) -> tuple[float, str | None] | None:
        return self.shared.get(provider)

    async def publish_cooldown(self, provider: str, until: float | None, error: str | None) -> None:
        self.announced.append((provider, until))


class Failing(GenericFakeChatModel):
    async def _agenerate(self, *args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("connection refused")


def links() -> tuple[Provider, Provider]:
    cloud = Provider("cloud:m", "cloud", Failing(messages=iter([])), Pricing.flat(FREE))
    local = Provider(
        "local:m", "local", GenericFakeChatModel(messages=iter([AIMessage("ok")] * 5)), Pricing.flat(FREE)
    )
    return cloud, local


async def test_a_cooldown_another_worker_announced_keeps_this_worker_off_the_provider() -> None:
    board = Board()
    cloud, local = links()
    chain = ProviderChain([cloud, local], board=board)
    board.shared[board_key(cloud)] = (time.time() + 60, "503 elsewhere")
    tried: list[str] = []

    async def invoke(link: Provider) -> AIMessage:
        tried.append(link.id)
        return AIMessage("answer")

    outcome = await chain.call(invoke, preferred_leg="cloud")
    assert tried == ["local:m"] and outcome.provider is local and outcome.attempts == ()
    assert chain.health("cloud:m").last_error == "503 elsewhere"


async def test_a_cooldown_this_worker_trips_is_announced_to_the_others() -> None:
    board = Board()
    cloud, local = links()
    chain = ProviderChain([cloud, local], board=board, policy=HealthPolicy(allowed_failures=0, cooldown_s=30))

    async def invoke(link: Provider) -> AIMessage:
        if link.leg == "cloud":
            raise ConnectionError("connection refused")
        return AIMessage("answer")

    began = time.time()
    await chain.call(invoke, preferred_leg="cloud")
    [(provider, until)] = board.announced
    assert provider == board_key(cloud) and until is not None and began + 29 < until < time.time() + 31


@pytest.mark.parametrize("with_board", [True, False])
async def test_without_a_board_nothing_is_announced(with_board: bool) -> None:
    board = Board()
    cloud, local = links()
    chain = ProviderChain(
        [cloud, local], board=board if with_board else None, policy=HealthPolicy(allowed_failures=0)
    )

    async def invoke(link: Provider) -> AIMessage:
        if link.leg == "cloud":
            raise ConnectionError("connection refused")
        return AIMessage("answer")

    await chain.call(invoke, preferred_leg="cloud")
    assert bool(board.announced) is with_board


class TurnPlacer:
    """Places every local request on a slot whose requests take turns, and notes when a turn is held."""

    def __init__(self) -> None:
        self.events: list[str] = []

    @contextlib.asynccontextmanager
    async def turn(self, placement: Placement) -> AsyncIterator[Placement]:
        self.events.append("turn taken")
        try:
            yield placement
        finally:
            self.events.append("turn given back")

    async def place(self, link: Provider, thread_id: str, *, reflection: bool = False) -> Placement:
        return Placement(slot=3, turn=self.turn) if link.leg == "local" else NOWHERE

    def unreachable(self, placement: Placement, error: BaseException) -> bool:
        return False

    async def release(self, thread_id: str) -> None:
        return None


class Noting(GenericFakeChatModel):
    """Answers "ok" and notes the call where the placer notes its turns."""

    placer: Any  # the placer itself (a list field would be copied on validation)

    async def _agenerate(self, *args: Any, **kwargs: Any) -> Any:
        self.placer.events.append("model called")
        return await super()._agenerate(*args, **kwargs)


@pytest.mark.parametrize("kind", ["sample", "memory", "local"])
async def test_every_request_to_a_slot_that_takes_turns_is_sent_inside_its_turn(kind: StepKind) -> None:
    placer = TurnPlacer()
    model = Noting(messages=iter([AIMessage("ok")]), placer=placer)
    chain = ProviderChain([Provider("local:m", "local", model, Pricing.flat(FREE))])
    decision = RouteDecision(leg="local", score=None, threshold=None, reason="a side inference")
    call = Ask(kind=kind, turn=0, step=0, decision=decision, prompt=[HumanMessage("hi")], thread_id="t")

    asked = await ask(call, chain=chain, placer=placer)

    assert asked.answer is not None and asked.answer.content == "ok"
    assert placer.events == ["turn taken", "model called", "turn given back"]


async def test_a_shared_slot_s_turn_is_refused_when_the_database_is_down() -> None:
    """No turn across processes without the database: the caller must not name the slot."""
    state = SharedState("postgresql://nobody@127.0.0.1:9/none?connect_timeout=1")
    try:
        with pytest.raises(SharedStateUnavailable):
            async with state.locks.slot_turn("http://a", 3, wait_s=1):
                pass
    finally:
        await state.aclose()


def test_when_every_slot_is_held_the_least_recently_used_idle_lease_goes_to_the_thread_that_needs_it() -> (
    None
):
    rows = [
        LeaseRow("http://a", 0, "running", True, 1.0),
        LeaseRow("http://a", 1, "idle-new", True, 5.0, idle=True),
        LeaseRow("http://b", 0, "idle-old", True, 2.0, idle=True),
        LeaseRow("http://b", 1, "running-2", True, 0.5),
    ]
    claim = choose_slot(rows, BOXES, 2, "newcomer", preferred=0)
    assert (claim.box, claim.slot, claim.guest, claim.took_from) == ("http://b", 0, False, "idle-old")
    # Its own idle lease is simply kept; with every thread running, a newcomer is a guest.
    mine = choose_slot(rows, BOXES, 2, "idle-new", preferred=0)
    assert (mine.box, mine.slot, mine.took_from) == ("http://a", 1, None)
    busy = [r if not r.idle else LeaseRow(r.box, r.slot, r.holder, True, r.used_at) for r in rows]
    assert choose_slot(busy, BOXES, 2, "newcomer", preferred=0).guest


def test_a_returning_thread_stays_on_the_box_whose_host_cache_has_its_prefix() -> None:
    rows = [
        LeaseRow("http://a", 0, "idle-oldest", True, 1.0, idle=True),
        LeaseRow("http://a", 1, "running", True, 2.0),
        LeaseRow("http://b", 0, "idle-newer", True, 5.0, idle=True),
        LeaseRow("http://b", 1, "running-2", True, 3.0),
    ]
    back = choose_slot(rows, BOXES, 2, "returning", preferred=0, home="http://b")
    assert (back.box, back.slot, back.took_from) == ("http://b", 0, "idle-newer")  # not a's older lease
    new = choose_slot(rows, BOXES, 2, "new", preferred=0)
    assert (new.box, new.slot) == ("http://a", 0)  # no home: the least recently used idle lease
    full = [*rows[:2], LeaseRow("http://b", 0, "busy", True, 5.0), rows[3]]
    waiting = choose_slot(full, BOXES, 2, "returning", preferred=0, home="http://b", stay_home=True)
    assert waiting.home_full and waiting.guest
    moved = choose_slot(full, BOXES, 2, "returning", preferred=0, home="http://b")
    assert (moved.box, moved.slot, moved.home_full) == (
        "http://a",
        0,
        False,
    )  # moves rather than share a slot


async def test_in_this_process_a_running_threads_slot_is_never_taken_and_an_idle_one_is() -> None:
    settings = FusionSettings(local_slots=3, local_base_url="http://127.0.0.1:9/v1")  # 2 conversation slots
    link = Provider("local:local", "local", build_local_model(settings), Pricing.flat(FREE))

    async def no_props(link: Provider) -> Any:
        return None

    placer = LeasedPlacement(LocalLeases(), ServerSlots(settings, no_props), boxes=(), box_model=None)
    one, two = await placer.place(link, "t1"), await placer.place(link, "t2")
    assert {one.slot, two.slot} == {0, 1}
    # Both threads are running: a guest names the least recently used slot, inside that slot's turn.
    third = await placer.place(link, "t3")
    assert third.slot == one.slot and third.notes["guest"] and third.turn is not None
    await placer.release("t1")
    await placer.release("t3")
    third = await placer.place(link, "t3")
    assert third.slot == one.slot and third.notes["took_idle_slot"]
    again = await placer.place(link, "t3")  # the takeover is news once; the lease is simply used after
    assert again.slot == one.slot and "took_idle_slot" not in again.notes
    assert (await placer.place(link, "t2")).slot == two.slot  # a running thread keeps its slot
    back = await placer.place(link, "t1")  # t1 comes back while both run: a guest on a named slot
    assert back.notes["guest"] and back.slot in {0, 1}


async def test_a_returning_thread_waits_for_its_home_box_about_as_long_as_runs_hold_slots_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A move prefills the thread's whole prompt again: while runs are slow, waiting at home is cheaper."""
    settings = FusionSettings(local_slots=2, slot_home_wait_s=2, request_timeout=30)
    link = Provider("local:local", "local", build_local_model(settings), Pricing.flat(FREE))

    async def no_props(link: Provider) -> Any:
        return {"total_slots": 2}

    boxes = ("http://a:8080", "http://b:8080")
    placer = LeasedPlacement(LocalLeases(), ServerSlots(settings, no_props), boxes=boxes, box_model=None)
    named = placer.boxes
    assert placer.home_wait_s(named) == 2  # nothing measured yet: the setting
    slots = await placer.slots.pool(link)
    assert slots is not None
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    for run in range(4):  # runs that hold their slot 8 s each, on whichever box they got
        for thread in ("t1", "t2"):
            holder = routing_key(f"{thread}-{run}")
            await placer._claim(link, "pool", named, holder, slots)
        clock[0] += 8
        for thread in ("t1", "t2"):
            await placer.release(f"{thread}-{run}")
    assert 7 < placer.home_wait_s(named) <= 8  # about one run
    placer.slots.settings = FusionSettings(local_slots=2, slot_home_wait_s=0)
    assert placer.home_wait_s(named) == 0  # 0: a returning thread never waits
