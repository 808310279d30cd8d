"""Gather a step's routing signals from the conversation, before the call.

One token estimator is used everywhere (score, benchmarks, replay): by default
langchain-core's ``count_tokens_approximately``; pass any
``Callable[[Sequence[BaseMessage]], int]`` (for example a real tokenizer) to
plug in another.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.messages.utils import count_tokens_approximately

from fusion_graph.prompts import MEMORY_MESSAGE_NAME
from fusion_graph.routing import StepSignals

TokenCounter = Callable[[Sequence[BaseMessage]], int]


#: Per-message estimates of messages already seen, so a step counts only what is new.
_SEEN: OrderedDict[tuple[str, str, int, int], int] = OrderedDict()
_SEEN_LIMIT = 100_000


def _message_key(message: BaseMessage) -> tuple[str, str, int, int] | None:
    if not message.id:
        return None
    calls = len(message.tool_calls) if isinstance(message, AIMessage) else 0
    return (message.id, message.type, len(message.content), calls)


def approximate_tokens(messages: Sequence[BaseMessage]) -> int:
    """The default estimator: langchain-core's ``count_tokens_approximately`` (about 4 characters a token).

    That estimate adds up message by message, so each message (by id) is
    counted once and remembered: a step costs the new messages, not the history.
    """
    total = 0
    for message in messages:
        key = _message_key(message)
        count = _SEEN.get(key) if key is not None else None
        if count is None:
            count = count_tokens_approximately([message])
            if key is not None:
                _SEEN[key] = count
                if len(_SEEN) > _SEEN_LIMIT:
                    _SEEN.popitem(last=False)
        total += count
    return total


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
    tool_output = [m for m in messages[start + 1 :] if isinstance(m, ToolMessage)]
    if count_tokens is approximate_tokens:
        # The default estimate adds up per message: one pass gives all three counts.
        system = _system_tokens(system_prompt)
        stable_tokens = system + approximate_tokens(messages[: start + 1])
        prompt_tokens = stable_tokens + approximate_tokens(messages[start + 1 :])
        output_tokens = approximate_tokens(tool_output)
    else:
        prompt_tokens = count_tokens(build_prompt(system_prompt, messages))
        stable_tokens = count_tokens(build_prompt(system_prompt, messages[: start + 1]))
        output_tokens = count_tokens(tool_output) if tool_output else 0
    return StepSignals(
        prompt_tokens=prompt_tokens,
        conversation_max_tokens=conversation_max_tokens,
        step=step,
        max_steps=max_steps,
        transient_notice=notice,
        tool_output_tokens=output_tokens,
        stable_prefix_tokens=stable_tokens,
    )


@functools.lru_cache(maxsize=64)
def _system_tokens(system_prompt: str) -> int:
    return approximate_tokens([SystemMessage(system_prompt)]) if system_prompt else 0
