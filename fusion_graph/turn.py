"""Read the turn in progress out of graph state (pure helpers the nodes and edges share)."""

from __future__ import annotations

from collections.abc import Sequence

from langchain_core.messages import AIMessage, BaseMessage

from fusion_graph.context import FusionContext
from fusion_graph.routing import RouteDecision, StepSignals, decide_leg, score_step
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


def continuation_route(
    state: State, context: FusionContext, count_tokens: TokenCounter = approximate_tokens
) -> tuple[RouteDecision, StepSignals]:
    """Score and route the next continuation step.

    The routing edge and the executor node both call this on the same state, so
    the node records exactly the decision the edge took.
    """
    step = next_step(state)
    signals = step_signals(
        system_prompt=context.system_prompt,
        messages=state["messages"],
        step=step,
        max_steps=context.max_steps,
        conversation_max_tokens=context.conversation_max_tokens,
        notice=state.get("notice", False),
        count_tokens=count_tokens,
    )
    decision = decide_leg(
        mode=context.mode,
        step=step,
        current_leg=state.get("leg"),
        score=score_step(signals),
        cloud_share=context.cloud_share,
        hysteresis=context.hysteresis,
    )
    return decision, signals


def plan_route(
    state: State, context: FusionContext, count_tokens: TokenCounter = approximate_tokens
) -> tuple[RouteDecision, StepSignals]:
    """Route step 0 (the plan): cloud whenever ``cloud_share > 0`` in fusion."""
    signals = step_signals(
        system_prompt=context.system_prompt,
        messages=state["messages"],
        step=0,
        max_steps=context.max_steps,
        conversation_max_tokens=context.conversation_max_tokens,
        notice=False,
        count_tokens=count_tokens,
    )
    decision = decide_leg(
        mode=context.mode,
        step=0,
        current_leg=None,
        score=score_step(signals),
        cloud_share=context.cloud_share,
        hysteresis=context.hysteresis,
    )
    return decision, signals
