"""Placement: which llama-server slot (and which box) a thread's local request goes to.

Every local request (a step, a repair, a memory job, an MCP sample) asks the
graph's one ``Placer`` for a ``Placement`` and sends it inside the placement's
turn (``Placement.hold``): the slot as ``id_slot`` + ``cache_prompt``, the
headers (the thread's routing key) with the request, straight to the box the
placement names.

``LeasedPlacement`` places by leases, one rule (``coordination.slot_leases.choose_slot``)
on one of two tables: this process's own (``LocalLeases``: an embedded graph,
one server process, one process over several boxes) or the deployment's Postgres
(``SharedState``: several worker processes). A new thread takes a free slot on
the box with the fewest threads; a run's end marks its lease idle for a thread
that needs one; a running thread's slot is never given away; when every slot's
thread is running, a request is a guest on a slot it does not hold.

The rule that keeps answers right under load (``coordination.slot_turns`` says
why): **a request names a slot only while it holds that slot's turn**, guests
included, so no request ever names a slot another request is running on. A
request that fails (a client-side timeout, a dropped connection, a cancelled
run) gives its turn back only once llama-server shows the slot idle: the server
may still be generating there. When the deployment's database cannot be reached,
no turn can be taken across processes, so the request names no slot at all
(llama-server never puts an unnamed request on a busy slot), and this process
names none again until those requests have ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from langchain_core.language_models import BaseChatModel

from fusion_graph.coordination.shared_base import SharedStateUnavailable
from fusion_graph.coordination.shared_locks import AdvisoryLocks
from fusion_graph.coordination.shared_state import SharedState
from fusion_graph.coordination.slot_leases import LeaseAsk, SlotClaim
from fusion_graph.coordination.slot_turns import TURNS, SlotTurns
from fusion_graph.errors import causes
from fusion_graph.providers.llama_server import ServerProps, slot_states, warm_slot
from fusion_graph.providers.models import Provider
from fusion_graph.providers.slots import SlotPool, box_name, routing_key
from fusion_graph.routing.records import PlacementRecord
from fusion_graph.routing.score import Leg
from fusion_graph.settings import FusionSettings

logger = logging.getLogger(__name__)

#: A turn: held around one request on a placement, it yields the placement the request is sent with.
Turn = Callable[["Placement"], AbstractAsyncContextManager["Placement"]]


@dataclass(frozen=True)
class Placement:
    """Where one local request goes.

    Attributes:
        slot: The llama-server slot (``id_slot``); ``None``: not a llama-server, or none known.
        headers: Headers the request carries (the routing key), ``None``: none.
        box: The box the placer chose (``None``: the local endpoint itself).
        notes: What the record keeps about the placement (its ``placement``), e.g. a fallback's reason.
        model: The model that reaches ``box`` directly (``None``: the link's own model).
        turn: The slot's turn, held around the request (``None``: no slot is named).
    """

    slot: int | None = None
    headers: Mapping[str, str] | None = None
    box: str | None = None
    notes: PlacementRecord = field(default_factory=lambda: PlacementRecord())
    model: BaseChatModel | None = None
    """The model that reaches ``box`` directly (``None``: the link's own model)."""
    turn: Turn | None = None
    """The slot's turn, held around the request (``None``: no slot is named)."""

    def body(self, leg: Leg) -> dict[str, Any] | None:
        """The request-body fields of the placement (``slot_body``); ``None`` off a local slot."""
        return slot_body(leg, self.slot)

    def hold(self) -> AbstractAsyncContextManager[Placement]:
        """Hold the slot's turn around one request; yields the placement to send it with.

        That is this placement, or one naming no slot when the turn could not be
        taken across processes (its notes say why).
        """
        return self.turn(self) if self.turn is not None else _as_is(self)


@contextlib.asynccontextmanager
async def _as_is(placement: Placement) -> AsyncIterator[Placement]:
    yield placement


#: A request with nowhere in particular to go (a cloud link, a server with no slots).
NOWHERE = Placement()


class Placer(Protocol):
    """Decides where a thread's local requests go."""

    async def place(self, link: Provider, thread_id: str, *, reflection: bool = False) -> Placement:
        """The placement of the next request of ``thread_id`` on ``link``.

        ``reflection``: the reserved reflection slot (memory jobs, MCP samples),
        which never holds a conversation.
        """
        ...

    def unreachable(self, placement: Placement, error: BaseException) -> bool:
        """Learn that ``placement``'s box failed with ``error``; whether another box may take the request."""
        ...

    async def release(self, thread_id: str) -> None:
        """``thread_id``'s run ended: its slot may go to a thread that needs one now (never raises)."""
        ...


class FixedPlacement:
    """Every local request at one placement: for callers that pin a slot themselves (benchmarks)."""

    def __init__(self, placement: Placement = NOWHERE) -> None:
        """Place every local request at ``placement``."""
        self.placement = placement

    async def place(self, link: Provider, thread_id: str, *, reflection: bool = False) -> Placement:
        """``placement`` on a local link, nowhere in particular on a cloud one."""
        return self.placement if link.leg == "local" else NOWHERE

    def unreachable(self, placement: Placement, error: BaseException) -> bool:
        """Nowhere else to go: the placement is fixed."""
        return False

    async def release(self, thread_id: str) -> None:
        """Nothing to release: the placement is fixed."""


def slot_body(leg: Leg, slot: int | None) -> dict[str, Any] | None:
    """Extra request-body fields for a request routed to ``leg``.

    Local requests pin their slot and ask for prompt caching; cloud requests
    carry neither (a cloud API would reject or ignore them). The leg is the one
    of the link actually called, never whichever provider is "active".
    """
    if leg != "local" or slot is None:
        return None
    return {"id_slot": slot, "cache_prompt": True}


#: What llama-server says about the server behind a local link (``None``: not llama-server, not reachable).
PropsOf = Callable[[Provider], Awaitable[ServerProps | None]]


class ServerSlots:
    """How many slots a local server has, and which headers its requests carry.

    The slot count is ``local_slots`` when set, else the server's own
    ``total_slots`` (``/props``, asked through ``props_of``); over several boxes
    (``local_workers``) it is per box.
    """

    def __init__(self, settings: FusionSettings, props_of: PropsOf) -> None:
        """Count by ``settings`` (slots, the reflection slot, the routing header), asking ``props_of``."""
        self.settings, self.props_of = settings, props_of
        self._pools: dict[tuple[str, int, bool], SlotPool] = {}

    async def pool(self, link: Provider) -> SlotPool | None:
        """The slots of a local llama-server link, or ``None`` for anything else.

        Without ``local_slots``, a local server that is not llama-server (no
        ``/props``) runs without slot affinity and one that cannot be reached
        gets no slot for this call.
        """
        url = link.base_url
        if link.leg != "local" or url is None:
            return None
        total = self.settings.local_slots  # the operator's count wins, whatever /props says
        reserve = self.settings.reserve_reflection_slot
        if not total:
            props = await self.props_of(link)
            if props is None:
                return None
            total = props.total_slots
        key = (url, total, reserve)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = SlotPool(total, reserve_reflection=reserve)
        return pool

    def headers(self, link: Provider, thread_id: str) -> dict[str, str] | None:
        """Headers of a local request of ``thread_id``: its routing key (``local_routing_header``)."""
        header = self.settings.local_routing_header
        if link.leg != "local" or not header:
            return None
        return {header: routing_key(thread_id)}


#: Builds (once per box) the model that reaches a box directly, from its base URL without ``/v1``.
BoxModel = Callable[[str], Awaitable[BaseChatModel]]
#: Seconds a guest (every slot was held) waits before it asks for a slot of its own again.
GUEST_RETRY_S = 5.0
#: Seconds between two asks while a returning thread waits for a slot on its home box.
HOME_POLL_S = 0.05
#: Weight of the latest run in a box's moving average of how long runs hold a slot.
RUN_AVERAGE = 0.3
#: Seconds a failed request waits, at most, for llama-server to show its slot idle before its turn is
#: given back (llama-server cancels a request whose connection closed within about a second).
SETTLE_S = 15.0
#: Seconds between two looks at ``/slots`` while a failed request's slot settles.
SETTLE_POLL_S = 0.1
#: Seconds a failed request's turn is kept when the server cannot show its slots (``--no-slots``).
SETTLE_BLIND_S = 2.0
#: Gives a slot's turn back (from any event loop).
GiveBack = Callable[[], Awaitable[None]]
#: Seconds a box that refused a connection is left out of placement before it is tried again.
BOX_DOWN_S = 10.0
#: What says that a box could not be connected to at all (nothing was sent to it).
_REFUSED = (httpx.ConnectError, httpx.ConnectTimeout, ConnectionRefusedError)
#: Seconds a warm-up waits for a slot's turn: a busy slot holds a prompt soon enough without one.
WARM_WAIT_S = 0.05


def refused(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) says the connection itself failed: nothing was sent."""
    return any(isinstance(current, _REFUSED) for current in causes(error, context=True))


class LeaseTable(Protocol):
    """Where leases are kept and the rule (``slot_leases.choose_slot``) runs: Postgres or this process."""

    async def claim_slot(self, ask: LeaseAsk) -> SlotClaim:
        """Claim (or renew) the asking thread's slot in its pool."""
        ...

    async def release_slot(self, pool: str, holder: str) -> None:
        """Mark ``holder``'s lease idle."""
        ...

    async def box_of(self, pool: str, holder: str) -> str | None:
        """The box ``holder`` holds a live slot on."""
        ...


class LeasedPlacement:
    """Slot leases and slot turns, one rule on either table: this process's (``LocalLeases``) or shared.

    A thread's lease is claimed once and then used from this process's copy until
    half of it has run; the next use renews it (a lease is renewed by use, not by
    a round trip on every step). Its run's end marks it idle (``release``), so a
    thread that needs a slot now may take it over. When several boxes serve the
    local leg (``local_workers``), the placement names the box and the request
    goes to it directly (``box_model``); a box that refuses connections is left
    out for ``BOX_DOWN_S`` and its threads move (``unreachable``). Each box's
    slots are warmed once on first contact (``warm_slot``). With the
    deployment's table (``SharedState``), a database that cannot be reached
    places the request on no slot and the record says so (``placement.lease``);
    a turn never fails over it.
    """

    def __init__(
        self,
        table: LeaseTable | SharedState,
        slots: ServerSlots,
        *,
        boxes: tuple[str, ...],
        box_model: BoxModel | None,
        turns: SlotTurns = TURNS,
    ) -> None:
        """Lease slots in ``table`` over ``boxes`` (base URLs); ``box_model`` reaches one directly.

        ``table``: ``LocalLeases``, or the deployment's ``SharedState``, whose
        leases and slot turns (``locks``) then both span the processes. ``slots``
        says how many slots a local server has (``local_slots`` or its ``/props``)
        and which headers a request carries; ``turns``: the process's own.
        """
        self.slots = slots
        self.table: LeaseTable = table.leases if isinstance(table, SharedState) else table
        self.shared_locks: AdvisoryLocks | None = table.locks if isinstance(table, SharedState) else None
        self.boxes = tuple(box_name(box) for box in boxes)
        self.box_model = box_model
        self.turns = turns
        self._held: dict[tuple[str, str], tuple[SlotClaim, float]] = {}
        self._lock = threading.Lock()
        self._unnamed = 0
        """Requests of this process running on no named slot (sent while the database was down)."""
        self._down: dict[str, float] = {}
        self._warmed: set[str] = set()
        self._named: set[tuple[str, int]] = set()
        """Slots a request of this process named: they hold a prompt, a warm-up would only evict it."""
        self._runs: dict[tuple[str, str], tuple[str, float]] = {}
        """Per (pool, holder): the box of the thread's run in progress and when it took its slot."""
        self._run_s: dict[str, float] = {}
        """Per box: how long a thread's run has held a slot there lately (a moving average)."""

    # -- where -------------------------------------------------------------------------------

    def _pool(self, link: Provider) -> tuple[str, tuple[str, ...]]:
        """The pool's name (the local endpoint) and its boxes that answer (all, if none does)."""
        url = link.base_url or link.id
        boxes = self.boxes or (box_name(url),)
        now = time.monotonic()
        up = tuple(box for box in boxes if self._down.get(box, 0.0) <= now)
        return url, up or boxes

    async def _claim(
        self, link: Provider, pool: str, boxes: tuple[str, ...], holder: str, slots: SlotPool
    ) -> SlotClaim:
        """The thread's claim: this process's copy while it is fresh and its box answers, else the table's."""
        known = self._held.get((pool, holder))
        if known is not None and time.monotonic() < known[1] and known[0].box in boxes:
            return known[0]
        settings = self.slots.settings
        preferred = slots.preferred_slot(holder) if slots.total_slots > 1 else 0
        # Over several boxes, a returning thread waits a moment for a slot on the box that caches its
        # prefix before it moves to another box and prefills there once (``home_wait_s``).
        deadline = time.monotonic() + self.home_wait_s(boxes)
        while True:
            stay = len(boxes) > 1 and time.monotonic() < deadline
            ask = LeaseAsk(
                pool, boxes, slots.conversation_slots, holder, settings.slot_lease_s, preferred, stay
            )
            claim = await self.table.claim_slot(ask)
            if not claim.home_full:
                break
            await asyncio.sleep(HOME_POLL_S)
        fresh_for = GUEST_RETRY_S if claim.guest else settings.slot_lease_s / 2
        if not claim.guest:
            self._runs.setdefault((pool, holder), (claim.box, time.monotonic()))
            if len(self._runs) > 65_536:  # runs whose end was never told (a killed run): the oldest go
                for old in list(self._runs)[:1024]:
                    del self._runs[old]
        # The copy kept for the thread's next requests: the takeover is this request's news alone.
        self._held[(pool, holder)] = (
            dataclasses.replace(claim, took_from=None),
            time.monotonic() + fresh_for,
        )
        if len(self._held) > 65_536:  # forget the oldest entries of a long-lived process
            for old in list(self._held)[:1024]:
                del self._held[old]
        return claim

    def home_wait_s(self, boxes: tuple[str, ...]) -> float:
        """How long a returning thread waits for a slot on its home box before it moves (several boxes).

        ``slot_home_wait_s``, or longer while runs hold their slots longer: a slot at
        home frees within about one run, and a move costs the thread's whole prompt
        prefilled again on the other box, which on a loaded box takes longer than
        the wait. At most ``request_timeout``; ``slot_home_wait_s`` 0 never waits.
        """
        settings = self.slots.settings
        if settings.slot_home_wait_s <= 0:
            return 0.0
        run_s = max((self._run_s.get(box, 0.0) for box in boxes), default=0.0)
        return min(max(settings.slot_home_wait_s, run_s), float(settings.request_timeout))

    async def place(self, link: Provider, thread_id: str, *, reflection: bool = False) -> Placement:
        """The thread's leased slot (or its box's reflection slot), straight to its box."""
        if link.leg != "local":
            return NOWHERE
        slots = await self.slots.pool(link)
        if slots is None:  # not llama-server (or not reachable now): no slot to name
            return Placement(headers=self.slots.headers(link, thread_id))
        pool, boxes = self._pool(link)
        holder = routing_key(thread_id)
        before = self._held.get((pool, holder))
        try:
            if self._unnamed:
                raise SharedStateUnavailable(
                    "requests this process sent on no slot while the shared state was down are still running"
                )
            home = before[0].box if before is not None else None
            if home is None and len(boxes) < len(self.boxes):  # a box is down: was it this thread's?
                home = await self.table.box_of(pool, holder)
            if reflection:
                claim = SlotClaim(await self._box_of(pool, boxes, holder), slots.reflection_slot)
            else:
                claim = await self._claim(link, pool, boxes, holder, slots)
        except SharedStateUnavailable as error:
            logger.debug("a local request names no slot: %s", error)  # the outage itself is logged once
            box = before[0].box if before is not None and before[0].box in boxes else spread(holder, boxes)
            return await self._placement(link, thread_id, box, None, {"lease": f"unplaced: {error}"})
        await self._warm(link, pool, claim.box, slots)
        notes = PlacementRecord(lease="shared") if self.shared_locks is not None else PlacementRecord()
        if len(self.boxes) > 1 or self.shared_locks is not None:
            notes["box"] = claim.box
        if home is not None and home != claim.box and home not in boxes:
            notes["moved_from"] = home  # its box stopped answering: one cold prefill here
        if claim.took_from is not None:
            notes["took_idle_slot"] = True
        if claim.guest:
            notes["guest"] = True  # on a slot another thread holds, inside the slot's turn like any request
        return await self._placement(link, thread_id, claim.box, claim.slot, notes)

    async def _box_of(self, pool: str, boxes: tuple[str, ...], holder: str) -> str:
        """The box of ``holder``'s conversation (its memory jobs go there), else the first box."""
        known = self._held.get((pool, holder))
        if known is not None and known[0].box in boxes:
            return known[0].box
        if len(boxes) > 1:  # one box needs no look-up: every lease of the pool is on it
            found = await self.table.box_of(pool, holder)
            if found in boxes:
                return found
        return boxes[0]

    async def _placement(
        self, link: Provider, thread_id: str, box: str, slot: int | None, notes: PlacementRecord
    ) -> Placement:
        model = await self.box_model(box) if self.box_model is not None and len(self.boxes) > 1 else None
        turn: Turn = self._unnamed_turn if slot is None else self._turn
        if slot is not None:
            self._named.add((box, slot))  # it will hold a prompt: no warm-up for it
        return Placement(
            slot=slot,
            headers=self.slots.headers(link, thread_id),
            box=box,
            notes=notes,
            model=model,
            turn=turn,
        )

    # -- turns ------------------------------------------------------------------------------

    def _wait_s(self) -> float:
        """How long a request waits for its slot's turn: what the request before it may take, and settle."""
        return float(self.slots.settings.request_timeout) + SETTLE_S

    async def _take(self, box: str, slot: int, wait_s: float) -> GiveBack:
        """Take the turn of ``box``'s ``slot`` (the deployment's when shared, else this process's).

        Returns how to give it back, from any event loop.

        Raises:
            SlotBusy: The slot stayed busy with another request for ``wait_s``.
            SharedStateUnavailable: The deployment's database cannot give the turn.
        """
        locks = self.shared_locks
        if locks is not None:
            held = await locks.take_slot_turn(box, slot, wait_s=wait_s)
            return functools.partial(locks.give_back_slot_turn, held)
        key = (box, slot)
        await self.turns.take(key, wait_s=wait_s)

        async def give_back() -> None:
            self.turns.give_back(key)

        return give_back

    @contextlib.asynccontextmanager
    async def _turn(self, placement: Placement) -> AsyncIterator[Placement]:
        """The placement's slot turn; no slot at all when the turn cannot be had across processes.

        After a failed request (a client-side timeout, a dropped connection, a
        cancelled run) the turn is given back only once llama-server shows the
        slot idle, from the background (``settle``): the server may still be
        generating there, and the caller falls over at once.

        Raises:
            SlotBusy: The slot stayed busy with another request for ``request_timeout`` + ``SETTLE_S``.
        """
        box, slot = placement.box, placement.slot
        assert box is not None and slot is not None
        try:
            give_back: GiveBack | None = await self._take(box, slot, self._wait_s())
        except SharedStateUnavailable as error:  # no turn across processes: name no slot
            give_back = None
            notes: PlacementRecord = {**placement.notes, "lease": f"unplaced: {error}"}
            unplaced = dataclasses.replace(placement, slot=None, turn=None, notes=notes)
        if give_back is None:
            async with self._unnamed_turn(unplaced) as sent:
                yield sent
            return
        try:
            yield placement
        except BaseException as error:
            if not refused(error):  # something reached the server: it may still run there
                SETTLING.submit(settle(box, slot), give_back)
                give_back = None
            raise
        finally:
            if give_back is not None:
                await give_back()

    async def _warm_one(self, box: str, slot: int) -> None:
        """A warm-up request on ``box``'s ``slot``, in its turn, if it still holds no prompt."""
        give_back = await self._take(box, slot, WARM_WAIT_S)
        try:
            # Looked at again inside the turn: another process's request may have filled it since.
            states = await slot_states(box)
            state = states.get(slot) if states is not None else None
            if (box, slot) not in self._named and (state is None or state[1] == 0):
                await warm_slot(box, slot)
        finally:
            await give_back()

    @contextlib.asynccontextmanager
    async def _unnamed_turn(self, placement: Placement) -> AsyncIterator[Placement]:
        """A request on no named slot: counted, so this process names none while one runs."""
        with self._lock:
            self._unnamed += 1
        try:
            yield placement
        finally:
            with self._lock:
                self._unnamed -= 1

    def _mark_down(self, box: str) -> None:
        if len(self.boxes) > 1:
            self._down[box] = time.monotonic() + BOX_DOWN_S

    def unreachable(self, placement: Placement, error: BaseException) -> bool:
        """Whether ``placement``'s box refused the connection and another box may take the request now."""
        if placement.box is None or len(self.boxes) < 2 or not refused(error):
            return False
        self._mark_down(placement.box)
        return any(self._down.get(box, 0.0) <= time.monotonic() for box in self.boxes)

    # -- warm-up ----------------------------------------------------------------------------

    async def _warm(self, link: Provider, pool: str, box: str, slots: SlotPool) -> None:
        """On first contact with a box, one short request on each of its slots that holds no prompt.

        llama-server restores a returning thread's prefix from its host cache only
        into a slot that holds a prompt (``warm_slot``); otherwise an operator
        would have to send a request to every slot after each start.
        """
        with self._lock:
            if box in self._warmed:
                return
            self._warmed.add(box)
        states = await slot_states(box)
        for slot in range(slots.total_slots):
            state = states.get(slot) if states is not None else None
            if (state is not None and state[1] > 0) or (box, slot) in self._named:
                continue  # it holds a prompt already
            try:
                await self._warm_one(box, slot)
            except Exception as error:  # noqa: BLE001 - a warm-up only saves a prefill; it never fails a step
                logger.debug("warming slot %s of %s: %s", slot, box, error)

    async def release(self, thread_id: str) -> None:
        """Mark the thread's leases idle, so a thread that needs a slot now may take one over.

        This process's copy of the claim is dropped too: the thread's next run
        asks the table again, as another thread may hold the slot by then.
        """
        holder = routing_key(thread_id)
        for key in [key for key in self._runs if key[1] == holder]:
            box, began = self._runs.pop(key)
            took = time.monotonic() - began
            last = self._run_s.get(box)
            self._run_s[box] = took if last is None else last + RUN_AVERAGE * (took - last)
        for key in [key for key in self._held if key[1] == holder]:
            claim, _ = self._held.pop(key)
            if claim.guest:
                continue
            try:
                await self.table.release_slot(key[0], holder)
            except SharedStateUnavailable as error:
                logger.debug("releasing a slot in the shared state failed: %s", error)


def spread(holder: str, boxes: tuple[str, ...]) -> str:
    """A box for ``holder`` by its hash: threads placed without a table still spread over the boxes."""
    return boxes[int(holder[1:9], 16) % len(boxes)]


class Settling:
    """Settles failed requests' slots on an event loop thread of its own, then gives their turns back.

    Not on the run's loop: a server may stop that loop with the run (``BG_JOB_ISOLATED_LOOPS``),
    and a turn left held would keep its slot from every later request of the process.
    """

    def __init__(self) -> None:
        """No thread until the first failed request."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def submit(self, settling: Coroutine[Any, Any, None], give_back: GiveBack) -> None:
        """Run ``settling``, then ``give_back``, in the background."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(
                    target=self._loop.run_forever, name="fusion-slot-settle", daemon=True
                ).start()
            loop = self._loop

        async def then() -> None:
            try:
                await settling
            finally:
                await give_back()

        asyncio.run_coroutine_threadsafe(then(), loop)


#: The process's one settling thread.
SETTLING = Settling()


async def settle(box: str, slot: int) -> None:
    """Wait up to ``SETTLE_S`` until llama-server at ``box`` shows ``slot`` not processing."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        states = await slot_states(box)
        if states is None:  # the server does not show its slots (or is gone): a short grace instead
            await asyncio.sleep(SETTLE_BLIND_S)
            return
        if not states.get(slot, (False, 0))[0]:
            return
        if time.monotonic() >= deadline:
            logger.warning(
                "slot %s of %s is still processing %g s after its request failed", slot, box, SETTLE_S
            )
            return
        await asyncio.sleep(SETTLE_POLL_S)
