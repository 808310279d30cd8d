"""Compaction: make a conversation fit when no provider's window can hold it.

Done the way LangChain's agents do it, with its own pieces: first
``ClearToolUsesEdit`` (LangChain's context-editing middleware, after
Anthropic's ``clear_tool_uses``) replaces the oldest tool outputs with a
placeholder, keeping the most recent ones and every message's place; if that
is not enough, the most recent ones too; last, ``trim_messages`` drops the
oldest messages so the history starts at a user message. Each stage runs only
if the one before freed too little, because any compaction changes the
prefix every server has cached.

Pure: it returns the compacted history and the state changes that make it
so (``add_messages`` replaces a message with the same id and drops a
``RemoveMessage``'s), and the executor records the event.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain.agents.middleware.context_editing import ClearToolUsesEdit
from langchain_core.messages import AnyMessage, BaseMessage, RemoveMessage, trim_messages

from fusion_graph.sizing.turn import TokenCounter

#: Tool outputs the first stage keeps whole (the most recent ones).
KEEP_RECENT_OUTPUTS = 2
#: What a cleared tool output reads.
PLACEHOLDER = "[tool output cleared to fit the context window]"
#: Compaction frees this much more than asked, so the estimate's error does not bring it back.
MARGIN = 0.1


@dataclass(frozen=True)
class Compaction:
    """A compacted history and what it took.

    Attributes:
        messages: The history to send from now on.
        changes: State updates for ``messages`` (replacements with the same ids, ``RemoveMessage``).
        cleared: Tool outputs replaced by the placeholder.
        removed: Messages dropped from the start of the history.
        freed: Estimated tokens freed.
        need: Tokens that had to be freed.
    """

    messages: list[BaseMessage]
    changes: list[BaseMessage] = field(default_factory=list)
    cleared: int = 0
    removed: int = 0
    freed: int = 0
    need: int = 0

    @property
    def enough(self) -> bool:
        """Whether it freed what was needed."""
        return self.freed >= self.need

    def summary(self) -> dict[str, Any]:
        """The recorded event."""
        return {"cleared_tool_outputs": self.cleared, "removed_messages": self.removed}


def _clear(messages: list[AnyMessage], need: int, keep: int, count: TokenCounter) -> list[AnyMessage]:
    edit = ClearToolUsesEdit(trigger=0, clear_at_least=need, keep=keep, placeholder=PLACEHOLDER)
    cleared = list(messages)
    edit.apply(cleared, count_tokens=count)
    return cleared


def compact(messages: Sequence[BaseMessage], *, need: int, count_tokens: TokenCounter) -> Compaction:
    """Free at least ``need`` tokens (estimated) from ``messages``, in as few stages as possible."""
    goal = int(need * (1 + MARGIN)) + 1
    before = count_tokens(messages)
    current: list[AnyMessage] = list(messages)  # type: ignore[arg-type]
    for keep in (KEEP_RECENT_OUTPUTS, 0):
        current = _clear(current, goal - (before - count_tokens(current)), keep, count_tokens)
        if before - count_tokens(current) >= goal:
            break
    else:
        kept = trim_messages(
            current,
            max_tokens=max(count_tokens(current) - goal, 1),
            token_counter=count_tokens,
            strategy="last",
            start_on="human",
            allow_partial=False,
        )
        if kept:
            current = list(kept)  # type: ignore[arg-type]
    kept_ids = {message.id for message in current}
    originals = {message.id: message for message in messages}
    changes: list[BaseMessage] = [message for message in current if originals.get(message.id) is not message]
    removed = [message for message in messages if message.id not in kept_ids]
    changes += [RemoveMessage(id=message.id) for message in removed if message.id]
    cleared = sum(1 for message in current if originals.get(message.id) is not message)
    return Compaction(
        messages=list(current),
        changes=changes,
        cleared=cleared,
        removed=len(removed),
        freed=before - count_tokens(current),
        need=need,
    )
