"""Executor nodes: the plan, continuation steps on either leg, and repairs.

Each runs one inference through the provider chain (``executor.infer``), checks
the answer's tool batch (``dispatch.check_batch``) and writes both in one
update. Continuation steps act on the decision the ``route`` node handed over
in ``state["route"]``; they never score again. Before the call the fit rule
(``sizing.Sizer.prepare``) keeps the step off links whose window cannot hold
it, compacting the history when none can; after it, the answering leg's
report becomes that leg's anchor for the next estimate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.config import get_config
from langgraph.runtime import Runtime

from fusion_graph import prompts
from fusion_graph.budget import cloud_spend, over_budget, within_budget
from fusion_graph.context import FusionContext, ensure_context
from fusion_graph.memory import inference_running
from fusion_graph.nodes.dispatch import check_batch
from fusion_graph.providers.ask import ROUTE_EVENT, Inference, infer
from fusion_graph.providers.chain import ChainLink
from fusion_graph.providers.measure import Prepared, Sizer, StepSizes, overflowed
from fusion_graph.providers.records import make_record, totals_of
from fusion_graph.providers.resolver import ProviderResolver
from fusion_graph.routing import Leg, RouteDecision, StepSignals
from fusion_graph.sizing.estimate import Estimate
from fusion_graph.sizing.tokens import TokenCounter
from fusion_graph.state import RouteRecord, State, StepKind, add_totals
from fusion_graph.turn import from_pending, handed_estimates, plan_route


@dataclass(frozen=True)
class TurnStart:
    """What the memory side hands a new turn's plan step.

    Attributes:
        message: Recalled memories, joined to the turn after the user's message (``None``: none).
        records: Records of memory jobs that finished since the last fold, for ``route_log``.
    """

    message: HumanMessage | None = None
    records: tuple[RouteRecord, ...] = ()


#: Prepares a new turn: recalls memories, catches up on memory jobs (``fusion_graph.nodes.memory``).
Recall = Callable[[State, Runtime[FusionContext]], Awaitable[TurnStart]]


class InvalidInput(ValueError):
    """A run was started without a new user message; nothing was sent to any model."""


def thread_id_of(config: RunnableConfig) -> str:
    """The conversation's id (``configurable.thread_id``); one shared id when absent."""
    return str(config.get("configurable", {}).get("thread_id") or "default")


def check_new_turn(messages: Sequence[BaseMessage] | None) -> None:
    """Refuse a turn whose last message is not a user's (no model call is made for it)."""
    if not messages:
        raise InvalidInput(
            "the run has no messages: send at least one user message, e.g. "
            '{"messages": [("user", "...")]}; to continue an interrupted run, invoke with None'
        )
    last = messages[-1]
    if not isinstance(last, HumanMessage):
        raise InvalidInput(
            f"the last message is a {type(last).__name__}, not a user message: a turn starts with a "
            "new user message (to continue an interrupted run, invoke with None or Command(resume=...))"
        )


#: State fields with reducers: what a node writes there is always new.
_APPENDED = frozenset({"messages", "route_log", "totals"})


def only_changes(state: State, update: dict[str, Any]) -> dict[str, Any]:
    """``update`` without fields that already hold the same value.

    Every written field is saved again in the next checkpoint; skipping
    unchanged ones keeps each step's checkpoint small.
    """
    current: dict[str, Any] = dict(state)
    return {
        key: value
        for key, value in update.items()
        if key in _APPENDED or key not in current or current[key] != value
    }


@dataclass(frozen=True)
class StepOrder:
    """One inference an executor node is about to run, decided and (but for repairs) measured.

    Attributes:
        node: The node that runs it (where a resume retries it).
        kind: ``plan``, ``step`` or ``repair``.
        step: Step index in the turn.
        turn: Turn index in the thread.
        decision: The routing decision (the leg it starts on, and why).
        signals: The signals it was scored on (``None`` for a repair: never re-scored).
        prefer_provider: A provider to start with while healthy (a repair's).
        sizes: Windows and estimates already measured for the decision.
    """

    node: str
    kind: StepKind
    step: int
    turn: int
    decision: RouteDecision
    signals: StepSignals | None
    prefer_provider: str | None = None
    sizes: StepSizes | None = None


class InferenceNodes:
    """``plan``, ``local``, ``cloud`` and ``repair``, bound to the graph's providers and tools."""

    def __init__(
        self,
        *,
        resolver: ProviderResolver,
        tools: Sequence[BaseTool],
        count_tokens: TokenCounter,
        recall: Recall | None = None,
        sizer: Sizer | None = None,
    ) -> None:
        """Keep what every inference needs."""
        self.resolver = resolver
        self.tools = list(tools)
        self.tools_by_name = {tool.name: tool for tool in self.tools}
        self.count_tokens = count_tokens
        self.recall = recall
        self.sizer = sizer or Sizer(resolver, self.tools, count_tokens)

    async def measure(
        self, state: State, context: FusionContext, known: dict[str, Estimate] | None = None
    ) -> StepSizes:
        """Windows, estimates and the context budget of the step about to run on ``state``."""
        chain = await self.resolver.chain(context)
        return await self.sizer.measure(
            chain, state.get("messages", []), state.get("anchors") or {}, context, known=known
        )

    async def _infer(
        self, order: StepOrder, state: State, runtime: Runtime[FusionContext]
    ) -> tuple[dict[str, Any], bool]:
        """One inference and its batch check; returns the update and whether it was answered.

        The fit rule picks the links that can hold the step (and compacts the
        history when none can); if every link that could hold it overflowed
        anyway, the history is compacted further and the inference runs once more.
        """
        node, kind, step, turn, decision = order.node, order.kind, order.step, order.turn, order.decision
        context = ensure_context(runtime.context)
        chain = await self.resolver.chain(context)
        thread_id = thread_id_of(get_config())

        async def find_slot(link: ChainLink) -> int | None:
            pool = await self.resolver.slot_pool(link, context)
            return pool.slot_for(thread_id) if pool is not None else None

        async def served(link: ChainLink, box: str) -> str | None:
            return await self.resolver.served(link, context, thread_id, box)

        def headers(link: ChainLink) -> dict[str, str] | None:
            return self.resolver.local_headers(link, thread_id)

        anchors = dict(state.get("anchors") or {})
        prepared = await self.sizer.prepare(
            chain, decision.leg, state.get("messages", []), anchors, context, sizes=order.sizes
        )
        # The budget binds the whole walk: a step the router kept local never falls over to cloud past it.
        over, budget_extra = None, {}
        budget = self.resolver.cloud_budget(context)
        if budget.limited:
            cost = self.sizer.cloud_cost(chain, prepared.sizes, anchors, context)
            over = over_budget(budget, cloud_spend(state.get("route_log", []), turn), cost)
            budget_extra = {"cloud_step_usd": cost} | ({"cloud_budget": over} if over is not None else {})
        async with inference_running(thread_id):  # a memory job beside this step starts after it
            for retry in (False, True):
                if prepared.compaction is not None:
                    _stream_compaction(runtime, (turn, step, kind), decision.leg, prepared)
                call = Inference(
                    kind=kind,
                    step=step,
                    turn=turn,
                    decision=prepared.decided(decision),
                    signals=order.signals,
                    messages=prepared.messages,
                    tools=self.tools,
                    context=context,
                    prefer_provider=order.prefer_provider,
                )
                bounds = self.sizer.bounds(chain, prepared, context)
                if over is not None:
                    allowed = bounds.allowed if bounds.allowed is not None else {x.id for x in chain.links}
                    local = frozenset(x for x in allowed if chain.leg_of(x) != "cloud")
                    if not local:  # only cloud can hold it, and the budget does not allow cloud
                        return _over_budget_end(order, prepared.decided(decision), prepared, over), True
                    bounds = dataclasses.replace(bounds, allowed=local)
                answer, record, exhausted = await infer(
                    call,
                    chain=chain,
                    find_slot=find_slot,
                    runtime=runtime,
                    bounds=bounds,
                    extra=prepared.extra() | budget_extra,
                    headers=headers,
                    served=served,
                )
                if answer is not None or retry or exhausted is None or not overflowed(exhausted):
                    break
                prepared = await self.sizer.after_overflow(chain, decision.leg, prepared, exhausted, context)
        if answer is None:
            message = str(exhausted) if exhausted is not None else "no provider answered"
            retry_in = exhausted.retry_in_s if exhausted is not None else None
            return {
                "route_log": [record],
                "stall": {"node": node, "message": message, "retry_in_s": retry_in},
            }, False
        history = prepared.messages
        batch = check_batch(answer, history=history, tools=self.tools_by_name, context=context)
        anchors = prepared.anchors(anchors, record["leg"], record["prompt_tokens"], record["provider"] or "")
        update: dict[str, Any] = {
            "messages": [*prepared.changes, batch.answer, *batch.replies],
            "route_log": [record],
            "totals": totals_of(record),
            "step": step,
            # The leg that answered: after a fallover the turn continues from there.
            "leg": record["leg"],
            "provider": record["provider"],
            "notice": batch.notice,
            "repair_error": batch.repair_error,
            "route": None,
            "stall": None,
            "anchors": anchors,
        }
        if batch.repair_error is None:
            update["repair_attempts"] = 0
        return only_changes(state, update), True

    async def plan(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """Step 0: form the plan and pick the first tool batch (cloud whenever cloud_share > 0).

        Relevant stored memories join the turn as a message right after the user's,
        so every later step shares the prefix.
        """
        check_new_turn(state.get("messages"))
        context = ensure_context(runtime.context)
        start = await self.recall(state, runtime) if self.recall is not None else TurnStart()
        recalled = start.message
        if recalled is not None:
            state = {**state, "messages": [*state["messages"], recalled]}
        sizes = await self.measure(state, context)
        decision, signals = plan_route(
            state,
            context,
            self.count_tokens,
            prompt_tokens=sizes.score_tokens,
            budget=sizes.budget,
            tools=self.tools,
        )
        turn = state.get("turn", -1) + 1
        if decision.leg == "cloud":  # once the thread's budget is spent, plans run local too
            chain = await self.resolver.chain(context)
            anchors = state.get("anchors") or {}
            why = self.sizer.over_budget(chain, sizes, anchors, state.get("route_log", []), turn, context)
            decision = within_budget(decision, why)
        order = StepOrder("plan", "plan", step=0, turn=turn, decision=decision, signals=signals, sizes=sizes)
        update, answered = await self._infer(order, state, runtime)
        if not answered:
            return update
        if recalled is not None:
            update["messages"] = [recalled, *update["messages"]]
        if start.records:  # memory jobs that finished since the last turn: in route_log once
            update["route_log"] = [*start.records, *update["route_log"]]
            for record in start.records:
                update["totals"] = add_totals(update.get("totals"), totals_of(record))
        update |= {"turn": turn}
        update.setdefault("repair_attempts", 0)
        return update

    async def _continue(self, leg: Leg, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        context = ensure_context(runtime.context)
        pending = state.get("route")
        if pending is None or pending["leg"] != leg:
            raise RuntimeError(f"the {leg} step runs only on a decision that route handed over for it")
        decision, signals = from_pending(pending)
        sizes = await self.measure(state, context, handed_estimates(pending))
        step, turn = state.get("step", 0) + 1, state.get("turn", 0)
        order = StepOrder(leg, "step", step=step, turn=turn, decision=decision, signals=signals, sizes=sizes)
        update, _ = await self._infer(order, state, runtime)
        return update

    async def local(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """A continuation step routed to the local model (llama-server)."""
        return await self._continue("local", state, runtime)

    async def cloud(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """A continuation step routed to the cloud model."""
        return await self._continue("cloud", state, runtime)

    async def repair(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """Retry a malformed tool call on the leg and provider that made it (never re-scored).

        The provider is preferred while healthy; when it is not, the repair falls
        over like any step.
        """
        context = ensure_context(runtime.context)
        leg: Leg = state.get("leg", "local")
        attempt = state.get("repair_attempts", 0) + 1
        decision = RouteDecision(
            leg=leg,
            score=None,
            threshold=None,
            reason=f"repair {attempt}/{context.max_repair_attempts} of a malformed tool call: "
            f"kept on the {leg} leg that made it",
        )
        sizes = None
        if leg == "cloud" and self.resolver.cloud_budget(context).limited:  # cloud spend like any step
            chain = await self.resolver.chain(context)
            sizes = await self.measure(state, context)  # handed on: the inference does not measure again
            anchors, log = state.get("anchors") or {}, state.get("route_log", [])
            why = self.sizer.over_budget(chain, sizes, anchors, log, state.get("turn", 0), context)
            decision = within_budget(decision, why)
        order = StepOrder(
            "repair",
            "repair",
            step=state.get("step", 0) + 1,
            turn=state.get("turn", 0),
            decision=decision,
            signals=None,
            prefer_provider=state.get("provider"),
            sizes=sizes,
        )
        update, answered = await self._infer(order, state, runtime)
        if answered and update.get("repair_error", state.get("repair_error")) is not None:
            update["repair_attempts"] = attempt
        return update


def _over_budget_end(
    order: StepOrder, decision: RouteDecision, prepared: Prepared, why: str
) -> dict[str, Any]:
    """End the turn: the step fits only a cloud window, and the cloud budget does not allow it.

    The record says why (no inference was made); the message tells the user what to do.
    """
    fit = prepared.plan.reason or "the local window cannot hold it"
    record = make_record(
        turn=order.turn,
        step=order.step,
        kind=order.kind,
        leg=decision.leg,
        decision=decision,
        signals=order.signals,
        provider=None,
        answer=None,
        extra={"outcome": "over_budget", "cloud_budget": why, "fit": fit},
    )
    return {
        "messages": [*prepared.changes, AIMessage(prompts.OVER_BUDGET.format(fit=fit, why=why))],
        "route_log": [record],
        "step": order.step,
        "route": None,
        "stall": None,
        "repair_error": None,
    }


def _stream_compaction(
    runtime: Runtime[FusionContext], where: tuple[int, int, StepKind], routed: Leg, prepared: Prepared
) -> None:
    """The ``fusion_route`` event of a compaction, sent before the call it makes possible."""
    compaction = prepared.compaction
    assert compaction is not None
    turn, step, kind = where
    runtime.stream_writer(
        {
            "event": ROUTE_EVENT,
            "phase": "compaction",
            "turn": turn,
            "step": step,
            "kind": kind,
            "routed_leg": routed,
            "reason": prepared.plan.reason,
            **compaction.summary(),
            "freed_tokens": compaction.freed,
            "need_tokens": compaction.need,
        }
    )
