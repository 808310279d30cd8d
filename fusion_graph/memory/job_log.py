"""The job log: a memory run is pending before it starts and done after, in the store."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable, Sequence
from typing import Literal, NotRequired, TypedDict, cast

from langgraph.store.base import BaseStore, SearchItem

from fusion_graph.memory.jobs import JobTicket, MemoryJob, TicketFields
from fusion_graph.memory.store import (
    JOBS_NAMESPACE_ROOT,
    jobs_namespace,
    memories_namespace,
    now_iso,
    search_all,
)
from fusion_graph.routing.records import RouteRecord, upgraded

logger = logging.getLogger(__name__)

LEASE_GRACE_S = 5.0
#: Runs of one job (the first and its re-runs after a crash) before it is given up.
MAX_ATTEMPTS = 3


# -- the job log: pending before a job starts, done after ---------------------


class Owner(TypedDict):
    """The process that runs a job: a dead one's pending jobs are picked up without waiting."""

    host: str
    pid: int


class JobEntry(TicketFields):
    """A job log entry (``jobs_namespace``): one memory run of a thread, from pending to folded.

    The ticket's ``run`` (``TicketFields``) and what the run came to.
    """

    jobs: list[str]
    status: Literal["pending", "done", "folded"]
    """pending: written before the run; done: finished, records not yet in route_log; folded: they are."""
    attempts: int
    lease_until: float
    """Epoch seconds: a pending run past its lease is picked up again."""
    owner: Owner
    created_at: str
    finished_at: str | None
    stored: int
    rejected: NotRequired[int]
    """Items the jobs answered and left out (``memory.screen``); why: each record's ``memory.rejected``."""
    records: list[RouteRecord]


_HOST = socket.gethostname()


def this_process() -> Owner:
    """This process as a job owner."""
    return Owner(host=_HOST, pid=os.getpid())


def _owner_gone(owner: Owner) -> bool:
    """Whether the owner is known to be gone: this process without the job, or a dead process here.

    An owner on another host is never judged: its lease decides.
    """
    if owner.get("host") != _HOST:
        return False
    pid = owner.get("pid")
    if pid == os.getpid():
        return True  # this process without the run (the caller checked), or an earlier one with our pid
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # e.g. PermissionError: it exists, under another user
        return False
    return False


def needs_rerun(entry: JobEntry, *, now: float, running_here: bool) -> bool:
    """Whether a job log entry is a pending run nobody is doing: lease over, or its process gone."""
    if entry.get("status") != "pending" or running_here:
        return False
    return float(entry.get("lease_until", 0.0)) <= now or _owner_gone(entry["owner"])


def pending_entry(
    ticket: JobTicket, jobs: Sequence[MemoryJob], *, lease_s: float, created_at: str | None = None
) -> JobEntry:
    """The entry written before a run starts (or restarts)."""
    return JobEntry(
        **ticket.run,
        jobs=[job.name for job in jobs],
        status="pending",
        attempts=ticket.attempt,
        lease_until=time.time() + lease_s,
        owner=this_process(),
        created_at=created_at or now_iso(),
        finished_at=None,
        stored=0,
        rejected=0,
        records=[],
    )


def done_entry(entry: JobEntry, records: Sequence[RouteRecord]) -> JobEntry:
    """``entry`` finished, with the records of every job of the run."""
    finished = JobEntry(**entry)
    finished["status"] = "done"
    finished["finished_at"] = now_iso()
    jobs = [upgraded(record).get("memory", {}) for record in records]
    finished["stored"] = sum(int(job.get("stored") or 0) for job in jobs)
    finished["rejected"] = sum(len(job.get("rejected") or ()) for job in jobs)
    finished["records"] = list(records)
    return finished


def with_status(entry: JobEntry, status: Literal["pending", "done", "folded"]) -> JobEntry:
    """A copy of ``entry`` with another status."""
    changed = JobEntry(**entry)
    changed["status"] = status
    return changed


def ticket_of(entry: JobEntry, ns: tuple[str, ...], *, attempt: int | None = None) -> JobTicket:
    """The ticket of a logged run (``ns``: the memories' namespace), as a re-run takes it up.

    Its ``run`` is the entry's own ``TicketFields`` part (every key ``TicketFields`` declares;
    ``log_id`` only when the entry has one, as an entry logged before runs had one does not).
    """
    fields = {name: entry.get(name) for name in TicketFields.__annotations__ if name != "log_id"}
    if entry.get("log_id"):
        fields["log_id"] = entry.get("log_id")
    run = cast(TicketFields, fields)
    return JobTicket(ns, run, entry.get("attempts", 1) if attempt is None else attempt)


async def write_entry(store: BaseStore, ticket: JobTicket, entry: JobEntry) -> None:
    """Write ``entry`` to the job log (its key is the ticket's)."""
    await store.aput(jobs_namespace(ticket.namespace), ticket.key, dict(entry), index=False)


async def thread_entries(
    store: BaseStore, ns: tuple[str, ...], thread_id: str, statuses: Sequence[str] = ("pending", "done")
) -> list[JobEntry]:
    """The thread's runs in ``statuses`` (by default: not yet folded into ``route_log``), oldest first."""
    found: list[SearchItem] = []
    for status in statuses:
        found += await search_all(store, jobs_namespace(ns), {"thread_id": thread_id, "status": status})
    entries = [cast(JobEntry, item.value) for item in found]
    return sorted(entries, key=lambda e: (e["turn"], e["step"]))


async def pending_everywhere(store: BaseStore) -> list[tuple[tuple[str, ...], JobEntry]]:
    """Every pending run in the store, with its memories' namespace."""
    found = await search_all(store, (JOBS_NAMESPACE_ROOT,), {"status": "pending"}, depth=3)
    return [(memories_namespace(item.namespace), cast(JobEntry, item.value)) for item in found]


def folded_keys(route_log: Iterable[RouteRecord]) -> set[str]:
    """Job log keys whose records are already in ``route_log``."""
    jobs = (upgraded(record).get("memory", {}) for record in route_log if record["kind"] == "memory")
    return {str(job["job_key"]) for job in jobs if job.get("job_key")}
