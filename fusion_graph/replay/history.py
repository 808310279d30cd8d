"""Replay a recorded conversation through the router, exactly as the graph would route it.

Benchmarks, calibration and notebooks call this instead of re-implementing the
loop: it drives the graph's own ``sizing.turn.next_route`` and budget guard with the
state the graph would hold before each assistant message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from langchain_core.messages import AIMessage, AnyMessage, BaseMessage, SystemMessage
from langchain_core.tools import BaseTool

from fusion_graph.context import FusionContext
from fusion_graph.nodes.tools import batch_notice
from fusion_graph.routing.records import RouteRecord, StepKind, make_record
from fusion_graph.routing.rule import (
    StepPrice,
    check_budget,
    cloud_budget,
    conversation_budget,
    expected_completion,
)
from fusion_graph.routing.score import Leg, RouteDecision, StepSignals
from fusion_graph.sizing.turn import TokenCounter, approximate_tokens, next_route, step_tally, turn_start
from fusion_graph.state import State, StepTally


@dataclass(frozen=True)
class ReplayedStep:
    """The route of one assistant message of a recorded conversation."""

    position: int
    """Index of the assistant message in the input list."""
    step: int
    """Index of the step within its turn (0 is the plan)."""
    decision: RouteDecision
    signals: StepSignals
    cost_usd: float | None = None
    """A cloud step's cost by the graph's rule (its completion capped by the budget), when priced."""

    @property
    def leg(self) -> Leg:
        """The leg the step was routed to."""
        return self.decision.leg


def step_price(cloud_cost: Callable[[int, int], float | None], prompt_tokens: int) -> StepPrice:
    """A step's cloud price from ``route_history``'s ``cloud_cost(prompt, completion)``."""
    prompt_usd = cloud_cost(prompt_tokens, 0)
    million = cloud_cost(prompt_tokens, 1_000_000)
    token_usd = (million - prompt_usd) / 1_000_000 if million is not None and prompt_usd is not None else None
    return StepPrice(prompt_usd, token_usd)


def split_system(messages: Sequence[BaseMessage]) -> tuple[str, list[BaseMessage]]:
    """A leading system message becomes the system prompt (the graph keeps it out of state)."""
    if messages and isinstance(messages[0], SystemMessage):
        return messages[0].text, list(messages[1:])
    return "", list(messages)


def route_history(
    messages: Sequence[BaseMessage],
    context: FusionContext,
    *,
    count_tokens: TokenCounter = approximate_tokens,
    tools: Sequence[BaseTool] = (),
    local_window: int | None = None,
    cloud_cost: Callable[[int, int], float | None] | None = None,
) -> list[ReplayedStep]:
    """Route every assistant message of ``messages`` in order.

    ``tools`` are the schemas the graph would bind (counted in each prompt
    estimate), ``local_window`` llama-server's per-slot window (the context
    budget is its usable part unless ``conversation_max_tokens`` is set; unknown:
    ``conversation_max_tokens`` or 32,768). Replays have no server reports, so
    every prompt is estimated from the messages.

    A leading system message replaces ``context.system_prompt``. The notice
    term is recomputed from each batch (trimming, repeated calls), treating
    every call as valid since tool schemas are not recorded. Steps past
    ``max_steps`` are still routed (turn depth clipped to 1), where the graph
    would have ended the turn. The route log the graph would hold (a record per
    step, no provider) is rebuilt as it goes, so the paced dial counts the same steps.
    With ``trouble_signals`` the escalation latch is carried from step to step as
    the ``route`` node keeps it in ``State.latch`` (each decision's ``latch``,
    reset at each plan), so latched steps replay as the graph routed them.

    ``cloud_cost(prompt_tokens, completion_tokens)`` prices a step on cloud; with
    it, the context's cloud budgets (``turn_cloud_budget_usd``,
    ``thread_cloud_budget_usd``) apply by the graph's rule: a step is priced
    before its call with the whole completion budget (``max_completion_tokens``),
    and a cloud step's record then costs its recorded completion, so the spend
    that later steps see is what the trace would have cost.
    """
    system, body = split_system(messages)
    if system:
        context = dataclasses.replace(context, system_prompt=system)
    offset = len(messages) - len(body)
    budget = conversation_budget(context.conversation_max_tokens, local_window, context.max_completion_tokens)
    routed: list[ReplayedStep] = []
    leg: Leg | None = None
    latch: int | None = None  # the escalation latch (trouble_signals), kept as the route node keeps it
    notice = False
    route_log: list[RouteRecord] = []
    tally: StepTally | None = None  # the paced dial's running count, kept as the route node keeps it
    turn = -1
    limit = cloud_budget(
        operator_turn=None,
        operator_thread=None,
        run_turn=context.turn_cloud_budget_usd,
        run_thread=context.thread_cloud_budget_usd,
    )
    for index, message in enumerate(body):
        if not isinstance(message, AIMessage):
            continue
        history = body[:index]
        in_turn = history[turn_start(history) + 1 :]
        step = sum(isinstance(m, AIMessage) for m in in_turn)
        state: State = {
            "messages": cast(list[AnyMessage], history),
            "step": step - 1,
            "notice": notice,
            "route_log": route_log,
        }
        if tally is not None:
            state["step_tally"] = tally
        if step == 0:
            turn += 1
        elif leg is not None:
            state["leg"] = leg
        if step > 0 and latch is not None:  # the plan starts its turn unlatched
            state["latch"] = latch
        decision, signals = next_route(
            state, context, count_tokens, plan=step == 0, budget=budget, tools=tools
        )
        cost: float | None = None
        written = count_tokens([message])
        cap: int | None = None
        if cloud_cost is not None and limit.limited and decision.leg == "cloud":
            ceiling = context.max_completion_tokens
            check = check_budget(
                limit,
                route_log,
                turn,
                step_price(cloud_cost, signals.prompt_tokens),
                expected=expected_completion(route_log, ceiling=ceiling),
                ceiling=ceiling,
            )
            decision, cap = check.guard(decision), check.max_tokens
        if cloud_cost is not None and decision.leg == "cloud":
            # A call capped by the budget writes no more than the cap: the trace's answer is cut there.
            written = min(written, cap) if cap is not None else written
            cost = cloud_cost(signals.prompt_tokens, written)
        leg, latch = decision.leg, decision.latch
        kind: StepKind = "plan" if step == 0 else "step"
        record = make_record(
            turn=turn,
            step=step,
            kind=kind,
            leg=leg,
            decision=decision,
            signals=signals,
            provider=None,
            answer=None,
        )
        record["cost_usd"] = cost
        record["completion_tokens"] = written  # what the recorded answer wrote: the next steps' expectation
        route_log.append(record)
        if context.pace_slack is not None:
            tally = step_tally(route_log, tally)
        # The batch this answer asks for sets the notice term of the next step.
        notice = batch_notice(
            message,
            earlier_in_turn=in_turn,
            max_calls=context.max_tool_calls_per_step,
            loop_repeat_limit=context.loop_repeat_limit,
        )
        routed.append(ReplayedStep(index + offset, step, decision, signals, cost))
    return routed
