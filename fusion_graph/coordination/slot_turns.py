"""One request at a time on a llama-server slot: the turns of this process's requests.

Why a slot takes turns: llama-server (``server_context::get_available_slot``, as
vendored in llama-cpp-python 0.3.36) takes a request whose ``id_slot`` names a
slot as that slot's even while another request is generating there. With its
host prompt cache on (``--cache-ram``, the default) and
``--slot-prompt-similarity`` above 0 (the default 0.1), it then *saves and loads a
cached prompt into that busy slot* before it sees that the slot is processing and
defers the request: the KV cache of the running generation is overwritten, and
its answer silently leaves what the same prompt gives alone. A request that names
no slot never lands on a busy one (the similarity search and the LRU fallback
skip processing slots), but it lands on whichever idle slot llama-server picks,
so an unnamed request beside named ones is how a named one meets a busy slot.

So every local request fusion sends names a slot and holds that slot's turn while
it runs; ``SlotTurns`` keeps those turns for this process (an embedded graph, one
server process) and ``SharedState.locks.slot_turn`` for a deployment's workers. The
turns are first come, first served across every event loop of the process (a
sync ``invoke`` runs on a loop of its own; a server may run each run on its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field

from fusion_graph.errors import SlotBusy


@dataclass(eq=False)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    woken: asyncio.Future[None]
    granted: bool = False
    """Set under the table's lock when the turn is handed over: the waiter owns it from then on."""


@dataclass
class _Slot:
    held: bool = False
    waiting: deque[_Waiter] = field(default_factory=deque)


class SlotTurns:
    """The turns of this process's requests on each slot: at most one request a slot at a time.

    Thread-safe: a turn given back on one event loop wakes a waiter on another.
    """

    def __init__(self) -> None:
        """No slot held."""
        self._slots: dict[Hashable, _Slot] = {}
        self._lock = threading.Lock()

    def busy(self, key: Hashable) -> bool:
        """Whether a request of this process holds ``key``'s turn now."""
        with self._lock:
            slot = self._slots.get(key)
            return slot is not None and slot.held

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable, *, wait_s: float) -> AsyncIterator[None]:
        """Hold ``key``'s turn for one request, waiting up to ``wait_s`` for the request before it.

        Raises:
            SlotBusy: The slot stayed busy for ``wait_s`` (the request is not sent).
        """
        await self.take(key, wait_s=wait_s)
        try:
            yield
        finally:
            self.give_back(key)

    async def take(self, key: Hashable, *, wait_s: float) -> None:
        """Take ``key``'s turn (see ``hold``); the caller gives it back with ``give_back``."""
        loop = asyncio.get_running_loop()
        with self._lock:
            slot = self._slots.setdefault(key, _Slot())
            if not slot.held:
                slot.held = True
                return
            waiter = _Waiter(loop, loop.create_future())
            slot.waiting.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.woken), wait_s)
        except BaseException as error:
            with self._lock:
                owned = waiter.granted
                if not owned:
                    slot.waiting.remove(waiter)
            if owned:  # handed over as the wait ended: pass it on rather than lose it
                self.give_back(key)
            if isinstance(error, TimeoutError):
                raise SlotBusy(
                    f"slot {key!r} stayed busy for {wait_s:g} s with another request; this request "
                    "was not sent, since naming a busy slot can corrupt the generation running there"
                ) from None
            raise

    def give_back(self, key: Hashable) -> None:
        """Give ``key``'s turn to the next waiter, if any (first come, first served)."""
        while True:
            with self._lock:
                slot = self._slots[key]
                if not slot.waiting:
                    del self._slots[key]  # nobody waits: the slot is free, and the table stays small
                    return
                waiter = slot.waiting.popleft()
                waiter.granted = True
            try:
                waiter.loop.call_soon_threadsafe(_wake, waiter.woken)
                return
            except RuntimeError:  # its loop is closed: nobody is waiting there any more
                continue


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


#: The turns of this whole process: every graph in it that sends to a box takes turns on its slots
#: here (two graphs built over one llama-server must not name one slot at once either).
TURNS = SlotTurns()
