"""Provider cooldowns in the deployment's Postgres: one worker's cooldown is every worker's.

``ProviderHealth`` keeps this process's copy of ``fusion_provider_health``,
pushed with ``NOTIFY`` on a listening connection of its own and read again every
``HEALTH_RESYNC_S`` in case a notice was missed; reading it never waits on the
database (a chain asks before each request). Writes go through the runner's
guard (``shared_state.SharedState``), which starts the listener once connected.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import time
from typing import Any

from fusion_graph.coordination.shared_base import Runner, SharedStateUnavailable, connection_kwargs, within
from fusion_graph.redact import scrub

logger = logging.getLogger(__name__)

#: The channel cooldown changes are announced on.
HEALTH_CHANNEL = "fusion_provider_health"
#: Seconds after which the cooldown table is read again even if no notice came (a dropped listener).
HEALTH_RESYNC_S = 5.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS fusion_provider_health (
    provider text PRIMARY KEY,
    cooldown_until double precision,
    last_error text,
    updated_at timestamptz NOT NULL DEFAULT now()
);
"""
TABLES = ("fusion_provider_health",)


class ProviderHealth:
    """The cooldowns every worker knows (a chain's ``HealthBoard``), kept in step with the table."""

    def __init__(self, runner: Runner) -> None:
        """Cooldowns reached through ``runner``'s guarded path, keyed by its namespace."""
        self._runner = runner
        self._publish_lock: asyncio.Lock | None = None
        self._publishing: set[concurrent.futures.Future[None]] = set()
        #: Provider cooldowns as last read or announced: key -> (wall-clock end, last error).
        self._cooldowns: dict[str, tuple[float, str | None]] = {}
        self._synced_at = 0.0
        self._listener: asyncio.Task[None] | None = None

    def _provider_key(self, provider: str) -> str:
        return f"{self._runner.namespace}|{provider}"

    def cooldown(self, provider: str) -> tuple[float, str | None] | None:
        """The cooldown every worker knows for ``provider`` (wall-clock end, error), if any now.

        Read from this process's copy (updated by announcements); asks for a
        re-read in the background when the copy is older than ``HEALTH_RESYNC_S``.
        """
        if self._runner.connected and time.monotonic() - self._synced_at > HEALTH_RESYNC_S:
            self._synced_at = time.monotonic()
            with contextlib.suppress(SharedStateUnavailable):
                asyncio.run_coroutine_threadsafe(self.sync(), self._runner.ensure_loop())
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
            loop = self._runner.ensure_loop()
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
            await self._runner.guarded("announcing a cooldown", write, self._runner.timeout_s)

    async def flush(self) -> None:
        """Wait for the announcements already made to go out (from any loop; the runner's ``aclose``)."""
        for pending in list(self._publishing):
            with contextlib.suppress(BaseException):
                await asyncio.wrap_future(pending)

    async def sync(self) -> None:
        """Read the table into this process's copy (on the runner's loop); a failure waits for the next."""
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
            rows = await self._runner.guarded("reading provider cooldowns", read, self._runner.timeout_s)
        except SharedStateUnavailable as error:  # the next read tries again
            logger.debug("reading the shared provider cooldowns failed: %s", error)
            return
        self._cooldowns = {str(p)[len(prefix) :]: (float(u), e) for p, u, e in rows}
        self._synced_at = time.monotonic()

    def start_listening(self) -> None:
        """Start the listener on the runner's loop unless it runs (the runner, once connected)."""
        if self._listener is None or self._listener.done():
            self._listener = asyncio.get_running_loop().create_task(self._listen())

    async def stop_listening(self) -> None:
        """End the listener (on the runner's loop, as it closes)."""
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(BaseException):
                await self._listener

    async def _listen(self) -> None:
        """Apply cooldown announcements as they come; reconnect when the connection drops."""
        import psycopg

        runner = self._runner
        quiet = False
        while not runner.closed:
            try:
                conn = await within(
                    psycopg.AsyncConnection.connect(
                        runner.url, **connection_kwargs(runner.timeout_s, statement=False)
                    ),
                    2 * runner.timeout_s,
                )
                async with conn:
                    await conn.execute(f"LISTEN {HEALTH_CHANNEL}")
                    quiet = False
                    await self.sync()
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
