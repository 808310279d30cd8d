"""What the worker processes of one deployment share, kept in the deployment's Postgres.

A LangGraph server hands each run of a thread to whichever worker process is
free, and a dead worker's run to another. What one process would keep in
memory must then live where every worker reads it (``shared_state="postgres"``):

- **slot leases**: which (box, slot) each thread holds on the local leg, claimed
  atomically (no two live threads hold one slot), renewed by use, released by
  expiry when a thread has been idle ``slot_lease_s``;
- **provider cooldowns**: a provider one worker cooled down is skipped by every
  worker; a change is pushed with ``NOTIFY`` and read back periodically;
- **memory job claims**: a pending memory job is run by exactly one worker at a
  time, taken over when its lease lapses, and finished (written) once;
- **the reflection slot**: requests of several processes on one box's
  reflection slot (memory jobs) take turns (``slot_turn``);
- **thread runs**: a session advisory lock per running thread, so a second
  concurrent run of one thread on a shared checkpointer is refused; Postgres
  drops the lock with the connection of a process that dies.

All of it runs on one event loop thread of this object's own: the graph runs on
whatever loop its caller brings (``langgraph dev``, a server's isolated
per-run loops, the sync entry points), and a connection or a listener bound to
one of those would freeze with it. ``psycopg`` is imported on first use (the
``postgres`` extra).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, NamedTuple, TypeVar

from fusion_graph.coordination.slot_leases import LeaseAsk, LeaseRow, SlotClaim, choose_slot
from fusion_graph.errors import FusionError, ProviderConfigError, SlotBusy
from fusion_graph.redact import register_url_secrets, scrub

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: The channel cooldown changes are announced on.
HEALTH_CHANNEL = "fusion_provider_health"
#: Seconds after which the cooldown table is read again even if no notice came (a dropped listener).
HEALTH_RESYNC_S = 5.0
#: Seconds one shared-state operation may take, connecting, checking a pooled connection and its
#: statements included (``shared_state_timeout_s`` sets it): past it the turn places in-process.
DEFAULT_TIMEOUT_S = 3.0
#: Seconds between attempts to reach the database again after it failed, at most (the wait doubles
#: from one second): a restarted database is used again within this long of answering.
RECONNECT_MAX_S = 5.0
#: TCP keepalives on every connection, so a connection a NAT or a failover dropped is found dead.
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 3, "keepalives_count": 3}
#: Finished job claims (and claims nobody renewed) are deleted this long after their lease ended.
CLAIM_RETENTION_S = 3600.0
#: Slot leases idle this long are deleted (a box or pool that is gone), and so are threads' home boxes.
LEASE_RETENTION_S = 86_400.0
#: Seconds between two clean-ups of the tables by one process.
CLEANUP_EVERY_S = 60.0


class SharedStateUnavailable(FusionError, RuntimeError):
    """The shared state's database cannot be reached, timed out or failed; the message (scrubbed) says why.

    Callers fall back to this process's own state and say so in the record; a
    turn never fails over it.
    """


SCHEMA = """
CREATE TABLE IF NOT EXISTS fusion_slot_leases (
    pool text NOT NULL,
    box text NOT NULL,
    slot integer NOT NULL,
    holder text NOT NULL,
    expires_at timestamptz NOT NULL,
    used_at timestamptz NOT NULL,
    PRIMARY KEY (pool, box, slot)
);
ALTER TABLE fusion_slot_leases ADD COLUMN IF NOT EXISTS idle boolean NOT NULL DEFAULT false;
CREATE INDEX IF NOT EXISTS fusion_slot_leases_holder ON fusion_slot_leases (pool, holder);
CREATE TABLE IF NOT EXISTS fusion_slot_homes (
    pool text NOT NULL,
    holder text NOT NULL,
    box text NOT NULL,
    seen_at timestamptz NOT NULL,
    PRIMARY KEY (pool, holder)
);
CREATE TABLE IF NOT EXISTS fusion_provider_health (
    provider text PRIMARY KEY,
    cooldown_until double precision,
    last_error text,
    updated_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS fusion_job_claims (
    job_key text PRIMARY KEY,
    owner text NOT NULL,
    attempt integer NOT NULL,
    lease_until timestamptz NOT NULL,
    done boolean NOT NULL DEFAULT false
);
CREATE INDEX IF NOT EXISTS fusion_job_claims_lease ON fusion_job_claims (lease_until);
"""


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


class JobClaim(NamedTuple):
    """One row of the memory job claims table (``job_claims``), by name rather than position."""

    owner: str
    attempt: int
    done: bool
    live: bool
    """Whether its lease has not lapsed."""


class SharedState:
    """The shared tables of one deployment, reached from an event loop thread of its own.

    Every operation goes through one guarded path (``_run``): bounded by
    ``timeout_s`` (connecting, checking a pooled connection and the statements;
    TCP keepalives find a connection a NAT dropped), and any failure, a database
    restart, stall or dropped connection included, comes out as
    ``SharedStateUnavailable``, which callers turn into in-process placement for
    that request. A failure that says the connections are gone drops the pool;
    the next operation after a short wait (doubling up to ``RECONNECT_MAX_S``)
    connects afresh, so a restarted database is used again on its own.

    Rows are keyed by ``namespace`` as well as the thread, so apps that share
    one database never meet; finished claims and long-idle leases are deleted
    (``CLAIM_RETENTION_S``, ``LEASE_RETENTION_S``), so every table stays bounded
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
        self._publish_lock: asyncio.Lock | None = None
        self._publishing: set[concurrent.futures.Future[None]] = set()
        self._down_until = 0.0
        self._down_reason = ""
        self._backoff = 0.0
        self._cleaned_at = 0.0
        #: Provider cooldowns as last read or announced: key -> (wall-clock end, last error).
        self._cooldowns: dict[str, tuple[float, str | None]] = {}
        self._synced_at = 0.0
        self._listener: asyncio.Task[None] | None = None
        self._closed = False
        self._background: set[asyncio.Task[Any]] = set()
        #: Operations that failed since this object was made (``SharedStateUnavailable`` raised).
        self.failures = 0

    # -- the loop thread ----------------------------------------------------------------------

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._thread_lock:
            if self._closed:
                raise SharedStateUnavailable("the shared state is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="fusion-shared-state", daemon=True)
                thread.start()
                self._loop = loop
            return self._loop

    async def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this object's loop and await its result from the caller's loop."""
        try:
            loop = self._ensure_loop()
        except SharedStateUnavailable:
            coro.close()
            raise
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, loop)
        return await asyncio.wrap_future(future)

    # -- the one guarded path -----------------------------------------------------------------

    async def _run(
        self, what: str, op: Callable[[Any], Awaitable[T]], *, timeout_s: float | None = None
    ) -> T:
        """``op(pool)`` on this object's loop, bounded; any failure raised as ``SharedStateUnavailable``.

        ``what`` names the operation in the error (``timeout_s``: a longer bound
        for an operation that waits on purpose).
        """
        return await self._on_loop(self._guarded(what, op, timeout_s or self.timeout_s))

    async def _guarded(self, what: str, op: Callable[[Any], Awaitable[T]], timeout_s: float) -> T:
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
            await self._sync_health()
            if self._listener is None or self._listener.done():
                self._listener = asyncio.get_running_loop().create_task(self._listen())
            return pool

    def _cleanup_due(self) -> None:
        """Start a clean-up of the tables in the background when the last one is old enough."""
        if time.monotonic() - self._cleaned_at < CLEANUP_EVERY_S:
            return
        self._cleaned_at = time.monotonic()
        self._spawn(self._cleanup())

    async def _cleanup(self) -> None:
        try:
            await self._guarded("cleaning up", self._delete_old, self.timeout_s)
        except SharedStateUnavailable as error:
            logger.debug("shared state clean-up skipped: %s", error)

    async def _delete_old(self, pool: Any) -> tuple[int, int]:
        async with pool.connection() as conn:
            claims = await conn.execute(
                "DELETE FROM fusion_job_claims WHERE lease_until < now() - make_interval(secs => %s)",
                (CLAIM_RETENTION_S,),
            )
            leases = await conn.execute(
                "DELETE FROM fusion_slot_leases WHERE used_at < now() - make_interval(secs => %s) "
                "AND expires_at < now()",
                (LEASE_RETENTION_S,),
            )
            await conn.execute(
                "DELETE FROM fusion_slot_homes WHERE seen_at < now() - make_interval(secs => %s)",
                (LEASE_RETENTION_S,),
            )
        return claims.rowcount, leases.rowcount

    async def cleanup(self) -> tuple[int, int]:
        """Delete finished job claims and long-idle leases now: how many of each (tests, ``doctor``)."""
        return await self._run("cleaning up", self._delete_old)

    # -- slot leases --------------------------------------------------------------------------

    def _pool_key(self, pool: str) -> str:
        return f"{self.namespace}|{pool}"

    async def claim_slot(self, ask: LeaseAsk) -> SlotClaim:
        """Claim (or renew) the asking thread's slot in its pool atomically; see ``choose_slot``."""
        key, wanted, slots, holder, lease_s = (
            self._pool_key(ask.pool),
            ask.boxes,
            ask.slots,
            ask.holder,
            ask.lease_s,
        )

        async def claim(connections: Any) -> SlotClaim:
            async with connections.connection() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(f"fusion-slots:{key}"),))
                cursor = await conn.execute(
                    "SELECT box, slot, holder, expires_at > now(), extract(epoch FROM used_at), idle "
                    "FROM fusion_slot_leases WHERE pool = %s",
                    (key,),
                )
                rows = [
                    LeaseRow(b, s, h, bool(live), float(used), bool(idle))
                    for b, s, h, live, used, idle in await cursor.fetchall()
                ]
                rows = [row for row in rows if row.box in wanted and row.slot < slots]
                home = None
                if len(wanted) > 1:  # the box whose host prompt cache has the thread's prefix
                    cursor = await conn.execute(
                        "SELECT box FROM fusion_slot_homes WHERE pool = %s AND holder = %s", (key, holder)
                    )
                    found = await cursor.fetchone()
                    home = str(found[0]) if found else None
                claim = choose_slot(
                    rows, wanted, slots, holder, ask.preferred % slots, home=home, stay_home=ask.stay_home
                )
                if claim.guest:
                    return claim
                if len(wanted) > 1:
                    await conn.execute(
                        "INSERT INTO fusion_slot_homes (pool, holder, box, seen_at) "
                        "VALUES (%s, %s, %s, now()) "
                        "ON CONFLICT (pool, holder) DO UPDATE SET box = EXCLUDED.box, seen_at = now()",
                        (key, holder, claim.box),
                    )
                await conn.execute(
                    "INSERT INTO fusion_slot_leases (pool, box, slot, holder, expires_at, used_at, idle) "
                    "VALUES (%s, %s, %s, %s, now() + make_interval(secs => %s), now(), false) "
                    "ON CONFLICT (pool, box, slot) DO UPDATE SET holder = EXCLUDED.holder, "
                    "expires_at = EXCLUDED.expires_at, used_at = EXCLUDED.used_at, idle = false",
                    (key, claim.box, claim.slot, holder, lease_s),
                )
                # A thread holds one slot of a pool: its older rows (a lapsed lease elsewhere) go.
                await conn.execute(
                    "DELETE FROM fusion_slot_leases "
                    "WHERE pool = %s AND holder = %s AND NOT (box = %s AND slot = %s)",
                    (key, holder, claim.box, claim.slot),
                )
            self._cleanup_due()
            return SlotClaim(claim.box, claim.slot, expires_in_s=lease_s, took_from=claim.took_from)

        return await self._run("claiming a slot", claim)

    async def release_slot(self, pool: str, holder: str) -> None:
        """Mark ``holder``'s lease idle (its run ended): a thread that needs a slot now may take it."""
        key = self._pool_key(pool)

        async def idle(connections: Any) -> None:
            async with connections.connection() as conn:
                await conn.execute(
                    "UPDATE fusion_slot_leases SET idle = true WHERE pool = %s AND holder = %s", (key, holder)
                )

        await self._run("releasing a slot", idle)

    async def box_of(self, pool: str, holder: str) -> str | None:
        """The box ``holder`` holds a live slot on (``None``: none)."""
        key = self._pool_key(pool)

        async def find(connections: Any) -> str | None:
            async with connections.connection() as conn:
                cursor = await conn.execute(
                    "SELECT box FROM fusion_slot_leases "
                    "WHERE pool = %s AND holder = %s AND expires_at > now()",
                    (key, holder),
                )
                row = await cursor.fetchone()
            return str(row[0]) if row else None

        return await self._run("finding a thread's box", find)

    async def slot_table(self, pool: str) -> list[tuple[str, int, str, bool]]:
        """Every lease of ``pool``: box, slot, holder and whether it is live (for checks and tests)."""
        key = self._pool_key(pool)

        async def table(connections: Any) -> list[tuple[str, int, str, bool]]:
            async with connections.connection() as conn:
                cursor = await conn.execute(
                    "SELECT box, slot, holder, expires_at > now() FROM fusion_slot_leases WHERE pool = %s "
                    "ORDER BY box, slot",
                    (key,),
                )
                return [(str(b), int(s), str(h), bool(live)) for b, s, h, live in await cursor.fetchall()]

        return await self._run("reading the slot table", table)

    async def table_sizes(self) -> dict[str, int]:
        """Rows in each shared table, every namespace together (checks, tests and ``doctor``)."""

        async def sizes(connections: Any) -> dict[str, int]:
            found = {}
            async with connections.connection() as conn:
                for table in (
                    "fusion_slot_leases",
                    "fusion_slot_homes",
                    "fusion_provider_health",
                    "fusion_job_claims",
                ):
                    cursor = await conn.execute(f"SELECT count(*) FROM {table}")  # fixed table names
                    row = await cursor.fetchone()
                    found[table] = int(row[0]) if row else 0
            return found

        return await self._run("counting rows", sizes)

    # -- provider cooldowns -------------------------------------------------------------------

    def _provider_key(self, provider: str) -> str:
        return f"{self.namespace}|{provider}"

    def cooldown(self, provider: str) -> tuple[float, str | None] | None:
        """The cooldown every worker knows for ``provider`` (wall-clock end, error), if any now.

        Read from this process's copy (updated by announcements); asks for a
        re-read in the background when the copy is older than ``HEALTH_RESYNC_S``.
        """
        if self._pool is not None and time.monotonic() - self._synced_at > HEALTH_RESYNC_S:
            self._synced_at = time.monotonic()
            with contextlib.suppress(SharedStateUnavailable):
                asyncio.run_coroutine_threadsafe(self._sync_health(), self._ensure_loop())
        known = self._cooldowns.get(provider)
        if known is None or known[0] <= time.time():
            return None
        return known

    async def publish_cooldown(self, provider: str, until: float | None, error: str | None) -> None:
        """Tell every worker ``provider`` cools down until ``until`` (wall clock; ``None``: it recovered).

        The write goes out in the background, in the order announced: the call
        that saw the failure falls over at once instead of waiting on the database.
        """
        if until is None:
            self._cooldowns.pop(provider, None)
        else:
            self._cooldowns[provider] = (until, error)
        try:
            loop = self._ensure_loop()
        except SharedStateUnavailable:
            return
        future = asyncio.run_coroutine_threadsafe(self._publish(provider, until, error), loop)
        self._publishing.add(future)
        future.add_done_callback(self._published)

    def _published(self, future: concurrent.futures.Future[None]) -> None:
        self._publishing.discard(future)
        error = None if future.cancelled() else future.exception()
        if error is not None:  # the other workers learn it themselves then
            logger.warning("announcing a provider cooldown failed: %s", scrub(str(error)))

    async def _publish(self, provider: str, until: float | None, error: str | None) -> None:
        if self._publish_lock is None:
            self._publish_lock = asyncio.Lock()
        message = scrub(error)[:500] if error else None
        key = self._provider_key(provider)

        async def write(connections: Any) -> None:
            async with connections.connection() as conn, conn.transaction():
                await conn.execute(
                    "INSERT INTO fusion_provider_health (provider, cooldown_until, last_error, updated_at) "
                    "VALUES (%s, %s, %s, now()) ON CONFLICT (provider) DO UPDATE SET "
                    "cooldown_until = EXCLUDED.cooldown_until, last_error = EXCLUDED.last_error, "
                    "updated_at = now()",
                    (key, until, message),
                )
                payload = json.dumps({"provider": key, "until": until, "error": message})
                await conn.execute("SELECT pg_notify(%s, %s)", (HEALTH_CHANNEL, payload))

        async with self._publish_lock:  # FIFO: a recovery never lands before the cooldown it ends
            await self._guarded("announcing a cooldown", write, self.timeout_s)

    async def _sync_health(self) -> None:
        prefix = self._provider_key("")

        async def read(connections: Any) -> list[tuple[Any, ...]]:
            async with connections.connection() as conn:
                cursor = await conn.execute(
                    "SELECT provider, cooldown_until, last_error FROM fusion_provider_health "
                    "WHERE starts_with(provider, %s) AND cooldown_until IS NOT NULL "
                    "AND cooldown_until > extract(epoch FROM now())",
                    (prefix,),
                )
                return list(await cursor.fetchall())

        try:
            rows = await self._guarded("reading provider cooldowns", read, self.timeout_s)
        except SharedStateUnavailable as error:  # the next read tries again
            logger.debug("reading the shared provider cooldowns failed: %s", error)
            return
        self._cooldowns = {str(p)[len(prefix) :]: (float(u), e) for p, u, e in rows}
        self._synced_at = time.monotonic()

    async def _listen(self) -> None:
        """Apply cooldown announcements as they come; reconnect when the connection drops."""
        import psycopg

        quiet = False
        while not self._closed:
            try:
                conn = await within(
                    psycopg.AsyncConnection.connect(
                        self.url, **connection_kwargs(self.timeout_s, statement=False)
                    ),
                    2 * self.timeout_s,
                )
                async with conn:
                    await conn.execute(f"LISTEN {HEALTH_CHANNEL}")
                    quiet = False
                    await self._sync_health()
                    async for notice in conn.notifies():
                        self._apply(notice.payload)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - keep listening; the periodic re-read covers the gap
                if not quiet:  # once per outage, not once a second
                    logger.warning("shared provider cooldowns: listener dropped (%s)", scrub(str(error)))
                quiet = True
                await asyncio.sleep(1.0)

    def _apply(self, payload: str) -> None:
        try:
            data = json.loads(payload)
        except ValueError:
            return
        prefix = self._provider_key("")
        key, until = str(data.get("provider")), data.get("until")
        if not key.startswith(prefix):
            return  # another app's provider
        provider = key[len(prefix) :]
        if until is None:
            self._cooldowns.pop(provider, None)
        else:
            self._cooldowns[provider] = (float(until), data.get("error"))

    # -- memory job claims --------------------------------------------------------------------

    def _job_key(self, key: str) -> str:
        return row_key(self.namespace, "job", key)

    async def claim_job(self, key: str, owner: str, lease_s: float) -> int | None:
        """Take ``key``'s job if nobody runs it (new, or its lease lapsed): its attempt, else ``None``."""
        row = self._job_key(key)

        async def claim(connections: Any) -> int | None:
            async with connections.connection() as conn:
                cursor = await conn.execute(
                    "INSERT INTO fusion_job_claims (job_key, owner, attempt, lease_until) "
                    "VALUES (%s, %s, 1, now() + make_interval(secs => %s)) "
                    "ON CONFLICT (job_key) DO UPDATE SET owner = EXCLUDED.owner, "
                    "attempt = fusion_job_claims.attempt + 1, lease_until = EXCLUDED.lease_until "
                    "WHERE NOT fusion_job_claims.done AND fusion_job_claims.lease_until < now() "
                    "RETURNING attempt",
                    (row, owner, lease_s),
                )
                found = await cursor.fetchone()
            self._cleanup_due()
            return int(found[0]) if found else None

        return await self._run("claiming a memory job", claim)

    async def renew_job(self, key: str, owner: str, lease_s: float) -> bool:
        """Extend ``owner``'s claim on ``key``; ``False`` when it lost it (taken over, or finished)."""
        return await self._owned_update(
            "renewing a memory job claim",
            "lease_until = now() + make_interval(secs => %s)",
            (lease_s,),
            key,
            owner,
        )

    async def finish_job(self, key: str, owner: str) -> bool:
        """Mark ``key`` done by ``owner``; ``False`` when ``owner`` no longer holds it.

        The row is kept ``CLAIM_RETENTION_S`` (a reader that saw the job pending
        still finds it done), then the clean-up deletes it.
        """
        return await self._owned_update(
            "finishing a memory job claim", "done = true, lease_until = now()", (), key, owner
        )

    async def _owned_update(
        self, what: str, assignments: str, values: tuple[Any, ...], key: str, owner: str
    ) -> bool:
        """Apply ``assignments`` to ``key``'s claim if ``owner`` holds it unfinished; whether it did."""
        row = self._job_key(key)
        query = (
            f"UPDATE fusion_job_claims SET {assignments} "  # one of the two fixed assignments above
            "WHERE job_key = %s AND owner = %s AND NOT done RETURNING attempt"
        )

        async def update(connections: Any) -> bool:
            async with connections.connection() as conn:
                cursor = await conn.execute(query, (*values, row, owner))
                return await cursor.fetchone() is not None

        return await self._run(what, update)

    async def job_claims(self, keys: Sequence[str]) -> dict[str, JobClaim]:
        """Claims of ``keys``: owner, attempt, whether it is done and whether its lease is live."""
        if not keys:
            return {}
        rows = {self._job_key(key): key for key in keys}

        async def read(connections: Any) -> dict[str, JobClaim]:
            async with connections.connection() as conn:
                cursor = await conn.execute(
                    "SELECT job_key, owner, attempt, done, lease_until > now() FROM fusion_job_claims "
                    "WHERE job_key = ANY(%s)",
                    (list(rows),),
                )
                found = await cursor.fetchall()
            return {rows[str(k)]: JobClaim(str(o), int(a), bool(d), bool(live)) for k, o, a, d, live in found}

        return await self._run("reading memory job claims", read)

    # -- locks held on a connection of their own ----------------------------------------------

    async def _lock_connection(self, key: int, *, wait: bool) -> Any:
        """A connection holding the session advisory lock ``key`` (``None``: not ``wait`` and it is held)."""
        import psycopg

        conn = await psycopg.AsyncConnection.connect(
            self.url, **connection_kwargs(self.timeout_s, statement=False)
        )
        try:
            if wait:
                await conn.execute("SELECT pg_advisory_lock(%s)", (key,))
                return conn
            cursor = await conn.execute("SELECT pg_try_advisory_lock(%s)", (key,))
            row = await cursor.fetchone()
        except BaseException:
            await conn.close()
            raise
        if not (row and row[0]):
            await conn.close()
            return None
        return conn

    async def _unlock(self, conn: Any) -> None:
        """Close a lock's connection (the session's advisory lock goes with it); never raises."""
        with contextlib.suppress(Exception):
            await self._on_loop(within(conn.close(), self.timeout_s))

    async def _turn_connection(self, key: int, wait_s: float) -> Any:
        """A connection holding the advisory lock ``key``, waited for up to ``wait_s`` (``lock_timeout``).

        Raises:
            SlotBusy: Another process held the lock for ``wait_s``.
        """
        import psycopg

        conn = await psycopg.AsyncConnection.connect(
            self.url, **connection_kwargs(self.timeout_s, statement=False)
        )
        try:
            timeout = f"{max(1, int(wait_s * 1000))}ms"
            await conn.execute("SELECT set_config('lock_timeout', %s, false)", (timeout,))
            await conn.execute("SELECT pg_advisory_lock(%s)", (key,))
        except psycopg.errors.LockNotAvailable:
            await conn.close()
            raise SlotBusy(
                f"a slot stayed busy with another worker's request for {wait_s:g} s; this request was "
                "not sent, since naming a busy slot can corrupt the generation running there"
            ) from None
        except BaseException:
            await conn.close()
            raise
        return conn

    async def take_slot_turn(self, box: str, slot: int, *, wait_s: float) -> Any:
        """Take ``box``'s ``slot`` for one request across the processes on this database; the lock's handle.

        A request names a slot only while it holds the slot's turn
        (``coordination.slot_turns`` says why). Waits up to ``wait_s`` for another
        process's request on the slot. The lock is the box's, not the namespace's:
        two apps sending to one llama-server take turns on its slots too. Give it
        back with ``give_back_slot_turn`` (from any event loop).

        Raises:
            SlotBusy: The slot stayed busy for ``wait_s``.
            SharedStateUnavailable: The database cannot take the lock: the caller
                must not name the slot (another process may be sending to it).
        """
        key = lock_key(f"fusion-slot:{box}:{slot}")
        return await self._run(
            "waiting for a slot's turn",
            lambda _: self._turn_connection(key, wait_s),
            timeout_s=wait_s + self.timeout_s,
        )

    async def give_back_slot_turn(self, held: Any) -> None:
        """Give a slot's turn back (``take_slot_turn``'s handle); never raises."""
        await self._unlock(held)

    @contextlib.asynccontextmanager
    async def slot_turn(self, box: str, slot: int, *, wait_s: float) -> AsyncIterator[None]:
        """Hold ``box``'s ``slot`` for one request (``take_slot_turn``), given back on the way out."""
        held = await self.take_slot_turn(box, slot, wait_s=wait_s)
        try:
            yield
        finally:
            await self.give_back_slot_turn(held)

    @contextlib.asynccontextmanager
    async def thread_run(self, thread: str) -> AsyncIterator[bool]:
        """Hold ``thread``'s run lock while the run lasts; yields ``False`` when another process holds it.

        Raises ``SharedStateUnavailable`` (before yielding) when the database
        cannot take the lock; the lock is dropped quietly if the database goes
        away during the run (the run goes on).
        """
        key = lock_key(f"fusion-thread:{self.namespace}\0{thread}")
        held = await self._run(
            "taking the thread's run lock", lambda _: self._lock_connection(key, wait=False)
        )
        try:
            yield held is not None
        finally:
            if held is not None:
                await self._unlock(held)

    # -- lifecycle ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the connections and stop the loop thread."""
        if self._loop is None:
            self._closed = True
            return
        for pending in list(self._publishing):  # announcements already made still go out
            with contextlib.suppress(BaseException):
                await asyncio.wrap_future(pending)
        with contextlib.suppress(Exception):
            await self._on_loop(self._close())
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _close(self) -> None:
        loop = asyncio.get_running_loop()
        left = [*self._background, *(t for t in _ABANDONED if t.get_loop() is loop)]
        for task in left:  # clean-ups and operations given up on: ended, not left to die with the loop
            task.cancel()
        if left:
            await asyncio.wait(left, timeout=self.timeout_s)
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(BaseException):
                await self._listener
        if self._pool is not None:
            await self._discard(self._pool)
        self._pool = None
