"""The memory side branch: recall and catch-up at a new turn, and the memory jobs.

``inline`` runs the jobs inside the ``memory`` node (records straight into
``route_log``). ``background`` writes the run to the store's job log as
pending, detaches it and returns at once; the run marks itself done with its
records, which the next ``memory`` node or plan step of the thread folds into
``route_log`` once. The plan step also re-runs pending runs that no live
process is doing (a crash, a process exit), and ``sweep`` does so for every
thread of a graph.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.config import get_config
from langgraph.runtime import Runtime
from langgraph.store.base import BaseStore

from fusion_graph import memory
from fusion_graph.chain import ChainLink
from fusion_graph.context import FusionContext, ensure_context
from fusion_graph.executor import ROUTE_EVENT
from fusion_graph.memory import JobEntry, JobTicket, MemoryJob
from fusion_graph.nodes.inference import TurnStart, thread_id_of
from fusion_graph.records import totals_of
from fusion_graph.redact import scrub
from fusion_graph.resolver import ProviderResolver
from fusion_graph.signals import turn_start
from fusion_graph.state import RouteRecord, State, add_totals

if TYPE_CHECKING:
    from fusion_graph.serial import FusionGraph

logger = logging.getLogger(__name__)


def memory_on(runtime: Runtime[Any]) -> bool:
    """Whether memory jobs can run: a store is attached and ``sub_runners`` is not ``off``."""
    return runtime.store is not None and ensure_context(runtime.context).sub_runners != "off"


def memory_nodes_of(graph: FusionGraph) -> MemoryNodes:
    """The ``MemoryNodes`` behind a graph built by ``build_graph`` (its ``memory`` node's owner)."""
    node = graph.builder.nodes.get("memory")
    owner = getattr(getattr(node.runnable, "afunc", None), "__self__", None) if node is not None else None
    if not isinstance(owner, MemoryNodes):
        raise ValueError("not a graph from fusion_graph.build_graph: it has no memory node")
    return owner


def records_update(records: Sequence[RouteRecord], runtime: Runtime[Any]) -> dict[str, Any]:
    """A state update adding ``records`` to ``route_log`` and ``totals``, each streamed as an outcome."""
    if not records:
        return {}
    totals: dict[str, Any] = {}
    for record in records:
        runtime.stream_writer({"event": ROUTE_EVENT, "phase": "outcome", **record})
        totals = add_totals(totals, totals_of(record))
    return {"route_log": list(records), "totals": totals}


class MemoryNodes:
    """Recall and catch-up for the plan step, the ``memory`` node, and ``sweep``."""

    def __init__(
        self,
        *,
        resolver: ProviderResolver,
        jobs: Sequence[MemoryJob] = memory.DEFAULT_JOBS,
        graph_name: str = "fusion",
        tools: Sequence[BaseTool] = (),
    ) -> None:
        """Keep the providers, the jobs, the graph name (it namespaces the store) and the steps' tools."""
        self.resolver = resolver
        self.memory_jobs = tuple(jobs)
        self.graph_name = graph_name
        self.tools = list(tools)

    @property
    def timeout_s(self) -> float:
        """Seconds one run of the jobs may take (``memory_timeout_s``)."""
        return self.resolver.settings.memory_timeout_s

    @property
    def lease_s(self) -> float:
        """How long a pending run is left to its process: a wait for the step beside it, the run, grace."""
        return 2 * self.timeout_s + memory.LEASE_GRACE_S

    # -- the plan step --------------------------------------------------------

    async def recall(self, state: State, runtime: Runtime[FusionContext]) -> TurnStart:
        """What a new turn starts with: recalled memories, and the records of finished jobs.

        Pending runs of this thread that no live process is doing run again
        (detached); finished ones not yet in ``route_log`` are handed over.
        """
        context = ensure_context(runtime.context)
        message = await self._recall(state, runtime, context)
        records = await self._catch_up(state, runtime, context) if runtime.store is not None else []
        for record in records:
            runtime.stream_writer({"event": ROUTE_EVENT, "phase": "outcome", **record})
        return TurnStart(message=message, records=tuple(records))

    async def _recall(
        self, state: State, runtime: Runtime[FusionContext], context: FusionContext
    ) -> HumanMessage | None:
        if runtime.store is None or context.memory_recall_limit == 0:
            return None
        messages = state["messages"]
        query = messages[turn_start(messages)].text if messages else ""
        try:
            ns = memory.namespace_of(get_config(), self.graph_name)
            items = await memory.recall(runtime.store, ns, query, context.memory_recall_limit)
        except Exception:
            logger.exception("recalling memories failed")
            return None
        return memory.memory_message(items)

    async def _catch_up(
        self, state: State, runtime: Runtime[FusionContext], context: FusionContext
    ) -> list[RouteRecord]:
        store = runtime.store
        assert store is not None
        config = get_config()
        ns = memory.namespace_of(config, self.graph_name)
        try:
            entries = await memory.thread_entries(store, ns, thread_id_of(config))
        except Exception:
            logger.exception("reading the memory job log failed")
            return []
        records = await self._fold(entries, state, store, ns)
        if context.sub_runners == "off" or not self.memory_jobs:
            return records
        now = time.time()
        for entry in entries:
            ticket = memory.ticket_of(entry, ns)
            if memory.needs_rerun(entry, now=now, running_here=memory.running_here(ticket.key)):
                try:
                    await self._rerun(entry, ns, state["messages"], context, store)
                except Exception:  # never fail the turn over memory; the next turn tries again
                    logger.exception("running memory job %s again failed", ticket.key)
        return records

    async def _fold(
        self,
        entries: Sequence[JobEntry],
        state: State,
        store: BaseStore,
        ns: tuple[str, ...],
    ) -> list[RouteRecord]:
        """Records of finished runs not yet in ``route_log``; runs already folded are marked so."""
        folded = memory.folded_keys(state.get("route_log") or [])
        records: list[RouteRecord] = []
        for entry in entries:
            if entry["status"] != "done":
                continue
            ticket = memory.ticket_of(entry, ns)
            if ticket.key not in folded:
                records.extend(entry["records"])
                continue
            try:  # its records are in the checkpoint now: keep the log's working set small
                await memory.write_entry(store, ticket, memory.with_status(entry, "folded"))
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
        ticket = memory.ticket_of(entry, ns, attempt=entry.get("attempts", 1) + 1)
        if ticket.attempt > memory.MAX_ATTEMPTS:
            why = f"given up after {memory.MAX_ATTEMPTS} runs that never finished"
            dropped = [self._dropped(job, ticket, why) for job in self.memory_jobs]
            await memory.write_entry(store, ticket, memory.done_entry(entry, dropped))
            return None
        claimed = memory.pending_entry(
            ticket, self.memory_jobs, lease_s=self.lease_s, created_at=entry.get("created_at")
        )
        await memory.write_entry(store, ticket, claimed)
        logger.info("memory job %s: running again (attempt %d)", ticket.key, ticket.attempt)
        covered = _covered(messages, ticket)
        return memory.detach(self._run_logged(ticket, claimed, covered, context, store), key=ticket.key)

    # -- the memory node ------------------------------------------------------

    async def memory(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """Run the memory jobs on the ``sub_runners`` leg; never fails or holds up the turn.

        ``inline`` runs them here, after the reply is in state (and streamed),
        and records ``kind="memory"`` entries in ``route_log``. ``background``
        writes the run to the job log as pending, detaches it and returns at
        once, with the records of runs that finished since the last fold.
        """
        context = ensure_context(runtime.context)
        store = runtime.store
        if store is None or context.sub_runners == "off" or not self.memory_jobs:
            return {}
        config = get_config()
        messages = list(state["messages"])
        last = messages[-1] if messages else None
        ticket = JobTicket(
            namespace=memory.namespace_of(config, self.graph_name),
            thread_id=thread_id_of(config),
            turn=state.get("turn", 0),
            step=state.get("step", 0),
            covers=len(messages),
            last_message_id=last.id if last is not None else None,
            leg="cloud" if context.sub_runners == "cloud" else "local",
        )
        if context.memory_mode == "inline":
            records = await self._run(ticket, messages, context, store, config=config)
            return records_update(records, runtime)
        entry = memory.pending_entry(ticket, self.memory_jobs, lease_s=self.lease_s)
        try:
            await memory.write_entry(store, ticket, entry)
        except Exception:
            logger.exception("writing memory job %s as pending failed; running it anyway", ticket.key)
        memory.detach(self._run_logged(ticket, entry, messages, context, store), key=ticket.key)
        try:
            entries = await memory.thread_entries(store, ticket.namespace, ticket.thread_id)
        except Exception:
            logger.exception("reading the memory job log failed")
            return {}
        return records_update(await self._fold(entries, state, store, ticket.namespace), runtime)

    # -- running the jobs -----------------------------------------------------

    async def _run_logged(
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
        await memory.steps_settled(ticket.thread_id, timeout=self.timeout_s)
        records = await self._run(ticket, messages, context, store, config=None)
        try:
            await memory.write_entry(store, ticket, memory.done_entry(entry, records))
        except Exception:
            logger.exception("logging memory job %s as done failed; it will run again", ticket.key)
        return records

    async def _run(
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

        async def reflection_slot(link: ChainLink) -> int | None:
            pool = await self.resolver.slot_pool(link, context)
            return pool.reflection_slot if pool is not None else None

        runner = memory.JobRunner(
            chain=chain,
            leg=ticket.leg,
            system_prompt=context.system_prompt,
            tools=self.tools,
            reflection_slot=reflection_slot,
            max_tokens=context.memory_max_tokens,
            config=config,
        )
        mode = context.memory_mode

        async def one(job: MemoryJob) -> list[RouteRecord]:
            try:
                result, records, dropped = await asyncio.wait_for(
                    memory.run_job(job, messages, runner, turn=ticket.turn, step=ticket.step),
                    timeout=self.timeout_s,
                )
            except TimeoutError:
                result, records, dropped = None, [], f"timed out after {self.timeout_s} s"
            stored: list[dict[str, Any]] = []
            if result is not None:
                try:
                    stored = await memory.store_items(store, job, result, ticket=ticket)
                except Exception as error:  # noqa: BLE001 - never fail the turn over memory
                    dropped = scrub(f"store write failed: {type(error).__name__}: {error}")
            if not records or (dropped is not None and not records[-1]["extra"].get("dropped")):
                records.append(self._dropped(job, ticket, dropped or "no answer"))
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

    def _dropped(self, job: MemoryJob, ticket: JobTicket, why: str) -> RouteRecord:
        record = memory.dropped_record(job, ticket.leg, ticket.turn, ticket.step, why)
        record["extra"] |= {"job_key": ticket.key, "attempt": ticket.attempt, "outcome": "dropped"}
        return record

    # -- sweep ----------------------------------------------------------------

    async def sweep(self, graph: FusionGraph, *, context: FusionContext | None = None) -> int:
        """Run every pending job of ``graph``'s store that no live process is running (awaited)."""
        store = graph.store
        if store is None:
            return 0
        if graph.checkpointer is None:
            raise ValueError("sweep needs the graph's checkpointer: it reads each thread's messages from it")
        context = ensure_context(context)
        now = time.time()
        count = 0
        for ns, entry in await memory.pending_everywhere(store):
            ticket = memory.ticket_of(entry, ns)
            if not memory.needs_rerun(entry, now=now, running_here=memory.running_here(ticket.key)):
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
