"""The ``tools`` node: LangGraph's ``ToolNode``, one call per task, with the graph's hook around each call.

Each call of a batch runs as its own task (``Send``); every task then goes to
``route`` by a plain edge, which joins the batch and decides the next step
(the route is decided in that one place). Three things go through
``ToolNode``'s own ``awrap_tool_call`` hook (``wrap_tool_call``):

- each call runs in a ``sampling_scope``, so the records of MCP sampling
  requests answered during it (``fusion_graph.providers.sampling``) join the
  thread's ``route_log`` and ``totals`` with the call's result (a ``Command``
  update), and stream as outcome events;
- the operator's keys are scrubbed from the result before the model or the
  checkpoint sees it;
- each result is capped to ``max_tool_output_tokens`` (``fusion_graph.tools.output_cap``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool
from langgraph.prebuilt import ToolNode
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command

from fusion_graph.context import ensure_context
from fusion_graph.errors import UsageError
from fusion_graph.inputs import thread_id_of
from fusion_graph.providers.ask import ROUTE_EVENT
from fusion_graph.providers.sampling import sampling_scope
from fusion_graph.redact import scrub_content
from fusion_graph.routing.records import RouteRecord, records_totals
from fusion_graph.telemetry import switch as telemetry
from fusion_graph.tools.output_cap import cap_output


async def wrap_tool_call(
    request: ToolCallRequest,
    execute: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]],
) -> ToolMessage | Command[Any]:
    """``ToolNode``'s hook around each call: collect its sampling records, scrub and cap its result."""
    context = ensure_context(request.runtime.context)
    state = request.state if isinstance(request.state, dict) else {}
    thread_id = thread_id_of(request.runtime.config)
    call = request.tool_call
    with (
        telemetry.tool_call(call["name"], call.get("id"), thread_id),
        sampling_scope(
            turn=int(state.get("turn", 0)),
            step=int(state.get("step", 0)),
            thread_id=thread_id,
            context=context,
            route_log=state.get("route_log") or (),
        ) as scope,
    ):
        output = await execute(request)
    if isinstance(output, ToolMessage):  # the operator's keys never reach the model or the checkpoint
        scrubbed = scrub_content(output.content)
        if scrubbed != output.content:
            output = output.model_copy(update={"content": scrubbed})
    output = cast("ToolMessage | Command[Any]", cap_output(output, context.max_tool_output_tokens))
    if not scope.records:
        return output
    for record in scope.records:
        request.runtime.stream_writer({"event": ROUTE_EVENT, "phase": "outcome", **record})
    return with_records(output, scope.records)


def with_records(output: ToolMessage | Command[Any], records: Sequence[RouteRecord]) -> Command[Any]:
    """The call's result as a ``Command`` that also adds ``records`` to ``route_log`` and ``totals``.

    A request no provider answered is logged (with its attempts) but, like an
    unanswered step, adds nothing to ``totals``.
    """
    added: dict[str, Any] = {"route_log": list(records)}
    totals = records_totals(records)
    if totals:
        added["totals"] = totals
    if isinstance(output, ToolMessage):
        return Command(update={"messages": [output], **added})
    return Command(
        graph=output.graph, update=_joined(output.update, added), resume=output.resume, goto=output.goto
    )


def _joined(update: Any, added: dict[str, Any]) -> Any:
    """A tool's own ``Command.update`` (a dict or ``(key, value)`` pairs) with ``added`` after it."""
    if update is None:
        return added
    if isinstance(update, dict):
        return {**update, **added}
    if isinstance(update, list | tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in update):
        return [*update, *added.items()]  # each pair goes through the channel's reducer in order
    raise UsageError(
        f"a tool that asks for MCP sampling must return Command(update=...) as a dict or (key, value) "
        f"pairs, not {type(update).__name__}"
    )


def tools_node(tools: Sequence[BaseTool]) -> ToolNode:
    """The graph's ``tools`` node: LangGraph's ``ToolNode`` over ``tools``, ``wrap_tool_call`` its hook.

    A tool's own failure becomes an error message for the model; ``GraphBubbleUp``
    (``interrupt()``, ``Command`` to a parent) is never caught.
    """
    return ToolNode(list(tools), name="tools", handle_tool_errors=True, awrap_tool_call=wrap_tool_call)
