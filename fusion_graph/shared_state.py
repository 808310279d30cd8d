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
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import Any, TypeVar

from fusion_graph.errors import ProviderConfigError
from fusion_graph.redact import scrub
from fusion_graph.slot_leases import LeaseRow, SlotClaim, choose_slot

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: The channel cooldown changes are announced on.
HEALTH_CHANNEL = "fusion_provider_health"
#: Seconds after which the cooldown table is read again even if no notice came (a dropped listener).
HEALTH_RESYNC_S = 5.0
#: Seconds to wait for the database when connecting.
CONNECT_TIMEOUT_S = 5.0
#: Seconds callers fall back at once after the database could not be reached.
RETRY_AFTER_S = 30.0


class SharedStateUnavailable(RuntimeError):
    """The shared state's database cannot be reached; the message (scrubbed) says why.

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
CREATE INDEX IF NOT EXISTS fusion_slot_leases_holder ON fusion_slot_leases (pool, holder);
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
"""


def lock_key(text: str) -> int:
    """A signed 64-bit advisory lock key for ``text`` (stable across processes)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big", signed=True)


class SharedState:
    """The shared tables of one deployment, reached from an event loop thread of its own."""

    def __init__(self, url: str, *, pool_size: int = 4) -> None:
        """Connect lazily to the Postgres at ``url`` (the tables are made on first use)."""
        self.url = url
        self.pool_size = pool_size
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread_lock = threading.Lock()
        self._pool: Any = None
        self._connect_lock: asyncio.Lock | None = None
        self._down_until = 0.0
        self._down_reason = ""
        #: Provider cooldowns as last read or announced: key -> (wall-clock end, last error).
        self._cooldowns: dict[str, tuple[float, str | None]] = {}
        self._synced_at = 0.0
        self._listener: asyncio.Task[None] | None = None
        self._closed = False

    # -- the loop thread ----------------------------------------------------------------------

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._thread_lock:
            if self._closed:
                raise RuntimeError("the shared state is closed")
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="fusion-shared-state", daemon=True)
                thread.start()
                self._loop = loop
            return self._loop

    async def _on_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on this object's loop and await its result from the caller's loop."""
        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self._ensure_loop())
        return await asyncio.wrap_future(future)

    async def _connected(self) -> Any:
        """The connection pool (on this object's loop), the tables made and the listener started.

        Raises:
            SharedStateUnavailable: The database cannot be reached (again for ``RETRY_AFTER_S``
                after a failure, so callers fall back at once instead of waiting on each request).
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
            try:
                from psycopg_pool import AsyncConnectionPool
            except ImportError:
                raise ProviderConfigError(
                    "shared_state='postgres' needs psycopg: pip install 'fusion-graph[postgres]'"
                ) from None
            pool = AsyncConnectionPool(
                self.url, min_size=1, max_size=self.pool_size, open=False, kwargs={"autocommit": True}
            )
            try:
                await pool.open(wait=True, timeout=CONNECT_TIMEOUT_S)
                async with pool.connection() as conn, conn.transaction():
                    await conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key("fusion-schema"),))
                    await conn.execute(SCHEMA)
            except Exception as error:  # noqa: BLE001 - reported scrubbed; callers fall back
                with contextlib.suppress(Exception):
                    await pool.close()
                self._down_until = time.monotonic() + RETRY_AFTER_S
                self._down_reason = scrub(f"the shared state's Postgres cannot be reached: {error}")
                raise SharedStateUnavailable(self._down_reason) from None
            self._pool = pool
            await self._sync_health()
            self._listener = asyncio.get_running_loop().create_task(self._listen())
            return pool

    # -- slot leases --------------------------------------------------------------------------

    async def claim_slot(
        self, pool: str, boxes: Sequence[str], slots: int, holder: str, lease_s: float, preferred: int
    ) -> SlotClaim:
        """Claim (or renew) ``holder``'s slot in ``pool`` atomically; see ``choose_slot``."""
        return await self._on_loop(self._claim_slot(pool, tuple(boxes), slots, holder, lease_s, preferred))

    async def _claim_slot(
        self, pool: str, boxes: tuple[str, ...], slots: int, holder: str, lease_s: float, preferred: int
    ) -> SlotClaim:
        connections = await self._connected()
        async with connections.connection() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_key(f"fusion-slots:{pool}"),))
            cursor = await conn.execute(
                "SELECT box, slot, holder, expires_at > now(), extract(epoch FROM used_at) "
                "FROM fusion_slot_leases WHERE pool = %s",
                (pool,),
            )
            rows = [
                LeaseRow(b, s, h, bool(live), float(used)) for b, s, h, live, used in await cursor.fetchall()
            ]
            rows = [row for row in rows if row.box in boxes and row.slot < slots]
            claim = choose_slot(rows, boxes, slots, holder, preferred % slots)
            if claim.guest:
                return claim
            await conn.execute(
                "INSERT INTO fusion_slot_leases (pool, box, slot, holder, expires_at, used_at) "
                "VALUES (%s, %s, %s, %s, now() + make_interval(secs => %s), now()) "
                "ON CONFLICT (pool, box, slot) DO UPDATE SET holder = EXCLUDED.holder, "
                "expires_at = EXCLUDED.expires_at, used_at = EXCLUDED.used_at",
                (pool, claim.box, claim.slot, holder, lease_s),
            )
            # A thread holds one slot of a pool: its older rows (a lapsed lease elsewhere) go.
            await conn.execute(
                "DELETE FROM fusion_slot_leases "
                "WHERE pool = %s AND holder = %s AND NOT (box = %s AND slot = %s)",
                (pool, holder, claim.box, claim.slot),
            )
        return SlotClaim(claim.box, claim.slot, expires_in_s=lease_s)

    async def box_of(self, pool: str, holder: str) -> str | None:
        """The box ``holder`` holds a live slot on (``None``: none)."""
        return await self._on_loop(self._box_of(pool, holder))

    async def _box_of(self, pool: str, holder: str) -> str | None:
        connections = await self._connected()
        async with connections.connection() as conn:
            cursor = await conn.execute(
                "SELECT box FROM fusion_slot_leases WHERE pool = %s AND holder = %s AND expires_at > now()",
                (pool, holder),
            )
            row = await cursor.fetchone()
        return str(row[0]) if row else None

    async def slot_table(self, pool: str) -> list[tuple[str, int, str, bool]]:
        """Every lease of ``pool``: box, slot, holder and whether it is live (for checks and tests)."""
        return await self._on_loop(self._slot_table(pool))

    async def _slot_table(self, pool: str) -> list[tuple[str, int, str, bool]]:
        connections = await self._connected()
        async with connections.connection() as conn:
            cursor = await conn.execute(
                "SELECT box, slot, holder, expires_at > now() FROM fusion_slot_leases WHERE pool = %s "
                "ORDER BY box, slot",
                (pool,),
            )
            return [(str(b), int(s), str(h), bool(live)) for b, s, h, live in await cursor.fetchall()]

    # -- provider cooldowns -------------------------------------------------------------------

    def cooldown(self, provider: str) -> tuple[float, str | None] | None:
        """The cooldown every worker knows for ``provider`` (wall-clock end, error), if any now.

        Read from this process's copy (updated by announcements); asks for a
        re-read in the background when the copy is older than ``HEALTH_RESYNC_S``.
        """
        if self._pool is not None and time.monotonic() - self._synced_at > HEALTH_RESYNC_S:
            self._synced_at = time.monotonic()
            asyncio.run_coroutine_threadsafe(self._sync_health(), self._ensure_loop())
        known = self._cooldowns.get(provider)
        if known is None or known[0] <= time.time():
            return None
        return known

    async def publish_cooldown(self, provider: str, until: float | None, error: str | None) -> None:
        """Tell every worker ``provider`` cools down until ``until`` (wall clock; ``None``: it recovered)."""
        if until is None:
            self._cooldowns.pop(provider, None)
        else:
            self._cooldowns[provider] = (until, error)
        await self._on_loop(self._publish(provider, until, error))

    async def _publish(self, provider: str, until: float | None, error: str | None) -> None:
        connections = await self._connected()
        message = scrub(error)[:500] if error else None
        async with connections.connection() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO fusion_provider_health (provider, cooldown_until, last_error, updated_at) "
                "VALUES (%s, %s, %s, now()) ON CONFLICT (provider) DO UPDATE SET "
                "cooldown_until = EXCLUDED.cooldown_until, last_error = EXCLUDED.last_error, "
                "updated_at = now()",
                (provider, until, message),
            )
            payload = json.dumps({"provider": provider, "until": until, "error": message})
            await conn.execute("SELECT pg_notify(%s, %s)", (HEALTH_CHANNEL, payload))

    async def _sync_health(self) -> None:
        if self._pool is None:
            return
        try:
            async with self._pool.connection() as conn:
                cursor = await conn.execute(
                    "SELECT provider, cooldown_until, last_error FROM fusion_provider_health "
                    "WHERE cooldown_until IS NOT NULL AND cooldown_until > extract(epoch FROM now())"
                )
                rows = await cursor.fetchall()
        except Exception as error:  # noqa: BLE001 - the next read tries again
            logger.warning("reading the shared provider cooldowns failed: %s", scrub(str(error)))
            return
        self._cooldowns = {str(p): (float(u), e) for p, u, e in rows}
        self._synced_at = time.monotonic()

    async def _listen(self) -> None:
        """Apply cooldown announcements as they come; reconnect when the connection drops."""
        import psycopg

        while not self._closed:
            try:
                conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
                async with conn:
                    await conn.execute(f"LISTEN {HEALTH_CHANNEL}")
                    await self._sync_health()
                    async for notice in conn.notifies():
                        self._apply(notice.payload)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - keep listening; the periodic re-read covers the gap
                logger.warning("shared provider cooldowns: listener dropped (%s)", scrub(str(error)))
                await asyncio.sleep(1.0)

    def _apply(self, payload: str) -> None:
        try:
            data = json.loads(payload)
        except ValueError:
            return
        provider, until = str(data.get("provider")), data.get("until")
        if until is None:
            self._cooldowns.pop(provider, None)
        else:
            self._cooldowns[provider] = (float(until), data.get("error"))

    # -- memory job claims --------------------------------------------------------------------

    async def claim_job(self, key: str, owner: str, lease_s: float) -> int | None:
        """Take ``key``'s job if nobody runs it (new, or its lease lapsed): its attempt, else ``None``."""
        return await self._on_loop(self._claim_job(key, owner, lease_s))

    async def _claim_job(self, key: str, owner: str, lease_s: float) -> int | None:
        connections = await self._connected()
        async with connections.connection() as conn:
            cursor = await conn.execute(
                "INSERT INTO fusion_job_claims (job_key, owner, attempt, lease_until) "
                "VALUES (%s, %s, 1, now() + make_interval(secs => %s)) "
                "ON CONFLICT (job_key) DO UPDATE SET owner = EXCLUDED.owner, "
                "attempt = fusion_job_claims.attempt + 1, lease_until = EXCLUDED.lease_until "
                "WHERE NOT fusion_job_claims.done AND fusion_job_claims.lease_until < now() "
                "RETURNING attempt",
                (key, owner, lease_s),
            )
            row = await cursor.fetchone()
        return int(row[0]) if row else None

    async def renew_job(self, key: str, owner: str, lease_s: float) -> bool:
        """Extend ``owner``'s claim on ``key``; ``False`` when it lost it (taken over, or finished)."""
        return await self._on_loop(self._renew_job(key, owner, lease_s))

    async def _renew_job(self, key: str, owner: str, lease_s: float) -> bool:
        connections = await self._connected()
        async with connections.connection() as conn:
            cursor = await conn.execute(
                "UPDATE fusion_job_claims SET lease_until = now() + make_interval(secs => %s) "
                "WHERE job_key = %s AND owner = %s AND NOT done RETURNING attempt",
                (lease_s, key, owner),
            )
            return await cursor.fetchone() is not None

    async def finish_job(self, key: str, owner: str) -> bool:
        """Mark ``key`` done by ``owner``; ``False`` when ``owner`` no longer holds it."""
        return await self._on_loop(self._finish_job(key, owner))

    async def _finish_job(self, key: str, owner: str) -> bool:
        connections = await self._connected()
        async with connections.connection() as conn:
            cursor = await conn.execute(
                "UPDATE fusion_job_claims SET done = true WHERE job_key = %s AND owner = %s AND NOT done "
                "RETURNING attempt",
                (key, owner),
            )
            return await cursor.fetchone() is not None

    async def job_claims(self, keys: Sequence[str]) -> dict[str, tuple[str, int, bool, bool]]:
        """Claims of ``keys``: owner, attempt, whether it is done and whether its lease is live."""
        return await self._on_loop(self._job_claims(tuple(keys)))

    async def _job_claims(self, keys: tuple[str, ...]) -> dict[str, tuple[str, int, bool, bool]]:
        if not keys:
            return {}
        connections = await self._connected()
        async with connections.connection() as conn:
            cursor = await conn.execute(
                "SELECT job_key, owner, attempt, done, lease_until > now() FROM fusion_job_claims "
                "WHERE job_key = ANY(%s)",
                (list(keys),),
            )
            rows = await cursor.fetchall()
        return {str(k): (str(o), int(a), bool(d), bool(live)) for k, o, a, d, live in rows}

    # -- one request at a time on a shared slot -----------------------------------------------

    @contextlib.asynccontextmanager
    async def slot_turn(self, pool: str, box: str, slot: int) -> AsyncIterator[None]:
        """Hold ``box``'s ``slot`` for one request (waiting for another process's request on it).

        llama-server defers a request whose ``id_slot`` names a slot that is still
        busy, and with its host prompt cache on (``--cache-ram``) a deferred request
        can leave that slot processing forever; the reflection slot is the one slot
        several processes send to at once, so its requests take turns.
        """
        held = await self._on_loop(self._lock_slot(pool, box, slot))
        try:
            yield
        finally:
            await self._on_loop(self._unlock_thread(held))

    async def _lock_slot(self, pool: str, box: str, slot: int) -> Any:
        import psycopg

        await self._connected()
        conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
        try:
            await conn.execute("SELECT pg_advisory_lock(%s)", (lock_key(f"fusion-slot:{pool}:{box}:{slot}"),))
        except BaseException:
            await conn.close()
            raise
        return conn

    # -- thread runs --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def thread_run(self, thread: str) -> AsyncIterator[bool]:
        """Hold ``thread``'s run lock while the run lasts; yields ``False`` when another process holds it."""
        held = await self._on_loop(self._lock_thread(thread))
        try:
            yield held is not None
        finally:
            if held is not None:
                await self._on_loop(self._unlock_thread(held))

    async def _lock_thread(self, thread: str) -> Any:
        import psycopg

        await self._connected()
        conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
        cursor = await conn.execute("SELECT pg_try_advisory_lock(%s)", (lock_key(f"fusion-thread:{thread}"),))
        row = await cursor.fetchone()
        if not (row and row[0]):
            await conn.close()
            return None
        return conn

    async def _unlock_thread(self, conn: Any) -> None:
        await conn.close()  # the session's advisory lock goes with it

    # -- lifecycle ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the connections and stop the loop thread."""
        if self._loop is None:
            self._closed = True
            return
        await self._on_loop(self._close())
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(BaseException):
                await self._listener
        if self._pool is not None:
            await self._pool.close()
        self._pool = None
