"""Count a step's prompt the way the server that will receive it counts.

A character estimate of the whole history drifts with the tokenizer, the chat
template and the tool schemas. Each leg's server reports the exact
``prompt_tokens`` of every request it answers, so the estimate for the next
request on that leg is that report (a ``PromptAnchor`` in graph state) plus an
estimate of only the messages appended since. Without an anchor (a thread's
first request on a leg, or after compaction), the graph asks llama-server to
render and tokenize the prompt (``providers.llama_server.count_prompt_tokens``) or, for other
servers, estimates the whole prompt with its tool schemas
(``sizing.tokens.prompt_estimate``).

Pure functions over plain data; the graph's ``providers.measure.Sizer`` does the I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from langchain_core.messages import BaseMessage
from langchain_core.tools import BaseTool

from fusion_graph.sizing.tokens import TokenCounter, approximate_tokens, prompt_estimate, tool_schemas
from fusion_graph.state import PromptAnchor

Basis = Literal["anchored", "server", "approximate"]


@dataclass(frozen=True)
class Estimate:
    """A step's prompt on one leg, and what the number rests on.

    ``basis``: ``anchored`` (the leg's last report plus the appended messages),
    ``server`` (llama-server tokenized this very prompt) or ``approximate``.
    """

    tokens: int
    basis: Basis
    appended: int = field(default=0, compare=False)
    """Estimated tokens appended since the anchor (``anchored`` only): what the estimator guessed."""


def fingerprint(system_prompt: str, tools: Sequence[BaseTool | dict[str, Any]]) -> str:
    """What a request carries besides the history: the system prompt and the tool schemas."""
    digest = hashlib.sha256(system_prompt.encode())
    for schema in tool_schemas(tools):
        digest.update(json.dumps(schema, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def anchor_holds(anchor: PromptAnchor | None, messages: Sequence[BaseMessage], key: str) -> bool:
    """Whether ``anchor`` still describes a prefix of ``messages`` sent with the same extras."""
    if anchor is None or anchor["fingerprint"] != key:
        return False
    count = anchor["messages"]
    if count < 1 or count > len(messages):
        return False
    return messages[count - 1].id == anchor["last_id"]


def leg_estimate(
    messages: Sequence[BaseMessage],
    *,
    system_prompt: str,
    tools: Sequence[BaseTool | dict[str, Any]],
    anchor: PromptAnchor | None,
    key: str,
    count_tokens: TokenCounter = approximate_tokens,
) -> Estimate:
    """The prompt of a step on one leg: anchored when the anchor holds, else approximated."""
    if anchor is not None and anchor_holds(anchor, messages, key):
        appended = messages[anchor["messages"] :]
        added = count_tokens(appended) if appended else 0
        return Estimate(anchor["prompt_tokens"] + added, "anchored", added)
    return Estimate(prompt_estimate(system_prompt, messages, tools, count_tokens), "approximate")


def new_anchor(
    *, prompt_tokens: int | None, messages: Sequence[BaseMessage], key: str, provider: str
) -> PromptAnchor | None:
    """The anchor a server's report leaves (``None`` when it reported nothing to anchor on)."""
    if not prompt_tokens or not messages:
        return None
    return PromptAnchor(
        prompt_tokens=prompt_tokens,
        messages=len(messages),
        last_id=messages[-1].id,
        fingerprint=key,
        provider=provider,
    )


def relative_error(estimate: int, reported: int | None) -> float | None:
    """``(estimate - reported) / reported``, or ``None`` without a report."""
    if not reported:
        return None
    return (estimate - reported) / reported
