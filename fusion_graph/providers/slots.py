"""llama-server slot affinity: each conversation keeps its own slot, and so its KV cache.

llama-server reuses a slot's cache by longest common prefix. Pinning a thread
to one slot (``id_slot``) means each local step only processes what is new since
that thread's previous local step. The slot is derived from the thread id with a
stable hash, so it survives process restarts. The last slot is reserved for
memory sub-runners so their jobs never evict a conversation's cache.

Start llama-server with an explicit ``-np N``: without it, recent versions
share one *unified* KV cache across slots and a pinned slot loses its cache
whenever other requests run in between.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

from fusion_graph.routing import Leg


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
            raise ValueError(f"total_slots must be >= 1, got {total_slots}")
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

    def slot_for(self, thread_id: str) -> int:
        """The slot of a conversation: kept while it is live, preferred slot first."""
        with self._lock:
            if thread_id in self._held:
                self._held.move_to_end(thread_id)
                return self._held[thread_id]
            taken = set(self._held.values())
            preferred = self.preferred_slot(thread_id)
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


def slot_body(leg: Leg, slot: int | None) -> dict[str, Any] | None:
    """Extra request-body fields for a step routed to ``leg``.

    Local steps pin their slot and ask for prompt caching; cloud steps carry
    neither (a cloud API would reject or ignore them). The leg is the one the
    router chose for *this* step, never whichever provider is "active".
    """
    if leg != "local" or slot is None:
        return None
    return {"id_slot": slot, "cache_prompt": True}
