"""Gather a step's routing signals from the conversation, before the call.

One token estimator is used everywhere (score, benchmarks, replay): by default
langchain-core's ``count_tokens_approximately``; pass any
``Callable[[Sequence[BaseMessage]], int]`` (for example a real tokenizer) to
plug in another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.utils import count_tokens_approximately

from fusion_graph.prompts import MEMORY_MESSAGE_NAME
from fusion_graph.routing import StepSignals

TokenCounter = Callable[[Sequence[BaseMessage]], int]


def approximate_tokens(messages: Sequence[BaseMessage]) -> int:
    """The default estimator (about four characters per token)."""
    return count_tokens_approximately(messages)


def turn_start(messages: Sequence[BaseMessage]) -> int:
    """Index of this turn's user message: the last ``HumanMessage`` (0 when none).

    The message that carries recalled memories is part of the turn, not its start.
    """
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, HumanMessage) and message.name != MEMORY_MESSAGE_NAME:
            return index
    return 0


def build_prompt(system_prompt: str, messages: Sequence[BaseMessage]) -> list[BaseMessage]:
    """The exact message list a step sends: the system prompt, then the history."""
    head: list[BaseMessage] = [SystemMessage(system_prompt)] if system_prompt else []
    return head + list(messages)


def step_signals(
    *,
    system_prompt: str,
    messages: Sequence[BaseMessage],
    step: int,
    max_steps: int,
    conversation_max_tokens: int,
    notice: bool,
    count_tokens: TokenCounter = approximate_tokens,
) -> StepSignals:
    """Measure the signals of the step about to run on ``messages``.

    The stable prefix is the system prompt, earlier turns and this turn's user
    message; tool output is every tool message after it.
    """
    start = turn_start(messages)
    prompt = build_prompt(system_prompt, messages)
    stable = build_prompt(system_prompt, messages[: start + 1])
    tool_output = [m for m in messages[start + 1 :] if isinstance(m, ToolMessage)]
    return StepSignals(
        prompt_tokens=count_tokens(prompt),
        conversation_max_tokens=conversation_max_tokens,
        step=step,
        max_steps=max_steps,
        transient_notice=notice,
        tool_output_tokens=count_tokens(tool_output) if tool_output else 0,
        stable_prefix_tokens=count_tokens(stable),
    )
