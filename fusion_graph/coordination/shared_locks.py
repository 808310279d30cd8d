"""Session advisory locks in the deployment's Postgres, each on a connection of its own.

``AdvisoryLocks`` holds two kinds: a slot's turn, one request at a time on a
(box, slot) across the workers (``slot_turns`` says why), and a thread's run
lock, so a second concurrent run of one thread is refused. A lock lives as long
as its connection, so Postgres drops a dead process's locks with it. Taking one
goes through the runner's guard (``shared_state.SharedState``); the lock
connections are not pooled, since they are held for a whole request or run.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fusion_graph.coordination.shared_base import Runner, connection_kwargs, lock_key, within
from fusion_graph.errors import SlotBusy


class AdvisoryLocks:
    """Slot turns and thread run locks across the processes on one database."""

    def __init__(self, runner: Runner) -> None:
        """Locks taken through ``runner``'s guarded path (thread locks keyed by its namespace)."""
        self._runner = runner

    async def _lock_connection(self, key: int, *, wait: bool) -> Any:
        """A connection holding the session advisory lock ``key`` (``None``: not ``wait`` and it is held)."""
        import psycopg

        conn = await psycopg.AsyncConnection.connect(
            self._runner.url, **connection_kwargs(self._runner.timeout_s, statement=False)
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
            await self._runner.on_loop(within(conn.close(), self._runner.timeout_s))

    async def _turn_connection(self, key: int, wait_s: float) -> Any:
        """A connection holding the advisory lock ``key``, waited for up to ``wait_s`` (``lock_timeout``).

        Raises:
            SlotBusy: Another process held the lock for ``wait_s``.
        """
        import psycopg

        conn = await psycopg.AsyncConnection.connect(
            self._runner.url, **connection_kwargs(self._runner.timeout_s, statement=False)
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
        return await self._runner.run(
            "waiting for a slot's turn",
            lambda _: self._turn_connection(key, wait_s),
            timeout_s=wait_s + self._runner.timeout_s,
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
        key = lock_key(f"fusion-thread:{self._runner.namespace}\0{thread}")
        held = await self._runner.run(
            "taking the thread's run lock", lambda _: self._lock_connection(key, wait=False)
        )
        try:
            yield held is not None
        finally:
            if held is not None:
                await self._unlock(held)
