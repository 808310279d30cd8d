"""llama-server slot affinity: each conversation keeps its own slot, and so its KV cache.

llama-server reuses a slot's cache by longest common prefix. Pinning a thread
to one slot (``id_slot``) means each local step only processes what is new since
that thread's previous local step. The slot is derived from the thread id with a
stable hash, so it survives process restarts. The last slot is reserved for
memory sub-runners so their jobs never evict a conversation's cache.

Every local request also carries the thread's routing key (``routing_key``),
a stable hash that does not reveal the thread id, for a gateway or a log in
front of the server. Which slot a thread gets in a running graph is the lease
rule's (``coordination.slot_leases``); ``SlotPool`` gives the slot counts, the
reflection slot and a thread's preferred slot to it.

Start llama-server with an explicit ``-np N``: without it, recent versions
share one *unified* KV cache across slots and a pinned slot loses its cache
whenever other requests run in between.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections import OrderedDict

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
        """The slot a thread's id hashes to (stable across processes).

        Any id hashes, a lone surrogate too (``surrogatepass``: other ids hash as they always did).
        """
        digest = hashlib.sha256(thread_id.encode("utf-8", "surrogatepass")).digest()
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
    not reveal the thread id to the gateway or its logs. Any id hashes, a lone surrogate
    too (``surrogatepass``, which leaves every other id's key as it was): the key, not the
    id, goes into HTTP headers and the shared slot table.
    """
    utf8 = thread_id.encode("utf-8", "surrogatepass")
    return "t" + hashlib.sha256(b"fusion-thread\0" + utf8).hexdigest()[:24]


def box_name(url: str) -> str:
    """A box's URL as a gateway names it: no trailing ``/`` or ``/v1``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url
