"""Slot leases in the deployment's Postgres: which (box, slot) each thread holds, and its home box.

``SlotLeases`` runs the pure rule (``slot_leases.choose_slot``) on the
``fusion_slot_leases`` rows of a pool under a transaction lock, so no two live
threads hold one slot across the workers; every statement goes through the
runner's guard (``shared_state.SharedState``).
"""

from __future__ import annotations

from typing import Any

from fusion_graph.coordination.shared_base import Runner, lock_key
from fusion_graph.coordination.slot_leases import LeaseAsk, LeaseRow, SlotClaim, choose_slot

#: Slot leases idle this long are deleted (a box or pool that is gone), and so are threads' home boxes.
LEASE_RETENTION_S = 86_400.0

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
"""
TABLES = ("fusion_slot_leases", "fusion_slot_homes")


async def delete_old(conn: Any) -> int:
    """Delete leases idle for ``LEASE_RETENTION_S`` and homes unseen as long: how many leases went."""
    leases = await conn.execute(
        "DELETE FROM fusion_slot_leases WHERE used_at < now() - make_interval(secs => %s) "
        "AND expires_at < now()",
        (LEASE_RETENTION_S,),
    )
    await conn.execute(
        "DELETE FROM fusion_slot_homes WHERE seen_at < now() - make_interval(secs => %s)",
        (LEASE_RETENTION_S,),
    )
    return int(leases.rowcount)


class SlotLeases:
    """The deployment's lease table: the same three calls as ``LocalLeases``, so one rule places."""

    def __init__(self, runner: Runner) -> None:
        """Leases reached through ``runner``'s guarded path, keyed by its namespace."""
        self._runner = runner

    def _pool_key(self, pool: str) -> str:
        return f"{self._runner.namespace}|{pool}"

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
            self._runner.cleanup_due()
            return SlotClaim(claim.box, claim.slot, expires_in_s=lease_s, took_from=claim.took_from)

        return await self._runner.run("claiming a slot", claim)

    async def release_slot(self, pool: str, holder: str) -> None:
        """Mark ``holder``'s lease idle (its run ended): a thread that needs a slot now may take it."""
        key = self._pool_key(pool)

        async def idle(connections: Any) -> None:
            async with connections.connection() as conn:
                await conn.execute(
                    "UPDATE fusion_slot_leases SET idle = true WHERE pool = %s AND holder = %s", (key, holder)
                )

        await self._runner.run("releasing a slot", idle)

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

        return await self._runner.run("finding a thread's box", find)

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

        return await self._runner.run("reading the slot table", table)
