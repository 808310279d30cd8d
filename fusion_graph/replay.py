"""Replay a recorded conversation through the router, exactly as the graph would route it.

Benchmarks, calibration and notebooks call this instead of re-implementing the
loop: it drives the graph's own ``plan_route``/``continuation_route`` with the
state the graph would hold before each assistant message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from langchain_core.messages import AIMessage, AnyMessage, BaseMessage, SystemMessage

from fusion_graph.batch import batch_notice
from fusion_graph.context import FusionContext
from fusion_graph.routing import Leg, RouteDecision, StepSignals
from fusion_graph.signals import TokenCounter, approximate_tokens, turn_start
from fusion_graph.state import State
from fusion_graph.turn import continuation_route, plan_route


@dataclass(frozen=True)
class ReplayedStep:
    """The route of one assistant message of a recorded conversation."""

    position: int
    """Index of the assistant message in the input list."""
    step: int
    """Index of the step within its turn (0 is the plan)."""
    decision: RouteDecision
    signals: StepSignals

    @property
    def leg(self) -> Leg:
        """The leg the step was routed to."""
        return self.decision.leg


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
) -> list[ReplayedStep]:
    """Route every assistant message of ``messages`` in order.

    A leading system message replaces ``context.system_prompt``. The notice
    term is recomputed from each batch (trimming, repeated calls), treating
    every call as valid since tool schemas are not recorded. Steps past
    ``max_steps`` are still routed (turn depth clipped to 1), where the graph
    would have ended the turn.
    """
    system, body = split_system(messages)
    if system:
        context = dataclasses.replace(context, system_prompt=system)
    offset = len(messages) - len(body)
    routed: list[ReplayedStep] = []
    leg: Leg | None = None
    notice = False
    for index, message in enumerate(body):
        if not isinstance(message, AIMessage):
            continue
        history = body[:index]
        in_turn = history[turn_start(history) + 1 :]
        step = sum(isinstance(m, AIMessage) for m in in_turn)
        state: State = {"messages": cast(list[AnyMessage], history), "step": step - 1, "notice": notice}
        if step == 0:
            decision, signals = plan_route(state, context, count_tokens)
        else:
            if leg is not None:
                state["leg"] = leg
            decision, signals = continuation_route(state, context, count_tokens)
        leg = decision.leg
        # The batch this answer asks for sets the notice term of the next step.
        notice = batch_notice(
            message,
            earlier_in_turn=in_turn,
            max_calls=context.max_tool_calls_per_step,
            loop_repeat_limit=context.loop_repeat_limit,
        )
        routed.append(ReplayedStep(index + offset, step, decision, signals))
    return routed
