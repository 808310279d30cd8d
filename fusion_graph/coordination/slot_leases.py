"""Which (box, slot) a thread gets from a pool's leases: the pure rule, and this process's own table.

``choose_slot`` is the rule; ``SharedState.leases.claim_slot`` runs it on the
deployment's Postgres, ``LocalLeases`` on a table in this process.

Kept apart from the database code so the rule is tested, and read, on its own:
a thread keeps its live lease; takes back its lapsed one when nobody took the
slot since (its cache may still be there); else a free slot on the box with the
fewest live threads; when every slot is held, the least recently used lease of
a thread whose run has ended (an *idle* lease) is taken over, so a service with
many more threads than slots gives a slot to the thread that needs it now; only
when every slot's thread is running is it a guest on the least recently used
slot of the least loaded box, holding nothing.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotClaim:
    """Where a thread's local requests go.

    Attributes:
        box: The box (a llama-server base URL without ``/v1``).
        slot: The slot on it.
        guest: Every slot is held by a live thread: the request runs on the least
            recently used one without holding it (its holder keeps it).
        expires_in_s: Seconds the lease has left (0 for a guest).
        took_from: The idle thread whose lease this claim took over (``None``: none).
        home_full: Nothing was claimed: the thread's home box has no free or idle slot
            now, and the caller asked to wait for one there (``stay_home``).
    """

    box: str
    slot: int
    guest: bool = False
    expires_in_s: float = 0.0
    took_from: str | None = None
    home_full: bool = False


@dataclass(frozen=True)
class LeaseAsk:
    """What a thread asks a pool's lease table for, whichever table answers (Postgres, this process).

    Attributes:
        pool: The pool (a llama-server, or a gateway's boxes) the slots are in.
        boxes: The boxes of the pool (base URLs without ``/v1``); one unless behind a gateway.
        slots: Conversation slots per box.
        holder: The thread (its routing key).
        lease_s: Seconds the lease lasts without a request.
        preferred: The slot a free-slot search starts from (the thread's hashed slot).
        stay_home: Wait for the thread's home box rather than move (``SlotClaim.home_full``).
    """

    pool: str
    boxes: tuple[str, ...]
    slots: int
    holder: str
    lease_s: float
    preferred: int = 0
    stay_home: bool = False


@dataclass(frozen=True)
class LeaseRow:
    """One row of the slot table as the claim sees it."""

    box: str
    slot: int
    holder: str
    live: bool
    used_at: float
    idle: bool = False
    """Its thread's run has ended: another thread that needs a slot may take it over."""


def choose_slot(
    rows: Sequence[LeaseRow],
    boxes: Sequence[str],
    slots: int,
    holder: str,
    preferred: int,
    *,
    home: str | None = None,
    stay_home: bool = False,
) -> SlotClaim:
    """Pure: the (box, slot) a thread gets, given the pool's rows (``claim_slot`` runs it under a lock).

    The thread's own live lease first; else its own lapsed one if nobody took
    the slot since (its cache may still be there). A thread with a ``home`` box
    (where it ran last: its prefix is in that box's host prompt cache) stays
    there while it can: a free slot, else the least recently used idle lease
    there (``took_from`` names its thread); with ``stay_home``, nothing else
    (``home_full``: the caller waits a moment and asks again). Otherwise a free slot on the box
    with the fewest live threads, probing from ``preferred``; else the least
    recently used idle lease anywhere; else (every slot's thread is running) it
    is a guest on the least recently used slot of the least loaded box. A move
    costs one cold prefill; a guest shares slots whose threads are running,
    and a request naming a busy slot can corrupt llama-server's running
    generation when its prompt cache is on, so a move comes first.
    """
    taken = {(row.box, row.slot): row for row in rows if row.live}
    for row in rows:
        if row.holder == holder and row.live:
            return SlotClaim(row.box, row.slot)
    for row in sorted(rows, key=lambda r: -r.used_at):
        if row.holder == holder and (row.box, row.slot) not in taken:
            return SlotClaim(row.box, row.slot)
    load = {box: 0 for box in boxes}
    for box, _ in taken:
        if box in load:
            load[box] += 1

    def free_on(box: str) -> SlotClaim | None:
        for offset in range(slots):
            slot = (preferred + offset) % slots
            if (box, slot) not in taken:
                return SlotClaim(box, slot)
        return None

    def oldest_idle(box: str | None) -> SlotClaim | None:
        idle = [r for r in taken.values() if r.idle and r.holder != holder and box in (None, r.box)]
        if not idle:
            return None
        row = min(idle, key=lambda r: (r.used_at, r.box, r.slot))
        return SlotClaim(row.box, row.slot, took_from=row.holder)

    def guest_on(box: str) -> SlotClaim:
        oldest = min((row for row in taken.values() if row.box == box), key=lambda r: r.used_at)
        return SlotClaim(oldest.box, oldest.slot, guest=True)

    if home is not None and home in boxes:  # it stays where its prefix is cached, while it can
        found = free_on(home) or oldest_idle(home)
        if found is not None:
            return found
        if stay_home:
            return SlotClaim(home, -1, guest=True, home_full=True)
    for box in sorted(boxes, key=lambda b: (load[b], boxes.index(b))):
        found = free_on(box)
        if found is not None:
            return found
    return oldest_idle(None) or guest_on(min(boxes, key=lambda b: (load[b], boxes.index(b))))


@dataclass
class _Lease:
    holder: str
    expires: float
    used: float
    idle: bool = False


#: Threads whose home box this process remembers, at most (the least recently placed are forgotten).
MAX_HOMES = 65_536


class LocalLeases:
    """This process's own lease table, run by the same rule (``choose_slot``) as the shared one.

    The placement of an embedded graph or a single server process, and of a
    deployment's worker while its shared state cannot be reached: the same
    three calls as ``SharedState.leases`` (``claim_slot``, ``release_slot``,
    ``box_of``), so one rule decides every placement. Thread-safe (the sync
    entry points run on a loop thread of their own).
    """

    def __init__(self) -> None:
        """An empty table."""
        self._pools: dict[str, dict[tuple[str, int], _Lease]] = {}
        self._homes: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()

    async def claim_slot(self, ask: LeaseAsk) -> SlotClaim:
        """Claim (or renew) the asking thread's slot in its pool; see ``choose_slot``."""
        pool, wanted, slots, holder, lease_s = ask.pool, ask.boxes, ask.slots, ask.holder, ask.lease_s
        with self._lock:
            now = time.monotonic()
            table = self._pools.setdefault(pool, {})
            rows = [
                LeaseRow(box, slot, lease.holder, lease.expires > now, lease.used, lease.idle)
                for (box, slot), lease in table.items()
                if box in wanted and slot < slots
            ]
            home = self._homes.get((pool, holder)) if len(wanted) > 1 else None
            claim = choose_slot(
                rows, wanted, slots, holder, ask.preferred % slots, home=home, stay_home=ask.stay_home
            )
            if claim.guest:
                return claim
            for key in [
                k for k, lease in table.items() if lease.holder == holder and k != (claim.box, claim.slot)
            ]:
                del table[key]
            table[(claim.box, claim.slot)] = _Lease(holder, now + lease_s, now)
            if len(wanted) > 1:
                self._homes[(pool, holder)] = claim.box
                self._homes.move_to_end((pool, holder))
                if len(self._homes) > MAX_HOMES:
                    self._homes.popitem(last=False)
        return SlotClaim(claim.box, claim.slot, expires_in_s=lease_s, took_from=claim.took_from)

    async def release_slot(self, pool: str, holder: str) -> None:
        """Mark ``holder``'s lease idle (its run ended): a thread that needs a slot now may take it."""
        with self._lock:
            for lease in self._pools.get(pool, {}).values():
                if lease.holder == holder:
                    lease.idle = True

    async def box_of(self, pool: str, holder: str) -> str | None:
        """The box ``holder`` holds a live slot on (``None``: none)."""
        now = time.monotonic()
        with self._lock:
            for (box, _), lease in self._pools.get(pool, {}).items():
                if lease.holder == holder and lease.expires > now:
                    return box
        return None


#: This process's lease table, shared by every graph built in it (pools are keyed by the local
#: endpoint, so two graphs over one llama-server keep their threads on distinct slots).
LOCAL_LEASES = LocalLeases()
