"""Memory job claims in the deployment's Postgres: a pending memory job runs on one worker at a time.

``JobClaims`` takes a job whose lease lapsed (a dead worker's), renews it by
heartbeat and marks it done once; every statement goes through the runner's
guard (``shared_state.SharedState``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from fusion_graph.coordination.shared_base import Runner, row_key

#: Finished job claims (and claims nobody renewed) are deleted this long after their lease ended.
CLAIM_RETENTION_S = 3600.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS fusion_job_claims (
    job_key text PRIMARY KEY,
    owner text NOT NULL,
    attempt integer NOT NULL,
    lease_until timestamptz NOT NULL,
    done boolean NOT NULL DEFAULT false
);
CREATE INDEX IF NOT EXISTS fusion_job_claims_lease ON fusion_job_claims (lease_until);
"""
TABLES = ("fusion_job_claims",)


async def delete_old(conn: Any) -> int:
    """Delete claims whose lease ended ``CLAIM_RETENTION_S`` ago (finished or abandoned): how many."""
    claims = await conn.execute(
        "DELETE FROM fusion_job_claims WHERE lease_until < now() - make_interval(secs => %s)",
        (CLAIM_RETENTION_S,),
    )
    return int(claims.rowcount)


class JobClaim(NamedTuple):
    """One row of the memory job claims table (``job_claims``), by name rather than position."""

    owner: str
    attempt: int
    done: bool
    live: bool
    """Whether its lease has not lapsed."""


class JobClaims:
    """Who runs each memory job across the workers, by lease."""

    def __init__(self, runner: Runner) -> None:
        """Claims reached through ``runner``'s guarded path, keyed by its namespace."""
        self._runner = runner

    def _job_key(self, key: str) -> str:
        return row_key(self._runner.namespace, "job", key)

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
            self._runner.cleanup_due()
            return int(found[0]) if found else None

        return await self._runner.run("claiming a memory job", claim)

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

        return await self._runner.run(what, update)

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

        return await self._runner.run("reading memory job claims", read)
