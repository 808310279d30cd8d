"""The ``tools`` node: LangGraph's ``ToolNode`` for one call, and the join when it is alone.

Each call of a batch runs as its own task (``Send``). When a task runs the
only call left in its batch, it routes the next step itself with the same
``RouteNode`` logic, so a one-call step costs no extra superstep; when several
calls run at once, each goes to ``route``, which joins them and decides once.

Three things go through ``ToolNode``'s own ``awrap_tool_call`` hook: each
result is capped to ``max_tool_output_tokens`` (``fusion_graph.tools.output_cap``);
the state ``ToolNode`` read for the call is kept, so the lone call of a
batch can route the next step without reading the graph's channels itself;
and each call runs in a ``sampling_scope``, so the records of MCP sampling
requests answered during it (``fusion_graph.providers.sampling``) join the
thread's ``route_log`` and ``totals`` with the call's result.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from typing import Any, Literal, Union, cast

from langchain_core.messages import AnyMessage, ToolMessage
from langchain_core.tools import BaseTool
from langgraph.config import get_config
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.runtime import Runtime
from langgraph.types import Command

from fusion_graph.context import FusionContext, ensure_context
from fusion_graph.nodes.dispatch import make_tool_node, next_wave
from fusion_graph.nodes.route import RouteNode
from fusion_graph.providers.ask import ROUTE_EVENT
from fusion_graph.providers.records import totals_of
from fusion_graph.providers.sampling import sampling_scope
from fusion_graph.redact import scrub_content
from fusion_graph.state import RouteRecord, State, add_totals
from fusion_graph.tools.output_cap import cap_output
from fusion_graph.turn import pending_calls

#: Every node a tool task can continue at.
AfterTool = Literal["route", "local", "cloud", "repair", "step_limit", "give_up", "memory", "__end__"]

#: The states ``ToolNode`` read for the calls of this task (set per task; the hook appends).
_SEEN_STATE: ContextVar[list[Any] | None] = ContextVar("fusion_tool_state", default=None)
#: The sampling records of the calls of this task (set per task; the hook appends).
_SAMPLED: ContextVar[list[RouteRecord] | None] = ContextVar("fusion_tool_sampled", default=None)


class ToolStep:
    """Runs one call through ``ToolNode``; the lone call of a batch also routes the next step."""

    def __init__(self, tools: Sequence[BaseTool], route: RouteNode) -> None:
        """LangGraph's ``ToolNode`` over ``tools`` (outputs capped by its own hook), and ``route``."""
        self.tool_node = make_tool_node(tools, awrap_tool_call=self._wrap)
        self.route = route

    async def _wrap(
        self,
        request: ToolCallRequest,
        execute: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]],
    ) -> ToolMessage | Command[Any]:
        """``ToolNode``'s hook around each call: keep the state it read, collect sampling, scrub, cap."""
        seen = _SEEN_STATE.get()
        if seen is not None:
            seen.append(request.state)
        context = ensure_context(request.runtime.context)
        state = request.state if isinstance(request.state, dict) else {}
        thread = (request.runtime.config.get("configurable") or {}).get("thread_id")
        with sampling_scope(
            turn=int(state.get("turn", 0)),
            step=int(state.get("step", 0)),
            thread_id=str(thread or "default"),
            context=context,
            route_log=state.get("route_log") or (),
        ) as scope:
            output = await execute(request)
        sampled = _SAMPLED.get()
        if scope.records and sampled is not None:
            sampled.extend(scope.records)
            for record in scope.records:
                request.runtime.stream_writer({"event": ROUTE_EVENT, "phase": "outcome", **record})
        if isinstance(output, ToolMessage):  # the operator's keys never reach the model or the checkpoint
            output = output.model_copy(update={"content": scrub_content(output.content)})
        limit = context.max_tool_output_tokens
        return cast("ToolMessage | Command[Any]", cap_output(output, limit))

    async def __call__(
        self, state: Any, runtime: Runtime[FusionContext]
    ) -> Union[Command[AfterTool], list[Any], Any]:  # noqa: UP007 - LangGraph reads Command in a Union
        """Run the call; go to ``route`` unless it was the batch's only one left.

        ``state`` is the ``Send`` payload: a list with one tool call, as ``ToolNode`` takes it
        (named as LangGraph's node protocol names a node's input).
        """
        seen: list[Any] = []
        sampled: list[RouteRecord] = []
        token, sampled_token = _SEEN_STATE.set(seen), _SAMPLED.set(sampled)
        try:
            output = await self.tool_node.ainvoke(state, get_config())
        finally:
            _SEEN_STATE.reset(token)
            _SAMPLED.reset(sampled_token)
        records = _records_update(sampled)
        if not seen or not isinstance(output, dict):
            return _to_route(output, records)
        read = cast(State, seen[0])
        pending = pending_calls(read["messages"])
        alone = [c["id"] for c in next_wave(pending)] == [c["id"] for c in state]
        if not alone or len(pending) != 1:
            return _to_route(output, records)
        added: list[AnyMessage] = list(output.get("messages", []))
        after = cast(State, {**read, "messages": [*read["messages"], *added]})
        if records:  # the router reads the log as it will be (its step tally counts records)
            after["route_log"] = [*read.get("route_log", []), *sampled]
        decided = await self.route(after, runtime)
        update = _merged({"messages": added, **records}, cast(dict[str, Any], decided.update) or {})
        return Command(update=update, goto=decided.goto)


def _records_update(records: list[RouteRecord]) -> dict[str, Any]:
    """A state update adding sampling records to ``route_log``, and those answered to ``totals``.

    A request no provider answered is logged (with its attempts) but, like an
    unanswered step, adds nothing to ``totals``.
    """
    if not records:
        return {}
    totals: dict[str, Any] = {}
    for record in records:
        if record["provider"] is not None:
            totals = add_totals(totals, totals_of(record))
    return {"route_log": list(records), "totals": totals} if totals else {"route_log": list(records)}


def _merged(update: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """``update`` and ``more`` as one update: ``route_log`` entries appended, ``totals`` added."""
    merged = {**update, **more}
    if "route_log" in update and "route_log" in more:
        merged["route_log"] = [*update["route_log"], *more["route_log"]]
    if "totals" in update and "totals" in more:
        merged["totals"] = add_totals(update["totals"], more["totals"])
    return merged


def _to_route(output: Any, records: dict[str, Any] | None = None) -> Any:
    """``ToolNode``'s output (and the sampling ``records`` update), continued at ``route`` (the join)."""
    records = records or {}
    if isinstance(output, dict):
        return Command(update=_merged(output, records), goto="route")
    if isinstance(output, list):  # Commands from tools (and maybe plain updates): keep them all
        return [*output, Command(update=records or None, goto="route")]
    return output
