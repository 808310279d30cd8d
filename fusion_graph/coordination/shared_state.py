"""What the worker processes of one deployment share, kept in the deployment's Postgres.

A LangGraph server hands each run of a thread to whichever worker process is
free, and a dead worker's run to another. What one process would keep in
memory must then live where every worker reads it (``shared_state="postgres"``).
``SharedState`` is the one object callers get; it runs every operation and
exposes each concern as an attribute, each in a module of its own with its SQL:

- ``leases`` (``shared_leases.SlotLeases``): which (box, slot) each thread holds
  on the local leg, claimed atomically (no two live threads hold one slot),
  renewed by use, released by expiry when a thread has been idle ``slot_lease_s``;
- ``health`` (``shared_health.ProviderHealth``): a provider one worker cooled
  down is skipped by every worker; a change is pushed with ``NOTIFY`` and read
  back periodically;
- ``jobs`` (``shared_jobs.JobClaims``): a pending memory job is run by exactly
  one worker at a time, taken over when its lease lapses, and finished (written) once;
- ``locks`` (``shared_locks.AdvisoryLocks``): requests of several processes on
  one box's slot take turns (``slot_turn``), and a session advisory lock per
  running thread refuses a second concurrent run of it on a shared checkpointer
  (``thread_run``); Postgres drops a lock with the connection of a process that dies.

This module is the runner under them: one event loop thread of its own, the
connection pool, the guard every operation goes through, the tables and their
clean-up. The graph runs on whatever loop its caller brings (``langgraph dev``,
a server's isolated per-run loops, the sync entry points), and a connection or
a listener bound to one of those would freeze with it. The concerns reach the
runner only through ``shared_base.Runner``. ``psycopg`` is imported on first use
(the ``postgres`` extra).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fusion_graph.coordination import shared_health, shared_jobs, shared_leases
from fusion_graph.coordination.shared_base import (
    SharedStateUnavailable,
    abandoned_on,
    connection_kwargs,
    lock_key,
    row_key,
    within,
)
from fusion_graph.coordination.shared_health import ProviderHealth
from fusion_graph.coordination.shared_jobs import JobClaims
from fusion_graph.coordination.shared_leases import SlotLeases
from fusion_graph.coordination.shared_locks import AdvisoryLocks
from fusion_graph.errors import ProviderConfigError, SlotBusy
from fusion_graph.redact import register_url_secrets, scrub

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Seconds one shared-state operation may take, connecting, checking a pooled connection and its
#: statements included (``shared_state_timeout_s`` sets it): past it the turn places in-process.
DEFAULT_TIMEOUT_S = 3.0
#: Seconds between attempts to reach the database again after it failed, at most (the wait doubles
#: from one second): a restarted database is used again within this long of answering.
RECONNECT_MAX_S = 5.0
#: Seconds between two clean-ups of the tables by one process.
CLEANUP_EVERY_S = 60.0

#: Every concern's tables, made on first use.
SCHEMA = shared_leases.SCHEMA + shared_health.SCHEMA + shared_jobs.SCHEMA
#: Every shared table, as ``table_sizes`` counts them.
TABLES = (*shared_leases.TABLES, *shared_health.TABLES, *shared_jobs.TABLES)


def default_namespace() -> str:
    """The namespace of this deployment's rows when the operator names none.

    Workers of one LangGraph server share ``DATABASE_URI`` (their checkpointer),
    so its hash keeps two deployments on one shared-state database apart; an
    embedded app without it is ``"default"``. Two embedded apps under ``"default"``
    still keep their memory job claims and thread run locks apart (keyed by their
    job log entries and checkpoint stores); ``FUSION_SHARED_STATE_NAMESPACE`` per
    app also keeps their slot leases and cooldowns apart.
    """
    uri = os.environ.get("DATABASE_URI")
    return "db-" + row_key(uri)[:16] if uri else "default"


class SharedState:
    """The shared tables of one deployment, reached from an event loop thread of its own.

    Every operation of every concern goes through one guarded path (``run``):
    bounded by ``timeout_s`` (connecting, checking a pooled connection and the statements;
    TCP keepalives find a connection a NAT dropped), and any failure, a database
    restart, stall or dropped connection included, comes out as
    ``SharedStateUnavailable``, which callers turn into in-process placement for
    that request. A failure that says the connections are gone drops the pool;
    the next operation after a short wait (doubling up to ``RECONNECT_MAX_S``)
    connects afresh, so a restarted database is used again on its own.

    Rows are keyed by ``namespace`` as well as the thread, so apps that share
    one database never meet; finished claims and long-idle leases are deleted
    (``shared_jobs.CLAIM_RETENTION_S``, ``shared_leases.LEASE_RETENTION_S``), so every table stays bounded
    by live work.
    """

    def __init__(
        self, url: str, *, namespace: str = "", timeout_s: float = DEFAULT_TIMEOUT_S, pool_size: int = 4
    ) -> None:
        """Connect lazily to the Postgres at ``url`` (the tables are made on first use).

        ``url``'s password (the whole URL when it cannot be parsed) is registered
        as a secret, so no log record or error of the package or of psycopg shows it.
        """
        register_url_secrets(url)
        self.url = url
        self.namespace = namespace or default_namespace()
        self.timeout_s = timeout_s
        self.pool_size = pool_size
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread_lock = threading.Lock()
        self._pool: Any = None
        self._connect_lock: asyncio.Lock | None = None
        self._down_until = 0.0
        self._down_reason = ""
        self._backoff = 0.0
        self._cleaned_at = 0.0
        self._closed = False
        self._background: set[asyncio.Task[Any]] = set()
        #: Operations that failed since this object was made (``SharedStateUnavailable`` raised).
        self.failures = 0
        self.leases = SlotLeases(self)
        self.health = ProviderHealth(self)
        self.jobs = JobClaims(self)
        self.locks = AdvisoryLocks(self)

    @property
    def connected(self) -> bool:
        """Whether the pool is up now (the health copy is re-read only then)."""
        return self._pool is not None

    @property
    def closed(self) -> bool:
        """Whether ``aclose`` has run (the health listener stops)."""
        return self._closed

    # -- the loop thread ----------------------------------------------------------------------

    def ensure_loop(self) -> asyncio.AbstractEventLoop:
        """This object's loop, its thread started on first use (refused once closed)."""
        with self._thread_lock:
            if self._closed:
                raise SharedStateUnavailable("the shared state is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="fusion-shared-state", daemon=True)
                thread.start()
                self._loop = loop
            return self._loop

    async def on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this object's loop and await its result from the caller's loop."""
        try:
            loop = self.ensure_loop()
        except SharedStateUnavailable:
            coro.close()
            raise
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, loop)
        return await asyncio.wrap_future(future)

    # -- the one guarded path -----------------------------------------------------------------

    async def run(self, what: str, op: Callable[[Any], Awaitable[T]], *, timeout_s: float | None = None) -> T:
        """``op(pool)`` on this object's loop, bounded; any failure raised as ``SharedStateUnavailable``.

        ``what`` names the operation in the error (``timeout_s``: a longer bound
        for an operation that waits on purpose).
        """
        return await self.on_loop(self.guarded(what, op, timeout_s or self.timeout_s))

    async def guarded(self, what: str, op: Callable[[Any], Awaitable[T]], timeout_s: float) -> T:
        """``run`` for a caller already on this object's loop (a background write or re-read)."""
        try:
            pool = await self._connected()
            return await within(op(pool), timeout_s)
        except SharedStateUnavailable:
            self.failures += 1
            raise
        except SlotBusy:  # the database answered: the slot is busy, nothing failed
            raise
        except Exception as error:  # noqa: BLE001 - every database failure is a fallback, never a failed turn
            self.failures += 1
            raise self._failed(what, error) from None

    def _failed(self, what: str, error: BaseException) -> SharedStateUnavailable:
        """The error to raise for ``error``; one that says the connections are gone drops the pool."""
        import psycopg
        from psycopg_pool import PoolTimeout

        kind = "timed out" if isinstance(error, TimeoutError) else f"{type(error).__name__}: {error}"
        reason = scrub(f"the shared state's Postgres failed ({what}): {kind}")
        if isinstance(
            error, TimeoutError | OSError | PoolTimeout | psycopg.OperationalError | psycopg.InterfaceError
        ):
            self._mark_down(reason)
        return SharedStateUnavailable(reason)

    def _mark_down(self, reason: str) -> None:
        """Fall back at once for a short while (doubling up to ``RECONNECT_MAX_S``); drop the pool."""
        self._backoff = min(RECONNECT_MAX_S, max(1.0, self._backoff * 2))
        self._down_until = time.monotonic() + self._backoff
        if not self._down_reason:
            logger.warning("%s; placing in this process until it answers again", reason)
        self._down_reason = reason
        pool, self._pool = self._pool, None
        if pool is not None:  # closed in the background: a frozen connection must not hold anyone up
            self._spawn(self._discard(pool))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in the background on this object's loop, kept until it ends (``aclose`` waits)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _discard(self, pool: Any) -> None:
        with contextlib.suppress(Exception):
            await within(pool.close(timeout=0), self.timeout_s)

    async def _connected(self) -> Any:
        """The connection pool (on this object's loop), the tables made and the listener started.

        Raises:
            SharedStateUnavailable: The database cannot be reached (again at once until
                the back-off has passed, so callers do not each wait on a dead database).
        """
        if self._pool is not None:
            return self._pool
        if time.monotonic() < self._down_until:
            raise SharedStateUnavailable(self._down_reason)
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            if self._pool is not None:
                return self._pool
            if time.monotonic() < self._down_until:
                raise SharedStateUnavailable(self._down_reason)
            try:
                import psycopg
                from psycopg_pool import AsyncConnectionPool
            except ImportError:
                raise ProviderConfigError(
                    "shared_state='postgres' needs psycopg: pip install 'fusion-graph[postgres]'"
                ) from None
            pool = AsyncConnectionPool(
                self.url,
                min_size=1,
                max_size=self.pool_size,
                open=False,
                kwargs=connection_kwargs(self.timeout_s, statement=True),
                check=AsyncConnectionPool.check_connection,
                timeout=self.timeout_s,
                name="fusion-shared-state",
            )
            try:
                # One direct connection first: a refused or unknown database fails at once (the pool
                # would retry until its timeout), and it makes the tables.
                async def prepare() -> None:
                    conn = await psycopg.AsyncConnection.connect(
                        self.url, **connection_kwargs(self.timeout_s, statement=True)
                    )
                    async with conn, conn.transaction():
                        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key("fusion-schema"),))
                        await conn.execute(SCHEMA)
                    await pool.open(wait=True, timeout=self.timeout_s)

                await within(prepare(), 2 * self.timeout_s)
            except Exception as error:  # noqa: BLE001 - reported scrubbed; callers fall back
                await self._discard(pool)
                kind = "timed out" if isinstance(error, TimeoutError) else str(error)
                self._mark_down(scrub(f"the shared state's Postgres cannot be reached: {kind}"))
                raise SharedStateUnavailable(self._down_reason) from None
            if self._down_reason:
                logger.warning("the shared state's Postgres answers again: shared placement resumes")
            self._pool, self._backoff, self._down_reason = pool, 0.0, ""
            await self.health.sync()
            self.health.start_listening()
            return pool

    def cleanup_due(self) -> None:
        """Start a clean-up of the tables in the background when the last one is old enough."""
        if time.monotonic() - self._cleaned_at < CLEANUP_EVERY_S:
            return
        self._cleaned_at = time.monotonic()
        self._spawn(self._cleanup())

    async def _cleanup(self) -> None:
        try:
            await self.guarded("cleaning up", self._delete_old, self.timeout_s)
        except SharedStateUnavailable as error:
            logger.debug("shared state clean-up skipped: %s", error)

    async def _delete_old(self, pool: Any) -> tuple[int, int]:
        async with pool.connection() as conn:
            claims = await shared_jobs.delete_old(conn)
            leases = await shared_leases.delete_old(conn)
        return claims, leases

    async def cleanup(self) -> tuple[int, int]:
        """Delete finished job claims and long-idle leases now: how many of each (tests, ``doctor``)."""
        return await self.run("cleaning up", self._delete_old)

    async def table_sizes(self) -> dict[str, int]:
        """Rows in each shared table, every namespace together (checks, tests and ``doctor``)."""

        async def sizes(connections: Any) -> dict[str, int]:
            found = {}
            async with connections.connection() as conn:
                for table in TABLES:
                    cursor = await conn.execute(f"SELECT count(*) FROM {table}")  # fixed table names
                    row = await cursor.fetchone()
                    found[table] = int(row[0]) if row else 0
            return found

        return await self.run("counting rows", sizes)

    # -- lifecycle ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the connections and stop the loop thread."""
        if self._loop is None:
            self._closed = True
            return
        await self.health.flush()  # announcements already made still go out
        with contextlib.suppress(Exception):
            await self.on_loop(self._close())
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _close(self) -> None:
        loop = asyncio.get_running_loop()
        left = [*self._background, *abandoned_on(loop)]
        for task in left:  # clean-ups and operations given up on: ended, not left to die with the loop
            task.cancel()
        if left:
            await asyncio.wait(left, timeout=self.timeout_s)
        await self.health.stop_listening()
        if self._pool is not None:
            await self._discard(self._pool)
        self._pool = None
