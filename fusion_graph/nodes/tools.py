"""The ``tools`` node: LangGraph's ``ToolNode`` for one call, and the join when it is alone.

Each call of a batch runs as its own task (``Send``). When a task runs the
only call left in its batch, it routes the next step itself with the same
``RouteNode`` logic, so a one-call step costs no extra superstep; when several
calls run at once, each goes to ``route``, which joins them and decides once.

A result longer than ``max_tool_output_tokens`` keeps its head and tail with a
marker saying how much was cut, and is marked (``signals.CUT_KEY``) so the next
step's score gets the transient notice, as for a trimmed batch. The mark lives
on the message, not in a state field, because parallel calls would each write it.
"""

from __future__ import annotations

from typing import Any, cast

from langchain_core.messages import AnyMessage, ToolMessage
from langchain_core.messages.tool import ToolCall
from langchain_core.runnables import RunnableConfig
from langgraph.prebuilt import ToolNode
from langgraph.runtime import Runtime
from langgraph.types import Command

from fusion_graph.context import FusionContext, ensure_context
from fusion_graph.nodes.dispatch import next_wave
from fusion_graph.nodes.route import RouteNode
from fusion_graph.signals import CUT_KEY, text_tokens
from fusion_graph.state import State
from fusion_graph.turn import pending_calls

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


# NOTE: the key under which LangGraph gives a task read access to the graph's
# channels; ToolNode itself reads ``Send([call])`` tasks' state through it.
_READ_KEY = "__pregel_read"


_NOT_READ = frozenset({"totals"})


def _state_of(config: RunnableConfig) -> State:
    read = config.get("configurable", {}).get(_READ_KEY)
    if read is None:
        return cast(State, {"messages": []})
    # Everything the route decision reads (the paced dial counts the route log); totals are not needed.
    fields = [name for name in read.args[1] if name not in _NOT_READ and not name.startswith("__")]
    return cast(State, read(fields, True))


class ToolStep:
    """Runs one call through ``ToolNode``; the lone call of a batch also routes the next step."""

    def __init__(self, tool_node: ToolNode, route: RouteNode) -> None:
        """Wrap LangGraph's ``ToolNode`` and the graph's ``route`` logic."""
        self.tool_node, self.route = tool_node, route

    async def __call__(
        self, calls: list[ToolCall], config: RunnableConfig, runtime: Runtime[FusionContext]
    ) -> Any:
        """Run the call; go to ``route`` unless it was the batch's only one left."""
        state = _state_of(config)
        alone = [c["id"] for c in next_wave(pending_calls(state["messages"]))] == [c["id"] for c in calls]
        output = await self.tool_node.ainvoke(calls, config)
        output = cap_output(output, ensure_context(runtime.context).max_tool_output_tokens)
        if not alone or not isinstance(output, dict) or len(pending_calls(state["messages"])) != 1:
            return _to_route(output)
        added: list[AnyMessage] = list(output.get("messages", []))
        after = cast(State, {**state, "messages": [*state["messages"], *added]})
        decided = await self.route(after, runtime)
        update = {"messages": added, **(cast(dict[str, Any], decided.update) or {})}
        return Command(update=update, goto=decided.goto)


def _to_route(output: Any) -> Any:
    """``ToolNode``'s output, continued at ``route`` (the join)."""
    if isinstance(output, dict):
        return Command(update=output, goto="route")
    if isinstance(output, list):  # Commands from tools (and maybe plain updates): keep them all
        return [*output, Command(goto="route")]
    return output
