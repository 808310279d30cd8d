"""Token counting: what a step's prompt costs, estimated before the call.

One token estimator is used everywhere (score, fit checks, benchmarks, replay):
by default ``approximate_tokens``, a character-class estimate of what a BPE
tokenizer and a chat template make of each message; pass any
``Callable[[Sequence[BaseMessage]], int]`` (for example a real tokenizer) to
plug in another. The graph anchors it on what each leg's server last reported
(``fusion_graph.sizing.estimate``), so only what was appended since is estimated.
"""

from __future__ import annotations

import functools
import json
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, SystemMessage
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool

from fusion_graph.sizing.history_memo import HistoryMemo

TokenCounter = Callable[[Sequence[BaseMessage]], int]

#: ``response_metadata`` key of a tool result cut to ``max_tool_output_tokens`` (``{"tokens", "cut"}``).
CUT_KEY = "fusion_cut"

#: Tokens per character class, fitted by least squares on every message of the shared traces and
#: on this package's own sources as ``read_file`` shows them, against the Qwen2 and Llama-3 BPE
#: vocabularies (what llama-server counts): per word (a run of ASCII letters), per letter, per
#: digit, per ASCII punctuation mark, per non-ASCII character and per whitespace run (a newline,
#: a tab or two or more spaces: indentation). Code and JSON have more punctuation, digits and
#: indentation per character than prose, which is why a flat 4 characters per token is 15-40 %
#: low on tool output.
TOKENS_PER_WORD = 0.405
TOKENS_PER_LETTER = 0.136
TOKENS_PER_DIGIT = 0.733
TOKENS_PER_PUNCT = 0.671
TOKENS_PER_NON_ASCII = 2.594
TOKENS_PER_SPACE_RUN = 0.956
#: What a chat template adds around each message (``<|im_start|>role\n ... <|im_end|>\n``).
TOKENS_PER_MESSAGE = 5
#: The generation prompt after the last message (``<|im_start|>assistant\n``).
TOKENS_PER_PROMPT = 3
#: A chat template's preamble around bound tool schemas ("# Tools ... <tools></tools> ...").
TOKENS_PER_TOOL_BLOCK = 40
#: Fixed cost of an image block (langchain-core's default: OpenAI's low-resolution cost).
TOKENS_PER_IMAGE = 85
#: Longer texts are estimated on their first and last ``_SAMPLE_CHARS // 2`` characters, scaled.
_SAMPLE_CHARS = 262_144

_WORD = re.compile(r"[A-Za-z]+")
_DIGIT = re.compile(r"[0-9]")
_PUNCT = re.compile(r"[!-/:-@\[-`{-~]")
_NON_ASCII = re.compile(r"[^\x00-\x7f]")
_SPACE_RUN = re.compile(r"\s{2,}|[\t\n\r]")


def text_tokens(text: str) -> float:
    """Estimated tokens of ``text`` alone (no template), from its character classes."""
    if len(text) > _SAMPLE_CHARS:
        half = _SAMPLE_CHARS // 2
        return text_tokens(text[:half] + text[-half:]) * len(text) / _SAMPLE_CHARS
    if not text:  # every class counts 0 (an answer that only calls tools)
        return 0.0
    words = _WORD.findall(text)
    return (
        TOKENS_PER_WORD * len(words)
        + TOKENS_PER_LETTER * sum(map(len, words))
        + TOKENS_PER_DIGIT * len(_DIGIT.findall(text))
        + TOKENS_PER_PUNCT * len(_PUNCT.findall(text))
        + TOKENS_PER_NON_ASCII * (0 if text.isascii() else len(_NON_ASCII.findall(text)))
        + TOKENS_PER_SPACE_RUN * len(_SPACE_RUN.findall(text))
    )


def _content_tokens(content: str | list[str | dict[str, Any]]) -> float:
    if isinstance(content, str):
        return text_tokens(content)
    total = 0.0
    for block in content:
        if isinstance(block, str):
            total += text_tokens(block)
        elif block.get("type") in ("image", "image_url"):
            total += TOKENS_PER_IMAGE
        elif block.get("type") == "text":
            total += text_tokens(str(block.get("text", "")))
        else:
            total += text_tokens(repr(block))
    return total


def message_tokens(message: BaseMessage) -> int:
    """Estimated tokens of one message as a chat template renders it (content, tool calls, framing)."""
    total = _content_tokens(message.content) + TOKENS_PER_MESSAGE
    if isinstance(message, AIMessage) and message.tool_calls:
        calls = [{"name": c["name"], "arguments": json.dumps(c["args"])} for c in message.tool_calls]
        total += text_tokens(json.dumps(calls))
    return int(total + 0.5)


#: Per-message estimates of messages already seen, so a step counts only what is new.
_SEEN: OrderedDict[tuple[str, str, int, int], int] = OrderedDict()
_SEEN_LIMIT = 100_000


def _message_key(message: BaseMessage) -> tuple[str, str, int, int] | None:
    if not message.id:
        return None
    calls = len(message.tool_calls) if isinstance(message, AIMessage) else 0
    return (message.id, message.type, len(message.content), calls)


def _count(message: BaseMessage) -> int:
    """``message_tokens`` of one message, remembered by id (see ``_SEEN``)."""
    key = _message_key(message)
    count = _SEEN.get(key) if key is not None else None
    if count is None:
        count = message_tokens(message)
        if key is not None:
            _SEEN[key] = count
            if len(_SEEN) > _SEEN_LIMIT:
                _SEEN.popitem(last=False)
    return count


#: Lists already summed, by the identity of their first message: the messages and the estimate
#: of each prefix (``sums[i]`` covers the first ``i``). A history that starts with a remembered
#: list (the same message objects, or equal ones) is summed from there, so a step costs its new
#: messages plus one identity comparison of the history (in C), not a walk over it.
_PREFIXES: HistoryMemo[list[int]] = HistoryMemo()


def _running_sums(messages: Sequence[BaseMessage], start: int = 0) -> list[int]:
    sums, total = [], start
    for message in messages:
        total += _count(message)
        sums.append(total)
    return sums


def approximate_tokens(messages: Sequence[BaseMessage]) -> int:
    """The default estimator: ``message_tokens`` summed over ``messages``.

    The estimate adds up message by message, so each message (by id) is
    counted once and remembered, and so is the running sum of a history
    (``_PREFIXES``): a step costs the new messages, not the history. Messages
    are taken as immutable, as LangGraph treats them (a change is a new message).
    """
    if not messages:
        return 0
    items = messages if isinstance(messages, list) else list(messages)
    known = _PREFIXES.find(items)
    if known is not None:
        shared, sums = known  # sums[i]: the first i messages
        if shared == len(items):
            return sums[shared]
        if shared == len(sums) - 1:  # items extends the remembered history
            tail = _running_sums(items[shared:], sums[-1])
            _PREFIXES.store(items, sums + tail)
            return tail[-1]
    sums = [0, *_running_sums(items)]
    _PREFIXES.store(items, sums)
    return sums[-1]


def tool_schemas(tools: Sequence[BaseTool | dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as the OpenAI-style schemas a chat template renders."""
    return [convert_to_openai_tool(tool) for tool in tools]


@functools.lru_cache(maxsize=64)
def _schema_tokens(rendered: tuple[str, ...]) -> int:
    if not rendered:
        return 0
    return int(TOKENS_PER_TOOL_BLOCK + sum(text_tokens(text) for text in rendered) + 0.5)


#: Tool-schema estimates by tool identity: a graph binds the same tools at every step.
_TOOL_TOKENS: dict[tuple[int, ...], tuple[tuple[object, ...], int]] = {}


def tool_tokens(tools: Sequence[BaseTool | dict[str, Any]]) -> int:
    """Estimated tokens of bound tool schemas in the prompt (schemas plus the template's preamble)."""
    key = tuple(id(tool) for tool in tools)
    cached = _TOOL_TOKENS.get(key)
    if cached is not None and all(a is b for a, b in zip(cached[0], tools, strict=True)):
        return cached[1]
    count = _schema_tokens(tuple(json.dumps(schema) for schema in tool_schemas(tools)))
    if len(_TOOL_TOKENS) > 256:
        _TOOL_TOKENS.clear()
    _TOOL_TOKENS[key] = (tuple(tools), count)  # the tools are kept, so their ids stay theirs
    return count


def build_prompt(system_prompt: str, messages: Sequence[BaseMessage]) -> list[BaseMessage]:
    """The exact message list a step sends: the system prompt, then the history."""
    head: list[BaseMessage] = [SystemMessage(system_prompt)] if system_prompt else []
    return head + list(messages)


def prompt_estimate(
    system_prompt: str,
    messages: Sequence[BaseMessage],
    tools: Sequence[BaseTool | dict[str, Any]] = (),
    count_tokens: TokenCounter = approximate_tokens,
) -> int:
    """Estimated tokens of the whole prompt a step sends: system prompt, history, tool schemas.

    With no server report to anchor on, this is the estimate (``estimate.leg_estimate``).
    """
    tool_part = tool_tokens(tools) if tools else 0
    if count_tokens is approximate_tokens:
        body = system_tokens(system_prompt) + approximate_tokens(messages) + TOKENS_PER_PROMPT
    else:
        body = count_tokens(build_prompt(system_prompt, messages))
    return body + tool_part


@functools.lru_cache(maxsize=64)
def system_tokens(system_prompt: str) -> int:
    """Estimated tokens of the system prompt as a message (cached: it is the same every step)."""
    return approximate_tokens([SystemMessage(system_prompt)]) if system_prompt else 0
