"""Placement: which llama-server slot (and which box) a thread's local request goes to.

Every local request (a step, a repair, a memory job, an MCP sample) asks the
graph's one ``Placer`` for a ``Placement`` and sends it as is: the slot as
``id_slot`` + ``cache_prompt``, the headers (the thread's routing key, and a
box pin where the placer chose the box) with the request. After the answer,
``served`` tells the placer which box a gateway answered from.

``LeasedPlacement`` places by leases, one rule (``coordination.slot_leases.choose_slot``)
on one of two tables: this process's own (``LocalLeases``: an embedded graph,
one server process) or the deployment's Postgres (``SharedState``: several
worker processes). A new thread takes a free slot on the box with the fewest
threads and its requests go straight to that box; a run's end marks its lease
idle for a thread that needs one; a running thread's slot is never given away.
``InProcessPlacement`` says how many slots a server has and which headers a
request carries; it also places by itself (``SlotPool``/``BoxSlots``) behind
a gateway without shared state, learning each thread's box from the answers
(``served``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from langchain_core.language_models import BaseChatModel

from fusion_graph.coordination.shared_state import SharedState, SharedStateUnavailable
from fusion_graph.coordination.slot_leases import LeaseAsk, LocalLeases, SlotClaim
from fusion_graph.providers.links import ChainLink
from fusion_graph.providers.llama_server import ServerProps
from fusion_graph.providers.slots import BoxSlots, SlotPool, box_name, routing_key
from fusion_graph.routing.score import Leg
from fusion_graph.settings import FusionSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where one local request goes.

    Attributes:
        slot: The llama-server slot (``id_slot``); ``None``: not a llama-server, or none known.
        headers: Headers the request carries (the routing key; a box pin), ``None``: none.
        box: The box the placer chose (``None``: the gateway places it).
        notes: What the record keeps about the placement (``extra``), e.g. a fallback's reason.
        model: The model that reaches ``box`` directly (``None``: the link's own model).
        turn: Held around the request when other processes send to the same slot: their
            requests on it take turns (``None``: nobody else sends to it).
    """

    slot: int | None = None
    headers: Mapping[str, str] | None = None
    box: str | None = None
    notes: Mapping[str, Any] = field(default_factory=dict)
    model: BaseChatModel | None = None
    """The model that reaches ``box`` directly (``None``: the link's own model)."""
    turn: Callable[[], AbstractAsyncContextManager[None]] | None = None
    """Held around the request when other processes send to the same slot (the reflection slot)."""

    def body(self, leg: Leg) -> dict[str, Any] | None:
        """The request-body fields of the placement (``slot_body``); ``None`` off a local slot."""
        return slot_body(leg, self.slot)


#: A request with nowhere in particular to go (a cloud link, a server with no slots).
NOWHERE = Placement()


class Placer(Protocol):
    """Decides where a thread's local requests go; learns where a gateway served them."""

    async def place(self, link: ChainLink, thread_id: str, *, reflection: bool = False) -> Placement:
        """The placement of the next request of ``thread_id`` on ``link``.

        ``reflection``: the reserved reflection slot (memory jobs, MCP samples),
        which never holds a conversation.
        """
        ...

    async def served(self, link: ChainLink, thread_id: str, box: str) -> str | None:
        """Learn that ``box`` answered ``thread_id``; returns the box it moved from (``None``: no move)."""
        ...

    async def release(self, thread_id: str) -> None:
        """``thread_id``'s run ended: its slot may go to a thread that needs one now (never raises)."""
        ...


class FixedPlacement:
    """Every local request at one placement: for callers that pin a slot themselves (benchmarks)."""

    def __init__(self, placement: Placement = NOWHERE) -> None:
        """Place every local request at ``placement``."""
        self.placement = placement

    async def place(self, link: ChainLink, thread_id: str, *, reflection: bool = False) -> Placement:
        """``placement`` on a local link, nowhere in particular on a cloud one."""
        return self.placement if link.leg == "local" else NOWHERE

    async def served(self, link: ChainLink, thread_id: str, box: str) -> str | None:
        """Nothing to learn: the placement is fixed."""
        return None

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
PropsOf = Callable[[ChainLink], Awaitable[ServerProps | None]]


class InProcessPlacement:
    """The slot table of this process: one ``SlotPool`` per llama-server, ``BoxSlots`` behind a gateway.

    The slot count is ``local_slots`` when set, else the server's own
    ``total_slots`` (``/props``, asked through ``props_of``); behind a gateway
    (``local_workers``) it is per box. Pools outlive single runs, so live
    threads keep their slots.
    """

    def __init__(self, settings: FusionSettings, props_of: PropsOf, *, gateway: bool) -> None:
        """Place by ``settings`` (slots, gateway, routing header), reading servers through ``props_of``.

        ``gateway``: the local endpoint is a gateway over ``local_workers`` (per-box slots).
        """
        self.settings, self.props_of, self.gateway = settings, props_of, gateway
        self._pools: dict[tuple[str, int, bool], SlotPool | BoxSlots] = {}

    async def pool(self, link: ChainLink) -> SlotPool | BoxSlots | None:
        """The slot pool of a local llama-server link, or ``None`` for anything else.

        Without ``local_slots``, a local server that is not llama-server (no
        ``/props``) runs without slot affinity and one that cannot be reached
        gets no slot for this call.
        """
        url = link.as_provider().base_url
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
            if self.gateway:
                pool = BoxSlots(total, boxes=self.settings.local_workers, reserve_reflection=reserve)
            else:
                pool = SlotPool(total, reserve_reflection=reserve)
            self._pools[key] = pool
        return pool

    def headers(self, link: ChainLink, thread_id: str) -> dict[str, str] | None:
        """Headers of a local request of ``thread_id``: its routing key (``local_routing_header``)."""
        header = self.settings.local_routing_header
        if link.leg != "local" or not header:
            return None
        return {header: routing_key(thread_id)}

    async def place(self, link: ChainLink, thread_id: str, *, reflection: bool = False) -> Placement:
        """The thread's slot (or the reflection slot) on ``link``, with its routing key."""
        if link.leg != "local":
            return NOWHERE
        pool = await self.pool(link)
        slot = None
        if pool is not None:
            slot = pool.reflection_slot if reflection else pool.slot_for(thread_id)
        return Placement(slot=slot, headers=self.headers(link, thread_id))

    async def served(self, link: ChainLink, thread_id: str, box: str) -> str | None:
        """Learn a gateway's box for the thread (per-box slots); returns the box it moved from."""
        pool = await self.pool(link)
        return pool.served(thread_id, box) if isinstance(pool, BoxSlots) else None

    async def release(self, thread_id: str) -> None:
        """Nothing to do: a full pool already gives the least recently used thread's slot to a newcomer."""


#: Builds (once per box) the model that reaches a box directly, from its base URL without ``/v1``.
BoxModel = Callable[[str], Awaitable[BaseChatModel]]
#: Seconds a guest (every slot was held) waits before it asks for a slot of its own again.
GUEST_RETRY_S = 5.0
#: Seconds between two asks while a returning thread waits for a slot on its home box.
HOME_POLL_S = 0.05


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
    """Slot leases, one rule for every table: this process's (``LocalLeases``) or the deployment's.

    A thread's lease is claimed once and then used from this process's copy until
    half of it has run; the next use renews it (a lease is renewed by use, not by
    a round trip on every step). Its run's end marks it idle (``release``), so a
    thread that needs a slot now may take it over. When several boxes serve the
    local leg (``local_workers``), the placement names the box and the request
    goes to it directly (``box_model``): a gateway cannot be told which box to
    use. With the deployment's table (``SharedState``), a database that cannot
    be reached places the request by the same rule on this process's own table
    and the record says so (``extra.placement``); a turn never fails over it.
    """

    def __init__(
        self,
        table: LeaseTable,
        slots: InProcessPlacement,
        *,
        boxes: tuple[str, ...],
        box_model: BoxModel | None,
    ) -> None:
        """Lease slots in ``table`` over ``boxes`` (base URLs); ``box_model`` reaches one directly.

        ``slots`` says how many slots a local server has (``local_slots`` or its
        ``/props``) and which headers a request carries.
        """
        self.table, self.slots = table, slots
        self.local = table if isinstance(table, LocalLeases) else LocalLeases()
        self.shared = table if isinstance(table, SharedState) else None
        self.boxes = tuple(box_name(box) for box in boxes)
        self.box_model = box_model
        self._held: dict[tuple[int, str, str], tuple[SlotClaim, float]] = {}

    def _pool(self, link: ChainLink) -> tuple[str, tuple[str, ...]]:
        """The pool's name (the local endpoint) and its boxes."""
        url = link.as_provider().base_url or link.id
        boxes = self.boxes or (box_name(url),)
        return url, boxes

    async def _claim(
        self, table: LeaseTable, link: ChainLink, pool: str, boxes: tuple[str, ...], holder: str
    ) -> SlotClaim | None:
        """The thread's claim: from this process's copy while it is fresh, else from ``table``."""
        key = (id(table), pool, holder)
        known = self._held.get(key)
        if known is not None and time.monotonic() < known[1]:
            return known[0]
        slots = await self.slots.pool(link)  # the slot count: local_slots, or the box's /props
        if slots is None:
            return None
        settings = self.slots.settings
        preferred = SlotPool(slots.total_slots).preferred_slot(holder) if slots.total_slots > 1 else 0
        # Over several boxes, a returning thread waits a moment for a slot on the box that caches its
        # prefix (slot_home_wait_s) before it moves to another box and prefills there once.
        deadline = time.monotonic() + settings.slot_home_wait_s
        while True:
            stay = len(boxes) > 1 and time.monotonic() < deadline
            ask = LeaseAsk(
                pool, tuple(boxes), slots.conversation_slots, holder, settings.slot_lease_s, preferred, stay
            )
            claim = await table.claim_slot(ask)
            if not claim.home_full:
                break
            await asyncio.sleep(HOME_POLL_S)
        fresh_for = GUEST_RETRY_S if claim.guest else settings.slot_lease_s / 2
        # The copy kept for the thread's next requests: the takeover is this request's news alone.
        self._held[key] = (dataclasses.replace(claim, took_from=None), time.monotonic() + fresh_for)
        if len(self._held) > 65_536:  # forget the oldest entries of a long-lived process
            for old in list(self._held)[:1024]:
                del self._held[old]
        return claim

    async def place(self, link: ChainLink, thread_id: str, *, reflection: bool = False) -> Placement:
        """The thread's leased slot (or its box's reflection slot), straight to its box."""
        if link.leg != "local":
            return NOWHERE
        try:
            return await self._place(self.table, link, thread_id, reflection)
        except SharedStateUnavailable as error:
            placed = await self._place(self.local, link, thread_id, reflection)
            logger.debug("placing a local request in this process only: %s", error)  # logged once per outage
            return dataclasses.replace(placed, notes={**placed.notes, "placement": f"in-process: {error}"})

    async def _place(self, table: LeaseTable, link: ChainLink, thread_id: str, reflection: bool) -> Placement:
        pool, boxes = self._pool(link)
        holder = routing_key(thread_id)
        turn: Callable[[], AbstractAsyncContextManager[None]] | None = None
        if reflection:
            slots = await self.slots.pool(link)
            if slots is None:
                return await self.slots.place(link, thread_id, reflection=True)
            known = self._held.get((id(table), pool, holder))
            if known is not None:
                box: str | None = known[0].box
            else:  # one box needs no look-up: every lease of the pool is on it
                box = await table.box_of(pool, holder) if len(boxes) > 1 else None
            claim = SlotClaim(box or boxes[0], slots.reflection_slot)
            if table is self.shared:  # several processes send to it: their requests take turns
                turn = functools.partial(self.shared.slot_turn, pool, claim.box, claim.slot)
        else:
            found = await self._claim(table, link, pool, boxes, holder)
            if found is None:
                return await self.slots.place(link, thread_id)
            claim = found
        model = await self.box_model(claim.box) if self.box_model is not None and len(boxes) > 1 else None
        notes: dict[str, Any] = {"placement": "shared", "box": claim.box} if table is self.shared else {}
        if len(boxes) > 1:
            notes["box"] = claim.box
        if claim.took_from is not None:
            notes["took_idle_slot"] = True
        slot: int | None = claim.slot
        if claim.guest:
            # Every slot's thread is running: no slot is named (llama-server takes an idle one, or
            # queues the request), since a request naming a busy slot can hang it or corrupt the
            # generation running there when its prompt cache is on.
            notes["guest"], slot = True, None
        return Placement(
            slot=slot,
            headers=self.slots.headers(link, thread_id),
            box=claim.box,
            notes=notes,
            model=model,
            turn=turn,
        )

    async def served(self, link: ChainLink, thread_id: str, box: str) -> str | None:
        """Nothing to learn: the placement chose the box itself."""
        return None

    async def release(self, thread_id: str) -> None:
        """Mark the thread's leases idle, so a thread that needs a slot now may take one over.

        This process's copy of the claim is dropped too: the thread's next run
        asks the table again, as another thread may hold the slot by then.
        """
        holder = routing_key(thread_id)
        for key in [key for key in self._held if key[2] == holder]:
            claim, _ = self._held.pop(key)
            if claim.guest:
                continue
            table = self.local if key[0] == id(self.local) else self.table
            try:
                await table.release_slot(key[1], holder)
            except SharedStateUnavailable as error:
                logger.debug("releasing a slot in the shared state failed: %s", error)
