"""The ``tools`` node: LangGraph's ``ToolNode`` for one call, and the join when it is alone.

Each call of a batch runs as its own task (``Send``). When a task runs the
only call left in its batch, it routes the next step itself with the same
``RouteNode`` logic, so a one-call step costs no extra superstep; when several
calls run at once, each goes to ``route``, which joins them and decides once.
"""

from __future__ import annotations

from typing import Any, cast

from langchain_core.messages import AnyMessage
from langchain_core.messages.tool import ToolCall
from langchain_core.runnables import RunnableConfig
from langgraph.prebuilt import ToolNode
from langgraph.runtime import Runtime
from langgraph.types import Command

from fusion_graph.context import FusionContext
from fusion_graph.nodes.dispatch import next_wave
from fusion_graph.nodes.route import RouteNode
from fusion_graph.state import State
from fusion_graph.turn import pending_calls

# NOTE: the key under which LangGraph gives a task read access to the graph's
# channels; ToolNode itself reads ``Send([call])`` tasks' state through it.
_READ_KEY = "__pregel_read"


_NOT_READ = frozenset({"route_log", "totals"})


def _state_of(config: RunnableConfig) -> State:
    read = config.get("configurable", {}).get(_READ_KEY)
    if read is None:
        return cast(State, {"messages": []})
    # Everything the route decision reads; the thread's log and totals are not needed.
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
