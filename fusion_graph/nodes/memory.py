"""The memory side branch: recall and catch-up at a new turn, and the memory jobs.

``inline`` runs the jobs inside the ``memory`` node (records straight into
``route_log``). ``background`` writes the run to the store's job log as
pending, detaches it and returns at once; the run marks itself done with its
records, which the next ``memory`` node or plan step of the thread folds into
``route_log`` once. The plan step also re-runs pending runs that no live
process is doing (a crash, a process exit), and ``sweep`` does so for every
thread of a graph. With shared state a run is claimed by one worker, which
keeps the claim by heartbeat; under a server whose runs each have a loop of
their own (``BG_JOB_ISOLATED_LOOPS``) the node waits for its jobs (within
their lease), since a task left on that loop would freeze with it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from langchain_core.messages import BaseMessage, HumanMessage
from langgraph.config import get_config
from langgraph.runtime import Runtime

from fusion_graph.context import FusionContext, ensure_context, thread_id_of
from fusion_graph.memory.background import detach, loop_outlives_run
from fusion_graph.memory.job_log import pending_entry, thread_entries, write_entry
from fusion_graph.memory.jobs import JobTicket, TicketFields
from fusion_graph.memory.runs import MemoryRuns
from fusion_graph.memory.store import memory_message, namespace_of, recall
from fusion_graph.providers.chain import ROUTE_EVENT
from fusion_graph.routing.records import RouteRecord, records_totals
from fusion_graph.sizing.turn import turn_start
from fusion_graph.state import State

if TYPE_CHECKING:
    from fusion_graph.nodes.step import Sizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnStart:
    """What the memory side hands a new turn's plan step.

    Attributes:
        message: Recalled memories, joined to the turn after the user's message (``None``: none).
        records: Records of memory jobs that finished since the last fold, for ``route_log``.
    """

    message: HumanMessage | None = None
    records: tuple[RouteRecord, ...] = ()


#: Prepares a new turn: recalls memories, catches up on memory jobs (``MemoryNodes.recall``).
Recall = Callable[[State, Runtime[FusionContext]], Awaitable[TurnStart]]


def records_update(records: Sequence[RouteRecord], runtime: Runtime[Any]) -> dict[str, Any]:
    """A state update adding ``records`` to ``route_log`` and ``totals``, each streamed as an outcome."""
    if not records:
        return {}
    for record in records:
        runtime.stream_writer({"event": ROUTE_EVENT, "phase": "outcome", **record})
    return {"route_log": list(records), "totals": records_totals(records)}


class MemoryNodes:
    """Recall and catch-up for the plan step, and the ``memory`` node (the runs are ``MemoryRuns``)."""

    def __init__(self, runs: MemoryRuns, *, graph_name: str = "fusion", sizer: Sizer | None = None) -> None:
        """Keep the graph's memory runs, its name (it namespaces the store) and the budget's pricer."""
        self.runs = runs
        self.graph_name = graph_name
        self.sizer = sizer

    # -- the plan step --------------------------------------------------------

    async def recall(self, state: State, runtime: Runtime[FusionContext]) -> TurnStart:
        """What a new turn starts with: recalled memories, and the records of finished jobs.

        Pending runs of this thread that no live process is doing run again
        (detached); finished ones not yet in ``route_log`` are handed over.
        """
        context = ensure_context(runtime.context)
        message = await self._recall(state, runtime, context)
        records: list[RouteRecord] = []
        if runtime.store is not None:
            config = get_config()
            records = await self.runs.catch_up(
                runtime.store,
                namespace_of(config, self.graph_name),
                thread_id_of(config),
                state.get("route_log") or [],
                state["messages"],
                context,
            )
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
            ns = namespace_of(get_config(), self.graph_name)
            items = await recall(runtime.store, ns, query, context.memory_recall_limit)
        except Exception:
            logger.exception("recalling memories failed")
            return None
        return memory_message(items)

    # -- the memory node ------------------------------------------------------

    async def _over_budget(
        self, state: State, messages: Sequence[BaseMessage], context: FusionContext
    ) -> str | None:
        """Why the cloud budget keeps this run's jobs off cloud (``sub_runners="cloud"``), or ``None``.

        The one budget rule, as for every cloud call: the run is priced whole
        against the turn's and the thread's spend.
        """
        if context.sub_runners != "cloud" or self.sizer is None:
            return None
        check = await self.sizer.check_jobs_budget(
            messages,
            state.get("anchors") or {},
            state.get("route_log") or [],
            state.get("turn", 0),
            context,
            jobs=len(self.runs.memory_jobs),
        )
        return check.over

    async def memory(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """Run the memory jobs on the ``sub_runners`` leg; never fails or holds up the turn.

        ``inline`` runs them here, after the reply is in state (and streamed),
        and records ``kind="memory"`` entries in ``route_log``. ``background``
        writes the run to the job log as pending, detaches it and returns at
        once, with the records of runs that finished since the last fold.
        """
        context = ensure_context(runtime.context)
        store = runtime.store
        if store is None or context.sub_runners == "off" or not self.runs.memory_jobs:
            return {}
        config = get_config()
        messages = list(state["messages"])
        last = messages[-1] if messages else None
        over = await self._over_budget(state, messages, context)
        covered = TicketFields(
            thread_id=thread_id_of(config),
            turn=state.get("turn", 0),
            step=state.get("step", 0),
            covers=len(messages),
            last_message_id=last.id if last is not None else None,
            leg="cloud" if context.sub_runners == "cloud" and over is None else "local",
            log_id=uuid.uuid4().hex,  # this app's run, wherever else the thread id is logged
        )
        ticket = JobTicket(namespace_of(config, self.graph_name), covered)
        if context.memory_mode == "inline":
            records = await self.runs.run(ticket, messages, context, store, config=config, over_budget=over)
            return records_update(records, runtime)
        owner = await self.runs.claim(ticket)  # with shared state: this worker runs it, nobody else
        entry = pending_entry(ticket, self.runs.memory_jobs, lease_s=self.runs.lease_s)
        try:
            await write_entry(store, ticket, entry)
        except Exception:
            logger.exception("writing memory job %s as pending failed; running it anyway", ticket.key)
        run = self.runs.run_logged(ticket, entry, messages, context, store, owner=owner, over_budget=over)
        task = detach(run, key=ticket.claim_key)
        if not loop_outlives_run():  # this run's loop stops with it: see the jobs through here
            await asyncio.wait({task}, timeout=self.runs.lease_s)
        try:
            entries = await thread_entries(store, ticket.namespace, ticket.run["thread_id"])
        except Exception:
            logger.exception("reading the memory job log failed")
            return {}
        folded = await self.runs.fold(entries, state.get("route_log") or [], store, ticket.namespace)
        return records_update(folded, runtime)
