"""The pieces every module of the shared state uses, below the runner and its concerns.

``SharedStateUnavailable``, row and lock keys, connection settings, the bounded
wait (``within``), and ``Runner``: the guarded entry points a concern module
reaches the database by, so it needs nothing else of the runner's.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from fusion_graph.errors import FusionError

T = TypeVar("T")


class SharedStateUnavailable(FusionError, RuntimeError):
    """The shared state's database cannot be reached, timed out or failed; the message (scrubbed) says why.

    Callers fall back to this process's own state and say so in the record; a
    turn never fails over it.
    """


class Runner(Protocol):
    """The runner's entry points a concern module uses (``shared_state.SharedState``).

    The concerns hold no pool, loop or guard of their own: every operation goes
    through ``run`` (from any loop) or ``guarded`` (already on the runner's loop).
    """

    url: str
    namespace: str
    timeout_s: float

    @property
    def connected(self) -> bool:
        """Whether the pool is up now."""
        ...

    @property
    def closed(self) -> bool:
        """Whether ``aclose`` has run."""
        ...

    def ensure_loop(self) -> asyncio.AbstractEventLoop:
        """The runner's loop, started on first use."""
        ...

    async def on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """``coro`` run on the runner's loop."""
        ...

    async def run(self, what: str, op: Callable[[Any], Awaitable[T]], *, timeout_s: float | None = None) -> T:
        """``op(pool)`` through the guard, from any loop."""
        ...

    async def guarded(self, what: str, op: Callable[[Any], Awaitable[T]], timeout_s: float) -> T:
        """``op(pool)`` through the guard, on the runner's loop."""
        ...

    def cleanup_due(self) -> None:
        """Start a clean-up of old rows when one is due (on the runner's loop)."""
        ...


def _utf8(text: str) -> bytes:
    """``text`` as bytes, whatever it holds: a lone surrogate (LangGraph accepts one in a thread id) too."""
    return text.encode("utf-8", "surrogatepass")


def lock_key(text: str) -> int:
    """A signed 64-bit advisory lock key for ``text`` (stable across processes)."""
    return int.from_bytes(hashlib.sha256(_utf8(text)).digest()[:8], "big", signed=True)


def row_key(*parts: str) -> str:
    """A database key for ``parts`` (namespace, names, a thread id), as a hash.

    No NUL byte or surrogate a caller put in a thread id reaches a ``text``
    column, and no part can run into the next.
    """
    return hashlib.sha256(b"\0".join(_utf8(part) for part in parts)).hexdigest()


#: TCP keepalives on every connection, so a connection a NAT or a failover dropped is found dead.
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 3, "keepalives_count": 3}


def connection_kwargs(timeout_s: float, *, statement: bool) -> dict[str, Any]:
    """Connection settings every shared-state connection gets: bounded connect, keepalives.

    ``statement``: also a server-side statement timeout (pooled connections;
    the lock connections wait on purpose and are bounded by their callers).
    """
    kwargs: dict[str, Any] = {
        "autocommit": True,
        "connect_timeout": max(2, math.ceil(timeout_s)),
        **KEEPALIVES,
    }
    if statement:
        kwargs["options"] = f"-c statement_timeout={int(timeout_s * 1000)}"
    return kwargs


_ABANDONED: set[asyncio.Future[Any]] = set()


async def within(aw: Awaitable[T], timeout_s: float) -> T:
    """``aw``'s result, or ``TimeoutError`` after ``timeout_s`` without waiting for it to stop.

    ``asyncio.wait_for`` waits for the cancelled operation to end, and psycopg's
    cancellation of a query on a stalled connection itself waits (seconds);
    here the caller goes on at once and the operation ends in the background.
    """
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if task in done:
        return task.result()
    task.cancel()
    _ABANDONED.add(task)
    task.add_done_callback(_forget)
    raise TimeoutError


def _forget(task: asyncio.Future[Any]) -> None:
    _ABANDONED.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: an abandoned operation's error is not reported again


def abandoned_on(loop: asyncio.AbstractEventLoop) -> list[asyncio.Future[Any]]:
    """Operations ``within`` gave up on that still run on ``loop`` (ended when the runner closes)."""
    return [task for task in _ABANDONED if task.get_loop() is loop]
