"""llama-server slot affinity: each conversation keeps its own slot, and so its KV cache.

llama-server reuses a slot's cache by longest common prefix. Pinning a thread
to one slot (``id_slot``) means each local step only processes what is new since
that thread's previous local step. The slot is derived from the thread id with a
stable hash, so it survives process restarts. The last slot is reserved for
memory sub-runners so their jobs never evict a conversation's cache.

Behind a gateway over several boxes, every local request also carries the
thread's routing key (``routing_key``) so the gateway keeps the thread on one
box, and ``BoxSlots`` keeps one pool per box, learning each thread's box from
the gateway's answer.

Start llama-server with an explicit ``-np N``: without it, recent versions
share one *unified* KV cache across slots and a pinned slot loses its cache
whenever other requests run in between.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence

from fusion_graph.errors import UsageError


class SlotPool:
    """Maps conversations to llama-server slots.

    Each thread prefers the slot its id hashes to, so the mapping is the same
    across steps, runs and process restarts. When two live threads prefer the
    same slot, the newcomer probes to the next slot not held by a live thread
    (open addressing), so threads do not evict each other while there are
    enough slots; past that, the least recently used thread gives up its slot.
    """

    def __init__(self, total_slots: int, *, reserve_reflection: bool = True) -> None:
        """Create a pool over ``total_slots`` (``-np``), optionally reserving the last one.

        Args:
            total_slots: Slots the server runs (``GET /props`` -> ``total_slots``).
            reserve_reflection: Keep the last slot for memory sub-runners.
        """
        if total_slots < 1:
            raise UsageError(f"total_slots must be >= 1, got {total_slots}")
        self.total_slots = total_slots
        self.reserve_reflection = reserve_reflection
        self._held: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def conversation_slots(self) -> int:
        """How many slots conversations share (all but the reserved one, when there are 2+)."""
        if self.reserve_reflection and self.total_slots > 1:
            return self.total_slots - 1
        return self.total_slots

    @property
    def reflection_slot(self) -> int:
        """The slot memory sub-runners use (shared with conversations on a 1-slot server)."""
        return self.total_slots - 1

    def preferred_slot(self, thread_id: str) -> int:
        """The slot a thread's id hashes to (stable across processes)."""
        digest = hashlib.sha256(thread_id.encode("utf-8")).digest()
        return int.from_bytes(digest[:8], "big") % self.conversation_slots

    def held(self) -> set[int]:
        """The slots live threads hold."""
        with self._lock:
            return set(self._held.values())

    def slot_for(self, thread_id: str, *, prefer: int | None = None) -> int:
        """The slot of a conversation: kept while it is live, preferred slot first.

        ``prefer``: a slot to take instead of the hash-preferred one (where the thread already is).
        """
        with self._lock:
            if thread_id in self._held:
                self._held.move_to_end(thread_id)
                return self._held[thread_id]
            taken = set(self._held.values())
            preferred = self.preferred_slot(thread_id) if prefer is None else prefer
            n = self.conversation_slots
            for offset in range(n):
                candidate = (preferred + offset) % n
                if candidate not in taken:
                    break
            else:
                _, candidate = self._held.popitem(last=False)
            self._held[thread_id] = candidate
            return candidate

    def release(self, thread_id: str) -> None:
        """Forget a thread (its slot becomes free for others)."""
        with self._lock:
            self._held.pop(thread_id, None)


@functools.lru_cache(maxsize=4096)  # asked on every local request of a thread
def routing_key(thread_id: str) -> str:
    """The key a gateway routes a thread's local requests by: a stable hash of its id.

    Stable across processes and replicas (like the preferred slot), and it does
    not reveal the thread id to the gateway or its logs.
    """
    return "t" + hashlib.sha256(b"fusion-thread\0" + thread_id.encode("utf-8")).hexdigest()[:24]


def box_name(url: str) -> str:
    """A box's URL as a gateway names it: no trailing ``/`` or ``/v1``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class BoxSlots:
    """Slots of a local endpoint that is a gateway over several llama-server boxes of ``-np`` slots each.

    The gateway, not the graph, places a thread on a box (by its routing key);
    it names the box in its answer, and ``served`` learns it. A thread whose box
    is known gets a slot of that box's own ``SlotPool`` (so threads on one box
    never share a slot while the box has enough). A thread's first request takes
    a slot no live thread holds on any box (``_first_slot``): a held slot would be
    overwritten, and llama-server does not restore a prompt that shares a long
    system prefix with the slot's. Every box keeps its reflection slot.
    """

    def __init__(
        self, per_box_slots: int, *, boxes: Sequence[str] = (), reserve_reflection: bool = True
    ) -> None:
        """Pools of ``per_box_slots`` slots (each box's ``-np``), one per box (``boxes``, or as seen)."""
        self._template = SlotPool(per_box_slots, reserve_reflection=reserve_reflection)
        self.total_slots = per_box_slots
        self.reserve_reflection = reserve_reflection
        self._boxes: dict[str, SlotPool] = {
            box_name(box): SlotPool(per_box_slots, reserve_reflection=reserve_reflection) for box in boxes
        }
        self._box_of: OrderedDict[str, str] = OrderedDict()
        self._pending: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def conversation_slots(self) -> int:
        """Conversation slots per box."""
        return self._template.conversation_slots

    @property
    def reflection_slot(self) -> int:
        """The slot memory sub-runners use, on every box."""
        return self._template.reflection_slot

    def box_of(self, thread_id: str) -> str | None:
        """The box the gateway last served this thread from (``None``: not seen yet)."""
        with self._lock:
            return self._box_of.get(thread_id)

    def _first_slot(self, thread_id: str) -> int:
        """The slot of a thread's first request, whose box is not known yet.

        The lowest slot no live thread holds on any box, so it overwrites no one's
        cache wherever the gateway places it; when every slot is held somewhere, the
        lowest free on the boxes with the fewest threads (where ``min_group`` puts
        a new key); else the hash-preferred slot.
        """
        taken = set(self._pending.values())
        for pool in self._boxes.values():
            taken |= pool.held()
        free = [slot for slot in range(self.conversation_slots) if slot not in taken]
        if free:
            return free[0]
        load = Counter(self._box_of.values())
        fewest = min((load[box] for box in self._boxes), default=0)
        taken = set(self._pending.values())
        for box, pool in self._boxes.items():
            if load[box] == fewest:
                taken |= pool.held()
        free = [slot for slot in range(self.conversation_slots) if slot not in taken]
        if free:
            return free[0]
        # Every slot is held: not one another first request is about to fill (both would run cold).
        pending = set(self._pending.values())
        preferred = self._template.preferred_slot(thread_id)
        n = self.conversation_slots
        return next(
            (slot for slot in ((preferred + k) % n for k in range(n)) if slot not in pending), preferred
        )

    def slot_for(self, thread_id: str) -> int:
        """The thread's slot on its box (before its box is known, see ``_first_slot``)."""
        with self._lock:
            box = self._box_of.get(thread_id)
            pool = self._boxes.get(box) if box is not None else None
            if pool is None:
                slot = self._pending.get(thread_id)
                if slot is None:
                    slot = self._pending[thread_id] = self._first_slot(thread_id)
                return slot
        return pool.slot_for(thread_id)

    def served(self, thread_id: str, box: str) -> str | None:
        """Learn that ``box`` served the thread; returns the box it moved from (``None``: no move).

        The thread keeps the slot its first request used when it is free there. A
        move (the gateway re-placed the key after its box failed) frees the
        thread's slot on the old box and takes one on the new box.
        """
        box = box_name(box)
        with self._lock:
            before = self._box_of.get(thread_id)
            first = self._pending.pop(thread_id, None)
            self._box_of[thread_id] = box
            self._box_of.move_to_end(thread_id)
            if len(self._box_of) > 65_536:  # forget the least recently served threads
                self._box_of.popitem(last=False)
            pool = self._boxes.get(box)
            if pool is None:
                pool = SlotPool(self.total_slots, reserve_reflection=self.reserve_reflection)
                self._boxes[box] = pool
            old = self._boxes.get(before) if before is not None and before != box else None
        if old is not None:
            old.release(thread_id)
        pool.slot_for(thread_id, prefer=first)  # held from now on
        return before if before is not None and before != box else None

    def release(self, thread_id: str) -> None:
        """Forget a thread on its box."""
        with self._lock:
            box = self._box_of.pop(thread_id, None)
            self._pending.pop(thread_id, None)
            pool = self._boxes.get(box) if box is not None else None
        if pool is not None:
            pool.release(thread_id)
