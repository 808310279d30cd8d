"""The ``tools`` node and what happens to a tool call between the answer that asks for it and the next step.

A call is checked, dispatched, run and capped here, so the rules a batch meets
read in one place, in the order they apply:

- **The batch rules** (``check_batch``, ``plan_batch``), pure over messages and
  tools, run inside the executor that received the answer, so the rejections,
  the notice and the repair flag are written with the answer itself. Malformed
  calls (langchain-core's ``invalid_tool_calls``, unknown tool names, arguments
  that fail the tool's schema) are not executed and send the turn to
  ``repair``; calls beyond ``max_tool_calls_per_step`` are trimmed; a call
  repeated ``loop_repeat_limit`` times in the turn trips the loop detector.
  Trimming and loops are *transient notices* that raise the next step's score.
- **Dispatch** (``sends``): what passes goes to LangGraph's own ``ToolNode`` one
  call per ``Send``, as LangChain's ``create_agent`` does: each finished call is
  checkpointed on its own, interrupts and ``Command`` returns propagate, and
  ``InjectedState``, ``InjectedStore`` and ``ToolRuntime`` work. Calls that touch
  the same file run in batch order, one wave per superstep. After each task the
  routing edge (``fusion_graph.nodes.step.RouteNode``) routes a batch that task
  completed; a batch of several calls joins at the ``route`` node first.
- **The hook** (``wrap_tool_call``, ``ToolNode``'s own ``awrap_tool_call``): each
  call runs in a ``sampling_scope``, so the records of MCP sampling requests
  answered during it (``fusion_graph.providers.sampling``) join the thread's
  ``route_log`` and ``totals`` with the call's result (a ``Command`` update) and
  stream as outcome events; the operator's keys are scrubbed from the result
  before the model or the checkpoint sees it.
- **The output cap** (``cap_output``): a result longer than
  ``max_tool_output_tokens`` keeps its head and tail, with a marker saying how
  much was cut. The message is marked (``CUT_KEY``) so the next step's score
  gets the transient notice, as for a trimmed batch; the mark lives on the
  message, not in a state field, because parallel calls would each write it.
"""

from __future__ import annotations

import json
import posixpath
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from langchain_core.messages import AIMessage, BaseMessage, InvalidToolCall, ToolMessage
from langchain_core.messages.tool import ToolCall
from langchain_core.tools import BaseTool
from langgraph.prebuilt import ToolNode
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import Command, Send
from pydantic import BaseModel, ValidationError

from fusion_graph import prompts
from fusion_graph.context import FusionContext, ensure_context, sampling_scope, thread_id_of
from fusion_graph.errors import UsageError
from fusion_graph.providers.chain import ROUTE_EVENT
from fusion_graph.redact import scrub_content
from fusion_graph.routing.records import RouteRecord, records_totals
from fusion_graph.routing.score import call_key
from fusion_graph.sizing.turn import CUT_KEY, HistoryMemo, last_batch, text_tokens, turn_start
from fusion_graph.state import tool_result_id
from fusion_graph.telemetry import switch as telemetry


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
        batch = last_batch(state.get("messages") or ()) if output.id is None else None
        if batch is not None and batch.id:
            output.id = tool_result_id(batch.id, output.tool_call_id)
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


#: Argument names that say which file a call touches (calls on one file keep their order).
PATH_ARGUMENTS = ("path", "file", "file_path", "filename")


@dataclass(frozen=True)
class CheckedBatch:
    """An answer with unique call ids, and what its batch writes before any call runs."""

    answer: AIMessage
    replies: list[ToolMessage]
    notice: bool
    repair_error: str | None


def unique_call_ids(answer: AIMessage) -> AIMessage:
    """``answer`` with every tool call id present and unique within the batch.

    A provider that repeats or omits ids would otherwise have several calls
    run but only one result kept; a changed id is ``<id>-<n>`` (or ``call-<n>``).
    """
    seen: set[str] = set()

    def fresh(original: str | None, index: int) -> str:
        base = original or f"call-{index}"
        candidate, n = base, 1
        while candidate in seen:
            n += 1
            candidate = f"{base}-{n}"
        seen.add(candidate)
        return candidate

    ids = [call.get("id") for call in answer.tool_calls] + [c.get("id") for c in answer.invalid_tool_calls]
    if all(ids) and len(set(ids)) == len(ids):
        return answer
    calls = [{**call, "id": fresh(call.get("id"), i)} for i, call in enumerate(answer.tool_calls)]
    offset = len(calls)
    invalid = [
        {**bad, "id": fresh(bad.get("id"), offset + i)} for i, bad in enumerate(answer.invalid_tool_calls)
    ]
    return answer.model_copy(update={"tool_calls": calls, "invalid_tool_calls": invalid})


def check_batch(
    answer: AIMessage,
    *,
    history: Sequence[BaseMessage],
    tools: Mapping[str, BaseTool],
    context: FusionContext,
) -> CheckedBatch:
    """Apply the batch rules to a new answer; ``history`` is the state before it."""
    answer = unique_call_ids(answer)
    if not (answer.tool_calls or answer.invalid_tool_calls):
        return CheckedBatch(answer, [], False, None)
    batch = plan_batch(
        answer,
        tools=tools,
        earlier_in_turn=history[turn_start(history) + 1 :],
        max_calls=context.max_tool_calls_per_step,
        loop_repeat_limit=context.loop_repeat_limit,
    )
    replies = [
        ToolMessage(content=r.message, tool_call_id=r.call_id, name=r.name, status="error")
        for r in batch.rejected
    ]
    malformed = batch.malformed
    error = "; ".join(r.message for r in malformed) if malformed else None
    return CheckedBatch(answer, replies, batch.notice, error)


def touched_file(call: ToolCall) -> str | None:
    """The file a call names (see ``PATH_ARGUMENTS``), normalised lexically, or ``None``.

    ``a``, ``./a``, ``.//a`` and ``sub/../a`` are one file, so calls naming it run in order.
    """
    args: Any = call.get("args")
    if not isinstance(args, dict):
        return None
    for key in PATH_ARGUMENTS:
        value = args.get(key)
        if isinstance(value, str) and value.strip():
            return posixpath.normpath(value.strip().replace("\\", "/"))
    return None


def next_wave(pending: Sequence[ToolCall]) -> list[ToolCall]:
    """The pending calls that may start now: all but later calls on a file an earlier one touches."""
    wave, busy = [], set()
    for call in pending:
        path = touched_file(call)
        if path is not None:
            if path in busy:
                continue
            busy.add(path)
        wave.append(call)
    return wave


def sends(pending: Sequence[ToolCall], node: str = "tools") -> list[Send]:
    """One ``Send`` per call of the next wave; ``ToolNode`` reads the state itself."""
    return [Send(node, [call]) for call in next_wave(pending)]


__all__ = [
    "BatchPlan",
    "Rejected",
    "batch_notice",
    "call_key",
    "malformed_call_message",
    "plan_batch",
    "prior_call_counts",
    "schema_error",
]


@dataclass(frozen=True)
class Rejected:
    """A call that will not run, and the tool message the model gets instead."""

    call_id: str
    name: str
    message: str
    malformed: bool
    """True for errors the model must repair (as opposed to trim/loop notices)."""


@dataclass
class BatchPlan:
    """What to do with one AI message's tool calls."""

    run: list[ToolCall] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    trimmed: bool = False
    loop_fired: bool = False

    @property
    def malformed(self) -> list[Rejected]:
        """Rejections that need a repair step."""
        return [r for r in self.rejected if r.malformed]

    @property
    def notice(self) -> bool:
        """Whether this batch raises the transient-notice term."""
        return self.trimmed or self.loop_fired


def _count_calls(counts: Counter[str], messages: Sequence[BaseMessage]) -> Counter[str]:
    for message in messages:
        if isinstance(message, AIMessage):
            for call in message.tool_calls:
                counts[call_key(call["name"], call["args"])] += 1
    return counts


#: Turns already counted, by the identity of their first message: the messages and the counts.
#: A turn that extends a remembered one (the same message objects, or equal ones) counts only
#: its new messages, so a step does not re-encode every earlier call of the turn.
_COUNTED: HistoryMemo[tuple[int, Counter[str]]] = HistoryMemo()


def prior_call_counts(turn_messages: Sequence[BaseMessage]) -> Counter[str]:
    """How often each (name, arguments) was requested earlier in the turn (a new ``Counter``)."""
    if not turn_messages:
        return Counter()
    items = turn_messages if isinstance(turn_messages, list) else list(turn_messages)
    known = _COUNTED.find(items)
    if known is not None:
        shared, (length, counted) = known
        if length == shared:  # items extends (or is) the remembered turn: count only what is new
            counts = _count_calls(counted.copy(), items[shared:])
            _COUNTED.store(items, (len(items), counts))
            return counts.copy()
    counts = _count_calls(Counter(), items)
    _COUNTED.store(items, (len(items), counts))
    return counts.copy()


def schema_error(tool: BaseTool, args: dict[str, Any]) -> str | None:
    """Why ``args`` do not fit the tool's call schema, or ``None`` when they do."""
    schema = tool.tool_call_schema
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        try:
            schema.model_validate(args)
        except ValidationError as error:
            details = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(arguments)'}: {e['msg']}" for e in error.errors()
            )
            return f"arguments do not match the schema of {tool.name}: {details}"
        return None
    if isinstance(schema, dict):
        required = schema.get("required", [])
        missing = [key for key in required if key not in args]
        if missing:
            return f"arguments of {tool.name} are missing required fields: {', '.join(missing)}"
    return None


def malformed_call_message(bad: InvalidToolCall) -> str:
    """What the model is told about a call whose arguments did not parse, so it can send it again.

    One wording for the graph's repair and the ``create_agent`` middleware, which
    answers such a call itself: the raw arguments are quoted so the model sees what broke.
    """
    return (
        f"Malformed tool call {bad.get('name')!r}: "
        f"{bad.get('error') or 'arguments are not valid JSON'}. "
        f"Raw arguments: {bad.get('args')!r}. Send the call again with valid JSON arguments."
    )


def plan_batch(
    message: AIMessage,
    *,
    tools: Mapping[str, BaseTool],
    earlier_in_turn: Sequence[BaseMessage],
    max_calls: int,
    loop_repeat_limit: int,
) -> BatchPlan:
    """Decide, for each call of ``message``, whether it runs or what the model is told.

    Args:
        message: The AI message whose batch is checked.
        tools: Tools by name.
        earlier_in_turn: Messages of this turn before ``message`` (for the loop detector).
        max_calls: ``max_tool_calls_per_step``.
        loop_repeat_limit: Repetitions of one call that trip the loop detector.
    """
    plan = BatchPlan()
    for bad in message.invalid_tool_calls:
        plan.rejected.append(
            Rejected(
                call_id=bad.get("id") or "",
                name=bad.get("name") or "",
                message=malformed_call_message(bad),
                malformed=True,
            )
        )
    counts = prior_call_counts(earlier_in_turn)
    valid: list[ToolCall] = []
    for call in message.tool_calls:
        if not isinstance(call.get("args"), dict):
            text = (
                f"Malformed tool call {call['name']!r}: arguments must be a JSON object, got "
                f"{type(call.get('args')).__name__} {call.get('args')!r}. Send the call again with an "
                "object of named arguments."
            )
            plan.rejected.append(Rejected(call["id"] or "", call["name"], text, True))
            continue
        tool = tools.get(call["name"])
        if tool is None:
            known = ", ".join(sorted(tools)) or "(none)"
            plan.rejected.append(
                Rejected(
                    call["id"] or "",
                    call["name"],
                    f"Unknown tool {call['name']!r}. Available tools: {known}.",
                    True,
                )
            )
            continue
        error = schema_error(tool, call["args"])
        if error is not None:
            plan.rejected.append(
                Rejected(call["id"] or "", call["name"], error + ". Fix the arguments and call again.", True)
            )
            continue
        valid.append(call)
    for index, call in enumerate(valid):
        key = call_key(call["name"], call["args"])
        counts[key] += 1
        if index >= max_calls:
            plan.trimmed = True
            text = prompts.TRIMMED.format(requested=len(valid), limit=max_calls)
            plan.rejected.append(Rejected(call["id"] or "", call["name"], text, False))
        elif counts[key] >= loop_repeat_limit:
            plan.loop_fired = True
            text = prompts.LOOP_CORRECTION.format(
                name=call["name"], args=json.dumps(call["args"], sort_keys=True), count=counts[key]
            )
            plan.rejected.append(Rejected(call["id"] or "", call["name"], text, False))
        else:
            plan.run.append(call)
    return plan


def batch_notice(
    message: AIMessage,
    *,
    earlier_in_turn: Sequence[BaseMessage],
    max_calls: int,
    loop_repeat_limit: int,
) -> bool:
    """Whether ``message``'s batch trips trimming or the loop detector, treating every call as valid.

    For replaying recorded conversations, where tool schemas are unknown: the
    graph itself plans batches with the real tools (``plan_batch``).
    """
    counts = prior_call_counts(earlier_in_turn)
    for index, call in enumerate(message.tool_calls):
        key = call_key(call["name"], call["args"])
        counts[key] += 1
        if index >= max_calls or counts[key] >= loop_repeat_limit:
            return True
    return False


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
