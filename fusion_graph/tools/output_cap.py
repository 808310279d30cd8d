"""Tool output caps: a result longer than ``max_tool_output_tokens`` keeps its head and tail.

The cut text carries a marker saying how much was cut, and the message is
marked (``CUT_KEY``) so the next step's score gets the transient notice, as
for a trimmed batch. The mark lives on the message, not in a state field,
because parallel calls would each write it.
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import ToolMessage
from langgraph.types import Command

from fusion_graph.sizing.tokens import CUT_KEY, text_tokens

#: Estimated tokens of the marker itself, kept out of the limit so a cut result stays under it.
_MARKER_TOKENS = 40


def cut_text(text: str, limit: int) -> tuple[str, int, int] | None:
    """``text`` cut to about ``limit`` tokens, keeping its head and tail, or ``None`` when it fits.

    Returns the cut text, its estimated tokens before and the tokens cut.
    """
    tokens = int(text_tokens(text) + 0.5)
    if tokens <= limit:
        return None
    keep = max(limit - _MARKER_TOKENS, limit // 2)
    chars = int(len(text) * keep / tokens)
    head_end, tail_start = chars // 2, len(text) - (chars - chars // 2)
    line = text.rfind("\n", 0, head_end)
    head_end = line + 1 if line > head_end * 0.8 else head_end
    line = text.find("\n", tail_start)
    tail_start = line + 1 if 0 <= line < tail_start + (len(text) - tail_start) * 0.2 else tail_start
    cut = max(tokens - keep, 0)
    marker = (
        f"\n\n[... about {cut:,} of {tokens:,} tokens cut here: the tool result was longer than "
        f"max_tool_output_tokens={limit:,} ...]\n\n"
    )
    return text[:head_end] + marker + text[tail_start:], tokens, cut


def cap_message(message: Any, limit: int) -> Any:
    """A ``ToolMessage`` with text content cut to ``limit`` tokens and marked; anything else as is."""
    if not isinstance(message, ToolMessage) or not isinstance(message.content, str):
        return message
    cut = cut_text(message.content, limit)
    if cut is None:
        return message
    text, tokens, removed = cut
    metadata = {**message.response_metadata, CUT_KEY: {"tokens": tokens, "cut": removed, "limit": limit}}
    return message.model_copy(update={"content": text, "response_metadata": metadata})


def cap_output(output: Any, limit: int) -> Any:
    """``ToolNode``'s output with every tool result cut to ``limit`` (plain updates and ``Command``s)."""
    if isinstance(output, list):
        return [cap_output(item, limit) for item in output]
    if isinstance(output, Command) and isinstance(output.update, dict) and "messages" in output.update:
        update = {**output.update, "messages": cap_output(output.update["messages"], limit)}
        return Command(graph=output.graph, update=update, resume=output.resume, goto=output.goto)
    if isinstance(output, dict) and "messages" in output:
        messages = output["messages"]
        capped = [cap_message(m, limit) for m in messages] if isinstance(messages, list) else messages
        return {**output, "messages": capped}
    return cap_message(output, limit)
