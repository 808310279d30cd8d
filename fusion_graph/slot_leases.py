"""Which (box, slot) a thread gets from a pool's leases: the pure rule ``SharedState.claim_slot`` runs.

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
    """

    box: str
    slot: int
    guest: bool = False
    expires_in_s: float = 0.0
    took_from: str | None = None


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
    rows: Sequence[LeaseRow], boxes: Sequence[str], slots: int, holder: str, preferred: int
) -> SlotClaim:
    """Pure: the (box, slot) a thread gets, given the pool's rows (``claim_slot`` runs it under a lock).

    The thread's own live lease first; else its own lapsed one if nobody took
    the slot since (its cache may still be there); else a free slot on the
    box with the fewest live threads, probing from ``preferred``; else the
    least recently used idle lease (``took_from`` names its thread); else it
    is a guest on the least recently used slot of the least loaded box.
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
    for box in sorted(boxes, key=lambda b: (load[b], boxes.index(b))):
        for offset in range(slots):
            slot = (preferred + offset) % slots
            if (box, slot) not in taken:
                return SlotClaim(box, slot)
    idle = [row for row in taken.values() if row.idle and row.holder != holder]
    if idle:
        oldest_idle = min(idle, key=lambda r: (r.used_at, r.box, r.slot))
        return SlotClaim(oldest_idle.box, oldest_idle.slot, took_from=oldest_idle.holder)
    fewest = min(boxes, key=lambda b: (load[b], boxes.index(b)))
    oldest = min((row for row in taken.values() if row.box == fewest), key=lambda r: r.used_at)
    return SlotClaim(oldest.box, oldest.slot, guest=True)
