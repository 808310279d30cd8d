"""Folds over a growing history, remembered, so a step pays for its new messages only.

A thread's history grows by appending; each step asks the same questions
(token sums, where the turn starts, which calls were made) of a list that
extends the previous step's. ``HistoryMemo`` keeps the last few histories
(by the identity of their first message) with what was computed for them;
a caller extends a remembered value over the new messages instead of folding
the whole history again. Messages are taken as immutable, as LangGraph treats
them: a changed message is a new object, so the history no longer matches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Generic, TypeVar

from langchain_core.messages import BaseMessage

V = TypeVar("V")


class HistoryMemo(Generic[V]):
    """The values computed for the last ``limit`` histories seen; thread-safe."""

    def __init__(self, limit: int = 16) -> None:
        """Keep at most ``limit`` histories."""
        self._limit = limit
        self._known: OrderedDict[int, tuple[list[BaseMessage], V]] = OrderedDict()
        self._lock = threading.Lock()

    def find(self, items: list[BaseMessage]) -> tuple[int, V] | None:
        """``(n, value)``: a remembered history agrees with ``items`` on its first ``n`` messages.

        ``n`` is the shorter of the two lengths; the value is what was stored for
        the remembered history (which may be longer than ``items``).
        """
        if not items:
            return None
        with self._lock:
            known = self._known.get(id(items[0]))
            if known is None or known[0][0] is not items[0]:
                return None
            seen, value = known
            shared = min(len(seen), len(items))
            if seen[:shared] != items[:shared]:  # the same (or equal) messages, or not this history
                return None
            self._known.move_to_end(id(items[0]))
            return shared, value

    def store(self, items: Sequence[BaseMessage], value: V) -> None:
        """Remember ``value`` for ``items`` (a copy of the list: the caller's may grow)."""
        if not items:
            return
        with self._lock:
            self._known[id(items[0])] = (list(items), value)
            self._known.move_to_end(id(items[0]))
            if len(self._known) > self._limit:
                self._known.popitem(last=False)
