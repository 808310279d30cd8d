"""Read the turn in progress out of graph state (pure helpers the nodes and edges share)."""

from __future__ import annotations

from collections.abc import Sequence

from langchain_core.messages import AIMessage, BaseMessage

from fusion_graph.context import FusionContext
from fusion_graph.routing import Leg, RouteDecision, StepSignals, decide_leg, score_step
from fusion_graph.signals import TokenCounter, approximate_tokens, step_signals, turn_start
from fusion_graph.state import State


def turn_messages(messages: Sequence[BaseMessage]) -> Sequence[BaseMessage]:
    """Messages after this turn's user message."""
    return messages[turn_start(messages) + 1 :]


def last_ai(messages: Sequence[BaseMessage]) -> AIMessage | None:
    """The last message when it is an AI message."""
    if messages and isinstance(messages[-1], AIMessage):
        return messages[-1]
    return None


def wants_tools(message: AIMessage | None) -> bool:
    """Whether an answer carries tool calls (valid or malformed) that need a tool step."""
    return message is not None and bool(message.tool_calls or message.invalid_tool_calls)


def next_step(state: State) -> int:
    """Index of the inference about to run."""
    return state.get("step", 0) + 1


def route_step(
    state: State,
    context: FusionContext,
    *,
    step: int,
    notice: bool,
    current_leg: Leg | None,
    count_tokens: TokenCounter = approximate_tokens,
) -> tuple[RouteDecision, StepSignals]:
    """Measure the signals of ``step`` on ``state``'s messages, score them and pick the leg."""
    signals = step_signals(
        system_prompt=context.system_prompt,
        messages=state["messages"],
        step=step,
        max_steps=context.max_steps,
        conversation_max_tokens=context.conversation_max_tokens,
        notice=notice,
        count_tokens=count_tokens,
    )
    decision = decide_leg(
        mode=context.mode,
        step=step,
        current_leg=current_leg,
        score=score_step(signals),
        cloud_share=context.cloud_share,
        hysteresis=context.hysteresis,
    )
    return decision, signals


def continuation_route(
    state: State, context: FusionContext, count_tokens: TokenCounter = approximate_tokens
) -> tuple[RouteDecision, StepSignals]:
    """Score and route the next continuation step.

    The routing edge and the executor node both call this on the same state, so
    the node records exactly the decision the edge took.
    """
    return route_step(
        state,
        context,
        step=next_step(state),
        notice=state.get("notice", False),
        current_leg=state.get("leg"),
        count_tokens=count_tokens,
    )


def plan_route(
    state: State, context: FusionContext, count_tokens: TokenCounter = approximate_tokens
) -> tuple[RouteDecision, StepSignals]:
    """Route step 0 (the plan): cloud whenever ``cloud_share > 0`` in fusion."""
    return route_step(state, context, step=0, notice=False, current_leg=None, count_tokens=count_tokens)
