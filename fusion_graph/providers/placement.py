"""Placement: which llama-server slot (and which box) a thread's local request goes to.

Every local request (a step, a repair, a memory job, an MCP sample) asks the
graph's one ``Placer`` for a ``Placement`` and sends it as is: the slot as
``id_slot`` + ``cache_prompt``, the headers (the thread's routing key, and a
box pin where the placer chose the box) with the request. After the answer,
``served`` tells the placer which box a gateway answered from.

``InProcessPlacement`` keeps the slot table in this process (``SlotPool``, or
``BoxSlots`` behind a gateway): right for an embedded graph and one server
process. A deployment of several worker processes shares its placement
through the deployment's own store instead (``fusion_graph.providers.leases``),
behind the same two methods.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from fusion_graph.providers.chain import ChainLink
from fusion_graph.providers.llama_server import ServerProps
from fusion_graph.providers.slots import BoxSlots, SlotPool, routing_key
from fusion_graph.routing import Leg
from fusion_graph.settings import FusionSettings


@dataclass(frozen=True)
class Placement:
    """Where one local request goes.

    Attributes:
        slot: The llama-server slot (``id_slot``); ``None``: not a llama-server, or none known.
        headers: Headers the request carries (the routing key; a box pin), ``None``: none.
        box: The box the placer chose (``None``: the gateway places it).
        notes: What the record keeps about the placement (``extra``), e.g. a fallback's reason.
    """

    slot: int | None = None
    headers: Mapping[str, str] | None = None
    box: str | None = None
    notes: Mapping[str, Any] = field(default_factory=dict)

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
