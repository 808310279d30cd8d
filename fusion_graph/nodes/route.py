"""The routing rule after a tool batch, decided once: as an edge, or as the ``route`` node that joins.

In order: calls still waiting for their file run next (the next wave of the
batch), then the step limit, then repairs, then the score picks ``local`` or
``cloud``. The score's prompt estimate is measured on the local leg (anchored
on llama-server's last report for this thread) against the local window's
usable part; a cloud step the cloud budget cannot pay for goes local (the
budget guard).

A batch of one call (the usual step) is routed by the edge after ``tools``:
no extra superstep, no checkpoint of its own. A batch of several calls runs as
parallel tasks that each see only their own result, so they join at the
``route`` node, which writes nothing. Either way the decision is one value, a
``StepOrder``, handed to the executor in process (``StepOrders``); an executor
that finds none (a run resumed in another process) applies the rule to the
same state again, which decides the same. ``order_step`` makes every step's
order, the plan's and a repair's too: the one place a step is measured, priced
against the cloud budget and picked for a shadow check.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.config import get_config
from langgraph.runtime import Runtime
from langgraph.types import Command, Send

from fusion_graph import prompts
from fusion_graph.context import FusionContext, ensure_context
from fusion_graph.inputs import thread_id_of
from fusion_graph.nodes.dispatch import sends
from fusion_graph.nodes.shadow import picked
from fusion_graph.providers.measure import Prepared, Sizer, StepSizes
from fusion_graph.routing.budget import BudgetCheck
from fusion_graph.routing.records import RouteRecord, StepKind, make_record
from fusion_graph.routing.score import RouteDecision, StepSignals
from fusion_graph.sizing.tokens import TokenCounter
from fusion_graph.sizing.turn import last_batch, next_route, next_step, pending_calls, step_tally
from fusion_graph.state import State

#: Every node ``route`` can send the turn to.
Destination = Literal["tools", "local", "cloud", "repair", "step_limit", "give_up", "memory", "__end__"]
#: Where the edge after a tool task can send the turn: a complete batch as ``route`` would, else to it.
AFTER_TOOLS: tuple[str, ...] = ("route", *(name for name in get_args(Destination) if name != "tools"))


def returned_directly(state: State, tools: dict[str, BaseTool]) -> bool:
    """Whether every call the batch ran is a ``return_direct`` tool (the turn ends on its result)."""
    batch = last_batch(state["messages"])
    if batch is None or not batch.tool_calls:
        return False
    if not any(call["name"] in tools and tools[call["name"]].return_direct for call in batch.tool_calls):
        return False  # what ran cannot all be return_direct: no need to look for the results
    ran = {m.tool_call_id for m in state["messages"] if isinstance(m, ToolMessage) and m.status != "error"}
    names = [call["name"] for call in batch.tool_calls if call["id"] in ran]
    return bool(names) and all(name in tools and tools[name].return_direct for name in names)


@dataclass(frozen=True)
class StepOrder:
    """One inference, decided once: the leg it starts on and why, its sizes, what the budget allows.

    The executor carries it out without deciding again; what only the call can
    tell (a provider down, a window the server says overflowed) is the chain's
    fallover and the fit rule's compaction, not a second decision.

    Attributes:
        node: The node that runs it (where a resume retries it).
        kind: ``plan``, ``step`` or ``repair``.
        step: Step index in the turn.
        turn: Turn index in the thread.
        decision: The routing decision, after the budget guard (the leg it starts on, and why).
        signals: The signals it was scored on (``None`` for a repair: never re-scored).
        sizes: Windows and estimates it was measured with.
        check: What the cloud budget allows it (binds its fallover too).
        shadow: Whether the cloud leg is asked beside it (``FusionContext.shadow_share``).
        prefer_provider: A provider to start with while healthy (a repair's).
    """

    node: str
    kind: StepKind
    step: int
    turn: int
    decision: RouteDecision
    signals: StepSignals | None
    sizes: StepSizes
    check: BudgetCheck
    shadow: bool = False
    prefer_provider: str | None = None


def over_budget(order: StepOrder, prepared: Prepared) -> tuple[RouteRecord, AIMessage]:
    """The record and the reply of a step only a cloud window can hold, when the cloud budget refuses it.

    No inference is made: the record says why, the reply tells the user what to do.
    """
    fit = prepared.plan.reason or "the local window cannot hold it"
    why = order.check.over or "over budget"
    record = make_record(
        turn=order.turn,
        step=order.step,
        kind=order.kind,
        decision=prepared.decided(order.decision),
        signals=order.signals,
        extra={"outcome": "over_budget", "cloud_budget": why, "fit": fit},
    )
    return record, AIMessage(prompts.OVER_BUDGET.format(fit=fit, why=why))


async def order_step(
    sizer: Sizer,
    state: State,
    context: FusionContext,
    *,
    node: str,
    kind: StepKind,
    step: int,
    turn: int,
    decision: RouteDecision,
    signals: StepSignals | None,
    thread_id: str,
    sizes: StepSizes | None = None,
    prefer_provider: str | None = None,
) -> StepOrder:
    """``decision`` as a step's order: measured (unless ``sizes``), guarded by the budget, shadow picked.

    The one budget rule for every step: a cloud step the cloud budget cannot pay
    for runs local, and the check binds the step's fallover.
    """
    chain = await sizer.resolver.chain(context)
    anchors = state.get("anchors") or {}
    if sizes is None:
        sizes = await sizer.measure(chain, state.get("messages", []), anchors, context)
    check = sizer.check_budget(chain, sizes, anchors, state.get("route_log", []), turn, context)
    decision = check.guard(decision)
    shadow = decision.leg == "local" and picked(thread_id, turn, step, context.shadow_share)
    return StepOrder(node, kind, step, turn, decision, signals, sizes, check, shadow, prefer_provider)


async def decide_step(
    sizer: Sizer,
    state: State,
    context: FusionContext,
    count_tokens: TokenCounter,
    tools: Sequence[BaseTool],
    *,
    plan: bool,
    turn: int,
    thread_id: str,
    node: str | None = None,
) -> StepOrder:
    """The step about to run on ``state``, decided once: measured, routed by the rule, ordered.

    The plan (``plan``: the turn's step 0), a continuation step after a batch, and a
    ``create_agent`` model call (``middleware``) are all decided here; ``node``
    defaults to the leg the order starts on.
    """
    chain = await sizer.resolver.chain(context)
    sizes = await sizer.measure(chain, state["messages"], state.get("anchors") or {}, context)
    decision, signals = next_route(
        state,
        context,
        count_tokens,
        plan=plan,
        prompt_tokens=sizes.score_tokens,
        budget=sizes.budget,
        tools=tools,
    )
    order = await order_step(
        sizer,
        state,
        context,
        node=node or decision.leg,
        kind="plan" if plan else "step",
        step=0 if plan else next_step(state),
        turn=turn,
        decision=decision,
        signals=signals,
        thread_id=thread_id,
        sizes=sizes,
    )
    if node is None and order.decision.leg != decision.leg:  # the budget guard moved it local
        order = replace(order, node=order.decision.leg)
    return order


def routing_update(
    state: Mapping[str, Any],
    decision: RouteDecision,
    context: FusionContext,
    route_log: Sequence[RouteRecord],
) -> dict[str, Any]:
    """State a step's decision moves besides the step: the escalation latch and the paced dial's tally.

    The latch (``trouble_signals``) is written only when it moved; the tally of
    ``route_log`` only when the dial is paced, so the next step counts on from it.
    """
    update: dict[str, Any] = {}
    if decision.latch != state.get("latch"):
        update["latch"] = decision.latch
    if context.pace_slack is not None:
        update["step_tally"] = step_tally(route_log, state.get("step_tally"))
    return update


@dataclass(frozen=True)
class Routed:
    """Where the turn goes after a batch and, for a step on a leg, the order that sends it there.

    Attributes:
        goto: The destination(s): a node name, ``[leg, "memory"]``, or the next wave's ``Send``s.
        order: The step's order (``None``: not a step on a leg).
        update: State the decision moves besides the step (the escalation latch, the pace's tally).
    """

    goto: Destination | list[Send | Destination]
    order: StepOrder | None = None
    update: dict[str, Any] = field(default_factory=dict)


#: A kept order's key: thread, step, id of the batch's last tool result.
OrderKey = tuple[str, int, str]
#: Decisions kept for executors at most (a step takes its own at once; this only bounds a leak).
ORDERS_KEPT = 4096


class StepOrders:
    """Decisions the edge made, kept in process for the executor that carries them out.

    Keyed by ``step_key``: the executor of that step takes it. One
    that finds none (a run resumed in another process) routes the state again:
    the rule is a function of the state, so it decides the same.
    """

    def __init__(self) -> None:
        """An empty table."""
        self._kept: OrderedDict[OrderKey, Routed] = OrderedDict()

    def give(self, key: OrderKey, routed: Routed) -> None:
        """Keep ``routed`` for the executor of ``key``."""
        self._kept[key] = routed
        while len(self._kept) > ORDERS_KEPT:
            self._kept.popitem(last=False)

    def take(self, key: OrderKey) -> Routed | None:
        """The decision kept for ``key`` (once), or ``None``."""
        return self._kept.pop(key, None)


def step_key(state: State, thread_id: str) -> OrderKey:
    """The step ``state`` is about to run, as an order's key: its thread, its step, the batch's last result.

    The last message's id (set once, by ``add_messages``) tells two runs without
    a ``thread_id`` apart.
    """
    messages = state.get("messages") or []
    last = str(messages[-1].id) if messages else ""
    return thread_id, next_step(state), last


class RouteNode:
    """The routing rule over the graph's token estimator, tools, sizer and memory switch.

    ``__call__`` is the ``route`` node (a batch's join); ``after_tools`` the edge
    that routes a one-call batch directly; ``decide`` the rule both apply.
    """

    def __init__(
        self,
        count_tokens: TokenCounter,
        tools: dict[str, BaseTool],
        memory_on: Callable[[Runtime[Any]], bool],
        sizer: Sizer,
    ) -> None:
        """Keep what the decision needs."""
        self.count_tokens, self.tools, self.memory_on, self.sizer = count_tokens, tools, memory_on, sizer
        self.orders = StepOrders()

    async def decide(self, state: State, runtime: Runtime[FusionContext], thread_id: str) -> Routed:
        """Send the next wave of the batch, end the turn, repair, or route the next step."""
        pending = pending_calls(state["messages"])
        if pending:
            return Routed(goto=list(sends(pending)))
        if returned_directly(state, self.tools):
            return Routed(goto="memory" if self.memory_on(runtime) else "__end__")
        context = ensure_context(runtime.context)
        step = next_step(state)
        if step >= context.max_steps:
            return Routed(goto="step_limit")
        if state.get("repair_error"):
            if state.get("repair_attempts", 0) >= context.max_repair_attempts:
                return Routed(goto="give_up")
            return Routed(goto="repair")
        tools = list(self.tools.values())
        turn = state.get("turn", 0)
        order = await decide_step(
            self.sizer, state, context, self.count_tokens, tools, plan=False, turn=turn, thread_id=thread_id
        )
        leg = order.decision.leg
        update = routing_update(state, order.decision, context, state.get("route_log", []))
        every = context.memory_every_k_steps
        goto: Destination | list[Send | Destination] = leg
        if every and step % every == 0 and self.memory_on(runtime):
            goto = [leg, "memory"]  # beside the next step
        return Routed(goto=goto, order=order, update=update)

    async def __call__(self, state: State, runtime: Runtime[FusionContext]) -> Command[Destination]:
        """The ``route`` node: a joined batch's decision, handed to the executor in process."""
        thread_id = thread_id_of(get_config())
        routed = await self.decide(state, runtime, thread_id)
        if routed.order is not None:
            self.orders.give(step_key(state, thread_id), routed)
        return Command(goto=routed.goto)

    async def after_tools(self, state: State, runtime: Runtime[FusionContext], config: RunnableConfig) -> Any:
        """The edge after a tool task: a batch this task completed is routed here, else it joins at ``route``.

        A task sees its own result only, so a batch of several parallel calls (or
        one with a wave still to run) is never complete from here: those join.
        """
        if pending_calls(state["messages"]):
            return "route"
        thread_id = thread_id_of(config)  # an untraced edge: ``get_config`` has no run to read
        routed = await self.decide(state, runtime, thread_id)
        if routed.order is not None:
            self.orders.give(step_key(state, thread_id), routed)
        return routed.goto
