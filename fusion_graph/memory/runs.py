"""Runs of the memory jobs: inline, detached and logged, caught up at a thread's next turn.

A ``MemoryRuns`` belongs to one compiled graph (``build_graph`` keeps it on the
graph as ``graph.memory_runs``): the ``memory`` node and the plan step call it,
and so do ``sweep``/``drain(graph=...)`` for pending runs no live process does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from langchain_core.messages import BaseMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.store.base import BaseStore

from fusion_graph.context import FusionContext, ensure_context
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
    thread_entries,
    ticket_of,
    with_status,
    write_entry,
)
from fusion_graph.memory.jobs import DEFAULT_JOBS, JobTicket, MemoryJob
from fusion_graph.memory.store import store_items
from fusion_graph.providers.resolver import ProviderResolver
from fusion_graph.records import RouteRecord
from fusion_graph.redact import scrub

logger = logging.getLogger(__name__)


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

    @property
    def timeout_s(self) -> float:
        """Seconds one run of the jobs may take (``memory_timeout_s``)."""
        return self.resolver.settings.memory_timeout_s

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
        now = time.time()
        for entry in entries:
            ticket = ticket_of(entry, ns)
            if needs_rerun(entry, now=now, running_here=background.running_here(ticket.key)):
                try:
                    await self._rerun(entry, ns, messages, context, store)
                except Exception:  # never fail the turn over memory; the next turn tries again
                    logger.exception("running memory job %s again failed", ticket.key)
        return records

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
                records.extend(entry["records"])
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
        ticket = ticket_of(entry, ns, attempt=entry.get("attempts", 1) + 1)
        if ticket.attempt > MAX_ATTEMPTS:
            why = f"given up after {MAX_ATTEMPTS} runs that never finished"
            dropped = [self.dropped(job, ticket, why) for job in self.memory_jobs]
            await write_entry(store, ticket, done_entry(entry, dropped))
            return None
        claimed = pending_entry(
            ticket, self.memory_jobs, lease_s=self.lease_s, created_at=entry.get("created_at")
        )
        await write_entry(store, ticket, claimed)
        logger.info("memory job %s: running again (attempt %d)", ticket.key, ticket.attempt)
        covered = _covered(messages, ticket)
        return background.detach(self.run_logged(ticket, claimed, covered, context, store), key=ticket.key)

    async def run_logged(
        self,
        ticket: JobTicket,
        entry: JobEntry,
        messages: Sequence[BaseMessage],
        context: FusionContext,
        store: BaseStore,
    ) -> list[RouteRecord]:
        """A detached run: after the thread's step in flight, run the jobs, then log them as done.

        If the process dies first the entry stays pending, and the run is picked up again.
        """
        await background.steps_settled(ticket.thread_id, timeout=self.timeout_s)
        records = await self.run(ticket, messages, context, store, config=None)
        try:
            await write_entry(store, ticket, done_entry(entry, records))
        except Exception:
            logger.exception("logging memory job %s as done failed; it will run again", ticket.key)
        return records

    async def run(
        self,
        ticket: JobTicket,
        messages: Sequence[BaseMessage],
        context: FusionContext,
        store: BaseStore,
        *,
        config: RunnableConfig | None,
    ) -> list[RouteRecord]:
        """Every job of one run (each bounded by ``memory_timeout_s``); their records, never raises."""
        chain = await self.resolver.chain(context)

        runner = JobRunner(
            chain=chain,
            leg=ticket.leg,
            system_prompt=context.system_prompt,
            tools=self.tools,
            # The reflection slot, with the thread's routing key: behind a gateway the job runs on
            # the thread's box, near its cache.
            placer=self.resolver.placement,
            thread_id=ticket.thread_id,
            max_tokens=context.memory_max_tokens,
            timeout_s=self.resolver.settings.request_timeout,
            config=config,
        )
        mode = context.memory_mode

        async def one(job: MemoryJob) -> list[RouteRecord]:
            try:
                result, records, dropped = await asyncio.wait_for(
                    run_job(job, messages, runner, turn=ticket.turn, step=ticket.step),
                    timeout=self.timeout_s,
                )
            except TimeoutError:
                result, records, dropped = None, [], f"timed out after {self.timeout_s} s"
            stored: list[dict[str, Any]] = []
            if result is not None:
                try:
                    stored = await store_items(store, job, result, ticket=ticket)
                except Exception as error:  # noqa: BLE001 - never fail the turn over memory
                    dropped = scrub(f"store write failed: {type(error).__name__}: {error}")
            if not records or (dropped is not None and not records[-1]["extra"].get("dropped")):
                records.append(self.dropped(job, ticket, dropped or "no answer"))
            for record in records:
                record["extra"] |= {"job_key": ticket.key, "attempt": ticket.attempt, "mode": mode}
            records[-1]["extra"] |= {
                "stored": len(stored),
                "dropped": dropped,
                "outcome": "dropped" if dropped is not None else "stored",
            }
            return records

        results = await asyncio.gather(*(one(job) for job in self.memory_jobs))
        return [record for records in results for record in records]

    def dropped(self, job: MemoryJob, ticket: JobTicket, why: str) -> RouteRecord:
        """The record of a job of this run that stored nothing, and why."""
        record = dropped_record(job, ticket.leg, ticket.turn, ticket.step, why)
        record["extra"] |= {"job_key": ticket.key, "attempt": ticket.attempt, "outcome": "dropped"}
        return record

    async def sweep(self, graph: MemoryGraph, *, context: FusionContext | None = None) -> int:
        """Run every pending job of ``graph``'s store that no live process is running (awaited)."""
        store = graph.store
        if store is None:
            return 0
        if graph.checkpointer is None:
            raise ValueError("sweep needs the graph's checkpointer: it reads each thread's messages from it")
        context = ensure_context(context)
        now = time.time()
        count = 0
        for ns, entry in await pending_everywhere(store):
            ticket = ticket_of(entry, ns)
            if not needs_rerun(entry, now=now, running_here=background.running_here(ticket.key)):
                continue
            snapshot = await graph.aget_state({"configurable": {"thread_id": entry["thread_id"]}})
            task = await self._rerun(entry, ns, snapshot.values.get("messages", []), context, store)
            if task is not None:
                await task
            count += 1
        return count


def _covered(messages: Sequence[BaseMessage], ticket: JobTicket) -> list[BaseMessage]:
    """The messages a logged run covers: the thread's first ``covers``, up to its last message id."""
    ids = [m.id for m in messages]
    end = ticket.covers
    if ticket.last_message_id is not None and ticket.last_message_id in ids:
        end = ids.index(ticket.last_message_id) + 1
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
