"""Executor nodes: the plan, continuation steps on either leg, and repairs.

Each makes one inference through the provider chain (``providers.ask.ask``),
checks the answer's tool batch (``dispatch.check_batch``) and writes both in
one update. Each carries out a ``route.StepOrder`` made once (the plan's and a
repair's here, a continuation step's by the routing rule) and never decides
again: the budget check in the order binds the step and its fallover. Before
the call the fit rule (``providers.measure.Sizer.prepare``) keeps the step off
links whose window cannot hold it, compacting the history when none can; after
it, the answering leg's report becomes that leg's anchor for the next estimate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from langchain_core.tools import BaseTool
from langgraph.config import get_config
from langgraph.runtime import Runtime
from langgraph.store.base import BaseStore

from fusion_graph.context import FusionContext, ensure_context
from fusion_graph.errors import StateError
from fusion_graph.inputs import check_new_turn, thread_id_of
from fusion_graph.memory.background import inference_running
from fusion_graph.memory.store import namespace_of, shadows_namespace
from fusion_graph.nodes.dispatch import check_batch
from fusion_graph.nodes.memory import Recall, TurnStart
from fusion_graph.nodes.route import RouteNode, StepOrder, decide_step, order_step, over_budget, step_key
from fusion_graph.nodes.shadow import ShadowChecks, recorded_elsewhere
from fusion_graph.providers.ask import ROUTE_EVENT, Ask, ask
from fusion_graph.providers.measure import Prepared, Sizer, overflowed
from fusion_graph.providers.resolver import ProviderResolver
from fusion_graph.routing.budget import BudgetCheck
from fusion_graph.routing.records import StepKind, add_totals, records_totals
from fusion_graph.routing.score import Leg, RouteDecision
from fusion_graph.sizing.tokens import TokenCounter, build_prompt
from fusion_graph.sizing.turn import turn_number
from fusion_graph.state import State

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
        route: RouteNode | None = None,
        graph_name: str = "fusion",
    ) -> None:
        """Keep what every inference needs; ``route``: the rule whose decisions the steps carry out.

        ``graph_name``: the store namespace's assistant when a run names none (finished shadow checks).
        """
        self.resolver = resolver
        self.graph_name = graph_name
        self.tools = list(tools)
        self.tools_by_name = {tool.name: tool for tool in self.tools}
        self.count_tokens = count_tokens
        self.recall = recall
        self.sizer = sizer or Sizer(resolver, self.tools, count_tokens)
        self.route = route
        self.shadows = ShadowChecks()

    async def _infer(
        self, order: StepOrder, state: State, runtime: Runtime[FusionContext]
    ) -> tuple[dict[str, Any], bool]:
        """One inference and its batch check; returns the update and whether it was answered.

        The fit rule picks the links that can hold the step (and compacts the
        history when none can); if every link that could hold it overflowed
        anyway, the history is compacted further and the inference runs once more.
        """
        node, kind, step, turn = order.node, order.kind, order.step, order.turn
        decision, check = order.decision, order.check
        context = ensure_context(runtime.context)
        chain = await self.resolver.chain(context)
        thread_id = thread_id_of(get_config())
        anchors = dict(state.get("anchors") or {})
        messages = state.get("messages", [])
        prepared = await self.sizer.prepare(
            chain, decision.leg, messages, anchors, context, sizes=order.sizes
        )
        shadowed = order.shadow
        if shadowed:  # the cloud leg asked beside the step, never waited for
            shadowed = self._shadow(chain, prepared, check, context, order, thread_id, runtime.store)
        async with inference_running(thread_id):  # a memory job beside this step starts after it
            for retry in (False, True):
                if prepared.compaction is not None:
                    _stream_compaction(runtime, (turn, step, kind), decision.leg, prepared)
                bounds = self.sizer.bounds(chain, prepared, context, check)
                if check.over is not None and not bounds.allowed:  # only cloud could hold it: over budget
                    return _over_budget_end(order, prepared), True
                call = Ask(
                    kind=kind,
                    turn=turn,
                    step=step,
                    decision=prepared.decided(decision),
                    # Every inference of a thread sends the same system prompt, so the prefix is stable.
                    prompt=build_prompt(context.system_prompt, prepared.messages),
                    thread_id=thread_id,
                    tools=self.tools,
                    signals=order.signals,
                    prefer_provider=order.prefer_provider,
                    extra=prepared.extra() | check.extra(),
                )
                asked = await ask(
                    call,
                    chain=chain,
                    placer=self.resolver.placement,
                    bounds=bounds,
                    writer=runtime.stream_writer,
                )
                exhausted = asked.exhausted
                if asked.answer is not None or retry or exhausted is None or not overflowed(exhausted):
                    break
                prepared = await self.sizer.after_overflow(chain, decision.leg, prepared, exhausted, context)
        record, answer = asked.record, asked.answer
        if shadowed:
            self.shadows.answered(thread_id, turn, step, answer if record["leg"] == "local" else None)
        shadows = self.shadows.fold(thread_id, state.get("route_log") or ())
        for done in shadows:
            runtime.stream_writer({"event": ROUTE_EVENT, "phase": "outcome", **done})
        if answer is None:
            message = str(exhausted) if exhausted is not None else "no provider answered"
            retry_in = exhausted.retry_in_s if exhausted is not None else None
            stalled: dict[str, Any] = {
                "route_log": [record, *shadows],
                "stall": {"node": node, "message": message, "retry_in_s": retry_in},
            }
            if shadows:  # shadows that finished meanwhile were paid for all the same
                stalled["totals"] = records_totals(shadows)
            return stalled, False
        history = prepared.messages
        batch = check_batch(answer, history=history, tools=self.tools_by_name, context=context)
        anchors = prepared.anchors(anchors, record["leg"], record["prompt_tokens"], record["provider"] or "")
        totals = records_totals([record, *shadows])
        update: dict[str, Any] = {
            "messages": [*prepared.changes, batch.answer, *batch.replies],
            "route_log": [record, *shadows],
            "totals": totals,
            "step": step,
            # The leg that answered: after a fallover the turn continues from there.
            "leg": record["leg"],
            "provider": record["provider"],
            "notice": batch.notice,
            "repair_error": batch.repair_error,
            "stall": None,
            "anchors": anchors,
        }
        if batch.repair_error is None:
            update["repair_attempts"] = 0
        return only_changes(state, update), True

    def _shadow(
        self,
        chain: Any,
        prepared: Prepared,
        check: BudgetCheck,
        context: FusionContext,
        order: StepOrder,
        thread_id: str,
        store: BaseStore | None,
    ) -> bool:
        """Start the shadow check of this local step on the cloud leg; ``False`` when none is made."""
        cloud = chain.first_cloud
        if cloud is None:
            return False
        return self.shadows.start(
            thread_id=thread_id,
            turn=order.turn,
            step=order.step,
            score=order.decision.score.score if order.decision.score is not None else None,
            prompt=build_prompt(context.system_prompt, prepared.messages),
            tools=self.tools,
            chain=chain,
            placer=self.resolver.placement,
            check=check,
            timeout_s=self.resolver.settings.request_timeout,
            max_tokens=self.sizer.budget_of(cloud, prepared.sizes, context),
            store=store,
            namespace=shadows_namespace(namespace_of(get_config(), self.graph_name)),
        )

    async def plan(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """Step 0: form the plan and pick the first tool batch (cloud whenever cloud_share > 0).

        Relevant stored memories join the turn as a message right after the user's,
        so every later step shares the prefix. Once the thread's cloud budget is
        spent, plans run local too (the budget guard in ``_infer``).
        """
        check_new_turn(state.get("messages"))
        context = ensure_context(runtime.context)
        start = await self.recall(state, runtime) if self.recall is not None else TurnStart()
        recalled = start.message
        if recalled is not None:
            state = {**state, "messages": [*state["messages"], recalled]}
        turn = turn_number(state.get("turn"), state["messages"])  # a retried turn keeps its number
        thread_id = thread_id_of(get_config())
        order = await decide_step(
            self.sizer,
            state,
            context,
            self.count_tokens,
            self.tools,
            plan=True,
            turn=turn,
            thread_id=thread_id,
        )
        update, answered = await self._infer(order, state, runtime)
        if not answered:
            return update
        if recalled is not None:
            update["messages"] = [recalled, *update["messages"]]
        caught = list(start.records)  # memory jobs that finished since the last turn: in route_log once
        if runtime.store is not None:  # shadow checks that finished after their turn, in any worker
            ns = shadows_namespace(namespace_of(get_config(), self.graph_name))
            thread_id = thread_id_of(get_config())
            log = state.get("route_log") or []
            caught += await recorded_elsewhere(runtime.store, ns, thread_id, log, update["route_log"])
        if caught:
            update["route_log"] = [*caught, *update["route_log"]]
            update["totals"] = add_totals(update.get("totals"), records_totals(caught))
        update |= {"turn": turn}
        if state.get("latch") is not None:  # a new turn starts unlatched (trouble_signals)
            update["latch"] = None
        update.setdefault("repair_attempts", 0)
        return update

    async def _continue(self, leg: Leg, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """Carry out the order that sent this step here: kept for it in process, else the rule's again.

        A run resumed in another process finds no order kept for it; the rule is a function
        of the state, so applied again it decides the same.
        """
        if self.route is None:
            raise StateError(f"the {leg} step runs only on a decision the routing rule made for it")
        thread_id = thread_id_of(get_config())
        routed = self.route.orders.take(step_key(state, thread_id))
        routed = routed or await self.route.decide(state, runtime, thread_id)
        order = routed.order
        if order is None:
            raise StateError(f"the {leg} step runs only on a decision the routing rule made for it")
        if order.decision.leg != leg:  # a resume whose rule now reads otherwise: the leg already chosen holds
            reason = f"{order.decision.reason} (routed {leg} before)"
            decision = dataclasses.replace(order.decision, leg=leg, reason=reason)
            order = dataclasses.replace(order, node=leg, decision=decision, shadow=False)
        update, _ = await self._infer(order, state, runtime)
        return {**routed.update, **update}

    async def local(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """A continuation step routed to the local model (llama-server)."""
        return await self._continue("local", state, runtime)

    async def cloud(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """A continuation step routed to the cloud model."""
        return await self._continue("cloud", state, runtime)

    async def repair(self, state: State, runtime: Runtime[FusionContext]) -> dict[str, Any]:
        """Retry a malformed tool call on the leg and provider that made it (never re-scored).

        The provider is preferred while healthy; when it is not, the repair falls
        over like any step. On cloud it is priced against the budget like any step.
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
        order = await order_step(
            self.sizer,
            state,
            context,
            node="repair",
            kind="repair",
            step=state.get("step", 0) + 1,
            turn=state.get("turn", 0),
            decision=decision,
            signals=None,
            thread_id=thread_id_of(get_config()),
            prefer_provider=state.get("provider"),
        )
        update, answered = await self._infer(order, state, runtime)
        if answered and update.get("repair_error", state.get("repair_error")) is not None:
            update["repair_attempts"] = attempt
        return update


def _over_budget_end(order: StepOrder, prepared: Prepared) -> dict[str, Any]:
    """End the turn with ``route.over_budget``'s record and reply (the history as prepared)."""
    record, reply = over_budget(order, prepared)
    return {
        "messages": [*prepared.changes, reply],
        "route_log": [record],
        "step": order.step,
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
