"""Runs of the memory jobs: inline, detached and logged, caught up at a thread's next turn.

A ``MemoryRuns`` belongs to one compiled graph (``build_graph`` keeps it on the
graph as ``graph.memory_runs``): the ``memory`` node and the plan step call it,
and so do ``sweep``/``drain(graph=...)`` for pending runs no live process does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, Protocol

from langchain_core.messages import BaseMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.store.base import BaseStore

from fusion_graph.context import FusionContext, ensure_context
from fusion_graph.coordination.shared_base import SharedStateUnavailable
from fusion_graph.coordination.shared_state import SharedState
from fusion_graph.errors import UsageError
from fusion_graph.memory import background
from fusion_graph.memory.job_call import JobRunner, dropped_record, run_job
from fusion_graph.memory.job_log import (
    LEASE_GRACE_S,
    MAX_ATTEMPTS,
    JobEntry,
    done_entry,
    folded_keys,
    needs_rerun,
    pending_entry,
    pending_everywhere,
    this_process,
    thread_entries,
    ticket_of,
    with_status,
    write_entry,
)
from fusion_graph.memory.jobs import DEFAULT_JOBS, JobTicket, MemoryJob
from fusion_graph.memory.screen import screen_items, stored_texts
from fusion_graph.memory.store import store_items
from fusion_graph.providers.resolver import ProviderResolver
from fusion_graph.redact import scrub
from fusion_graph.routing.records import Rejected, RouteRecord, upgraded
from fusion_graph.telemetry import switch as telemetry

logger = logging.getLogger(__name__)


class JobOwner(NamedTuple):
    """Who runs one memory job run, and whether the shared claims table has granted it yet.

    ``claimed`` is ``False`` when the database could not be asked: the run then
    claims the job before it starts (``MemoryRuns.run_logged``), so a job is
    never run by two workers, and stays pending while nobody can claim it.
    """

    name: str
    claimed: bool = True


#: Seconds between two attempts to claim a job while the shared state's database does not answer.
CLAIM_RETRY_S = 1.0


def job_owner() -> str:
    """A name for one run of a job in this process (host, pid, a random part)."""
    me = this_process()  # the host is looked up once, as the job log names owners
    return f"{me['host']}:{me['pid']}:{uuid.uuid4().hex[:8]}"


async def _keep_claim(shared: SharedState, key: str, owner: str, lease_s: float) -> None:
    """Renew ``owner``'s claim on ``key`` every third of ``lease_s`` until cancelled or lost."""
    while True:
        await asyncio.sleep(lease_s / 3)
        try:
            if not await shared.jobs.renew_job(key, owner, lease_s):
                return
        except SharedStateUnavailable:
            continue


class MemoryGraph(Protocol):
    """What ``sweep`` needs of a compiled graph: its store, its checkpointer and its threads' state."""

    store: BaseStore | None
    checkpointer: BaseCheckpointSaver[Any] | bool | None
    memory_runs: MemoryRuns

    async def aget_state(self, config: RunnableConfig, *, subgraphs: bool = False) -> Any:
        """The state snapshot of a thread."""
        ...


class MemoryRuns:
    """The memory jobs of one graph: run them, log them, catch them up, sweep them."""

    def __init__(
        self,
        *,
        resolver: ProviderResolver,
        jobs: Sequence[MemoryJob] = DEFAULT_JOBS,
        tools: Sequence[BaseTool] = (),
    ) -> None:
        """Keep the providers, the jobs and the steps' tools (a job's prompt binds them too)."""
        self.resolver = resolver
        self.memory_jobs = tuple(jobs)
        self.tools = list(tools)
        telemetry.watch_pending_memory(background.runs_in_flight)

    @property
    def timeout_s(self) -> float:
        """Seconds one run of the jobs may take (``memory_timeout_s``)."""
        return self.resolver.settings.memory_timeout_s

    @property
    def claim_lease_s(self) -> float:
        """Seconds a shared claim lasts without a heartbeat (``memory_claim_lease_s``)."""
        return self.resolver.settings.memory_claim_lease_s

    @property
    def lease_s(self) -> float:
        """How long a pending run is left to its process: a wait for the step beside it, the run, grace."""
        return 2 * self.timeout_s + LEASE_GRACE_S

    async def catch_up(
        self,
        store: BaseStore,
        ns: tuple[str, ...],
        thread_id: str,
        route_log: Sequence[RouteRecord],
        messages: Sequence[BaseMessage],
        context: FusionContext,
    ) -> list[RouteRecord]:
        """At a new turn: the records of finished runs to fold, and pending runs nobody does started again."""
        try:
            entries = await thread_entries(store, ns, thread_id)
        except Exception:
            logger.exception("reading the memory job log failed")
            return []
        records = await self.fold(entries, route_log, store, ns)
        if context.sub_runners == "off" or not self.memory_jobs:
            return records
        for _, entry in await self._to_rerun([(ns, entry) for entry in entries]):
            key = ticket_of(entry, ns).key
            try:
                await self._rerun(entry, ns, messages, context, store)
            except Exception:  # never fail the turn over memory; the next turn tries again
                logger.exception("running memory job %s again failed", key)
        return records

    async def _to_rerun(
        self, entries: Sequence[tuple[tuple[str, ...], JobEntry]]
    ) -> list[tuple[tuple[str, ...], JobEntry]]:
        """The pending runs nobody is doing, as ``(ns, entry)``: lease lapsed, or process gone.

        With shared state, the claims table decides (a claim that lapsed or was
        never made); this process's own view otherwise (and when it cannot be read).
        """
        now = time.time()
        pending = [
            (ns, entry)
            for ns, entry in entries
            if entry.get("status") == "pending"
            and not background.running_here(ticket_of(entry, ns).claim_key)
        ]
        shared = self.resolver.shared
        if shared is not None and pending:
            try:
                claims = await shared.jobs.job_claims(
                    [ticket_of(entry, ns).claim_key for ns, entry in pending]
                )
            except SharedStateUnavailable as error:
                logger.warning("memory jobs: deciding in this process only: %s", error)
            else:
                stale = []
                for ns, entry in pending:
                    claim = claims.get(ticket_of(entry, ns).claim_key)
                    if claim is None or not (claim.done or claim.live):
                        stale.append((ns, entry))
                return stale
        return [(ns, entry) for ns, entry in pending if needs_rerun(entry, now=now, running_here=False)]

    async def fold(
        self,
        entries: Sequence[JobEntry],
        route_log: Sequence[RouteRecord],
        store: BaseStore,
        ns: tuple[str, ...],
    ) -> list[RouteRecord]:
        """Records of finished runs not yet in ``route_log``; runs already folded are marked so."""
        folded = folded_keys(route_log)
        records: list[RouteRecord] = []
        for entry in entries:
            if entry["status"] != "done":
                continue
            ticket = ticket_of(entry, ns)
            if ticket.key not in folded:
                records.extend(upgraded(record) for record in entry["records"])
                continue
            try:  # its records are in the checkpoint now: keep the log's working set small
                await write_entry(store, ticket, with_status(entry, "folded"))
            except Exception:
                logger.exception("marking memory job %s folded failed", ticket.key)
        return records

    async def _rerun(
        self,
        entry: JobEntry,
        ns: tuple[str, ...],
        messages: Sequence[BaseMessage],
        context: FusionContext,
        store: BaseStore,
    ) -> asyncio.Task[Any] | None:
        """Claim a pending run nobody is doing and start it again (detached); ``None`` if given up."""
        owner: JobOwner | None = None
        attempt = entry.get("attempts", 1) + 1
        shared = self.resolver.shared
        claimed = await self._claim(ticket_of(entry, ns).claim_key)
        if claimed is not None:
            owner, won = claimed
            if won is None:
                return None  # another worker took it first
            attempt = max(attempt, won)
        ticket = ticket_of(entry, ns, attempt=attempt)
        if ticket.attempt > MAX_ATTEMPTS:
            why = f"given up after {MAX_ATTEMPTS} runs that never finished"
            dropped = [self.dropped(job, ticket, why) for job in self.memory_jobs]
            await write_entry(store, ticket, done_entry(entry, dropped))
            if shared is not None and owner is not None and owner.claimed:
                with contextlib.suppress(SharedStateUnavailable):
                    await shared.jobs.finish_job(ticket.claim_key, owner.name)
            return None
        again = pending_entry(
            ticket, self.memory_jobs, lease_s=self.lease_s, created_at=entry.get("created_at")
        )
        await write_entry(store, ticket, again)
        logger.info("memory job %s: running again (attempt %d)", ticket.key, ticket.attempt)
        covered = _covered(messages, ticket)
        run = self.run_logged(ticket, again, covered, context, store, owner=owner)
        return background.detach(run, key=ticket.claim_key)

    async def claim(self, ticket: JobTicket) -> JobOwner | None:
        """Claim a new run in the shared claims table; its owner, or ``None`` without shared state.

        When the database cannot be asked, the owner is not ``claimed`` yet:
        ``run_logged`` claims it before the run starts.
        """
        claimed = await self._claim(ticket.claim_key)
        return None if claimed is None else claimed[0]

    async def _claim(self, key: str) -> tuple[JobOwner, int | None] | None:
        """Claim ``key`` for a fresh owner: ``(owner, attempt won)``; ``None`` without shared state.

        The attempt is ``None`` when another owner holds the claim. When the
        database cannot be asked, the owner comes back unclaimed (attempt 0).
        ``claim`` and ``_rerun`` share this.
        """
        shared = self.resolver.shared
        if shared is None:
            return None
        name = job_owner()
        try:
            won = await shared.jobs.claim_job(key, name, self.claim_lease_s)
        except SharedStateUnavailable as error:
            logger.warning("memory job %s: claiming it when the shared state answers: %s", key, error)
            return JobOwner(name, claimed=False), 0
        return JobOwner(name), won

    async def _claim_late(self, key: str, owner: JobOwner) -> JobOwner | None:
        """The claim ``owner`` could not make at the start, made now; ``None``: another worker has the job.

        Tried every ``CLAIM_RETRY_S`` for as long as a pending run is left to this
        process (``lease_s``); a database that never answered in that time cannot
        have given the job to anyone else, so the run then goes ahead unclaimed.
        """
        shared = self.resolver.shared
        if shared is None or owner.claimed:
            return owner
        deadline = time.monotonic() + self.lease_s
        while True:
            try:
                won = await shared.jobs.claim_job(key, owner.name, self.claim_lease_s)
            except SharedStateUnavailable:
                if time.monotonic() >= deadline:
                    logger.warning(
                        "memory job %s: running it unclaimed, the shared state never answered", key
                    )
                    return owner
                await asyncio.sleep(CLAIM_RETRY_S)
                continue
            return JobOwner(owner.name) if won is not None else None

    async def run_logged(
        self,
        ticket: JobTicket,
        entry: JobEntry,
        messages: Sequence[BaseMessage],
        context: FusionContext,
        store: BaseStore,
        *,
        owner: JobOwner | None = None,
        over_budget: str | None = None,
    ) -> list[RouteRecord]:
        """A detached run: after the thread's step in flight, run the jobs, then log them as done.

        If the process dies first the entry stays pending, and the run is picked up
        again. With a shared claim (``owner``), a heartbeat keeps the claim while the
        run lives; a run whose claim lapsed (its loop froze, its worker stalled) and
        was taken over writes nothing, so no job is written twice. An owner whose
        claim could not be made yet claims it first (``_claim_late``); the job
        stays pending meanwhile, and is left alone if another worker has it.
        """
        if owner is not None and not owner.claimed:
            late = await self._claim_late(ticket.claim_key, owner)
            if late is None:
                logger.info("memory job %s is another worker's: not run here", ticket.key)
                return []
            owner = late
        await background.steps_settled(ticket.run["thread_id"], timeout=self.timeout_s)
        shared = self.resolver.shared if owner is not None and owner.claimed else None
        name = owner.name if owner is not None else ""
        heartbeat = None
        if shared is not None:
            heartbeat = asyncio.ensure_future(_keep_claim(shared, ticket.claim_key, name, self.claim_lease_s))

        async def still_ours() -> bool:
            if shared is None:
                return True
            try:
                return await shared.jobs.renew_job(ticket.claim_key, name, self.claim_lease_s)
            except SharedStateUnavailable:
                return True  # nobody else can claim it through an unreachable database either

        try:
            records = await self.run(
                ticket, messages, context, store, config=None, still_ours=still_ours, over_budget=over_budget
            )
            if not await still_ours():
                logger.warning(
                    "memory job %s was taken over by another worker; its run here is dropped", ticket.key
                )
                return records
            try:
                await write_entry(store, ticket, done_entry(entry, records))
            except Exception:
                logger.exception("logging memory job %s as done failed; it will run again", ticket.key)
                return records
            if shared is not None:
                with contextlib.suppress(SharedStateUnavailable):
                    await shared.jobs.finish_job(ticket.claim_key, name)
            return records
        finally:
            if heartbeat is not None:
                heartbeat.cancel()

    async def run(
        self,
        ticket: JobTicket,
        messages: Sequence[BaseMessage],
        context: FusionContext,
        store: BaseStore,
        *,
        config: RunnableConfig | None,
        still_ours: Callable[[], Awaitable[bool]] | None = None,
        over_budget: str | None = None,
    ) -> list[RouteRecord]:
        """Every job of one run (each bounded by ``memory_timeout_s``); their records, never raises.

        ``still_ours`` is asked before a job writes to the store (a shared claim's owner check).
        ``over_budget``: why the cloud budget moved this run off cloud (the ticket's leg is then
        ``local``); no attempt of it may fall over to a cloud link.
        """
        chain = await self.resolver.chain(context)

        runner = JobRunner(
            chain=chain,
            leg=ticket.run["leg"],
            system_prompt=context.system_prompt,
            tools=self.tools,
            # The reflection slot, with the thread's routing key: behind a gateway the job runs on
            # the thread's box, near its cache.
            placer=self.resolver.placement,
            thread_id=ticket.run["thread_id"],
            max_tokens=context.memory_max_tokens,
            timeout_s=self.resolver.settings.request_timeout,
            config=config,
            over_budget=over_budget,
        )
        mode = context.memory_mode

        async def one(job: MemoryJob) -> list[RouteRecord]:
            try:
                result, records, dropped = await asyncio.wait_for(
                    run_job(job, messages, runner, turn=ticket.run["turn"], step=ticket.run["step"]),
                    timeout=self.timeout_s,
                )
            except TimeoutError:
                result, records, dropped = None, [], f"timed out after {self.timeout_s} s"
            except asyncio.CancelledError:
                # Stopped before it finished (the command exits, the run is cancelled): not dropped,
                # its job log entry stays pending and the thread's next turn runs it.
                telemetry.job_left_pending()
                raise
            stored: list[dict[str, Any]] = []
            rejected: list[Rejected] = []
            if result is not None and still_ours is not None and not await still_ours():
                result, dropped = None, "taken over by another worker: not written here"
            if result is not None:
                try:
                    kept, rejected = screen_items(
                        job.items(result),
                        sources=_echo_sources(job, runner.system_prompt),
                        stored=await stored_texts(store, job, ticket),
                    )
                    if rejected:
                        logger.warning(
                            "memory job %s (%s) left out %d of its items: %s",
                            job.name,
                            ticket.key,
                            len(rejected),
                            scrub("; ".join(f"{r['text']!r}: {r['why']}" for r in rejected)),
                        )
                    stored = await store_items(store, job, kept, ticket=ticket)
                except Exception as error:  # noqa: BLE001 - never fail the turn over memory
                    dropped = scrub(f"store write failed: {type(error).__name__}: {error}")
            if not records or (dropped is not None and not records[-1].get("memory", {}).get("dropped")):
                records.append(self.dropped(job, ticket, dropped or "no answer"))
            for record in records:
                record.setdefault("memory", {}).update(
                    {"job_key": ticket.key, "attempt": ticket.attempt, "mode": mode}
                )
            records[-1].setdefault("memory", {}).update(
                {
                    "stored": len(stored),
                    "rejected": [
                        Rejected(kind=r["kind"], text=scrub(r["text"]), why=r["why"]) for r in rejected
                    ],
                    "dropped": dropped,
                    "outcome": "dropped" if dropped is not None else "stored",
                }
            )
            telemetry.job_finished(records[-1])
            return records

        results = await asyncio.gather(*(one(job) for job in self.memory_jobs))
        return [record for records in results for record in records]

    def dropped(self, job: MemoryJob, ticket: JobTicket, why: str) -> RouteRecord:
        """The record of a job of this run that stored nothing, and why."""
        record = dropped_record(job, ticket.run["leg"], ticket.run["turn"], ticket.run["step"], why)
        record.setdefault("memory", {}).update(
            {"job_key": ticket.key, "attempt": ticket.attempt, "outcome": "dropped"}
        )
        return record

    async def sweep(self, graph: MemoryGraph, *, context: FusionContext | None = None) -> int:
        """Run every pending job of ``graph``'s store that no live process is running (awaited)."""
        store = graph.store
        if store is None:
            return 0
        if graph.checkpointer is None:
            raise UsageError("sweep needs the graph's checkpointer: it reads each thread's messages from it")
        context = ensure_context(context)
        count = 0
        everywhere = await pending_everywhere(store)
        for ns, entry in await self._to_rerun(everywhere):
            snapshot = await graph.aget_state({"configurable": {"thread_id": entry["thread_id"]}})
            task = await self._rerun(entry, ns, snapshot.values.get("messages", []), context, store)
            if task is not None:
                await task
            count += 1
        return count


def _echo_sources(job: MemoryJob, system_prompt: str) -> dict[str, str]:
    """The prompt texts a job's items must not echo (``memory.screen``): what fusion-graph wrote.

    The conversation is not one of them: a fact the user stated is what a memory is for.
    """
    return {"the job's instructions": job.instructions, "the system prompt": system_prompt}


def _covered(messages: Sequence[BaseMessage], ticket: JobTicket) -> list[BaseMessage]:
    """The messages a logged run covers: the thread's first ``covers``, up to its last message id."""
    ids = [m.id for m in messages]
    end = ticket.run["covers"]
    if ticket.run["last_message_id"] is not None and ticket.run["last_message_id"] in ids:
        end = ids.index(ticket.run["last_message_id"]) + 1
    return list(messages[:end])


async def sweep(graph: MemoryGraph, *, context: FusionContext | None = None) -> int:
    """Run every pending job of ``graph``'s store that no live process is running; returns how many.

    Each is re-run on the thread's messages from ``graph``'s checkpointer and
    awaited; its records reach the thread's ``route_log`` at its next turn.
    """
    return await graph.memory_runs.sweep(graph, context=context)


async def drain(
    timeout: float | None = None, *, graph: MemoryGraph | None = None, context: FusionContext | None = None
) -> None:
    """Wait for detached memory jobs (e.g. before a process exits, or in tests).

    With ``graph``, first run its pending jobs that no live process is running
    (``sweep``), e.g. those a crashed process left behind.
    """
    if graph is not None:
        await sweep(graph, context=context)
    await background.wait_detached(timeout)
