"""Validation of a tool batch before anything runs (pure over messages and tools).

A batch is checked call by call: malformed calls (langchain-core's
``invalid_tool_calls``, unknown tool names, arguments that fail the tool's
schema) are not executed and send the turn to ``repair``; calls beyond
``max_tool_calls_per_step`` are trimmed; a call repeated ``loop_repeat_limit``
times in the turn trips the loop detector. Trimming and loops are *transient
notices* that raise the next step's score.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, InvalidToolCall
from langchain_core.messages.tool import ToolCall
from langchain_core.tools import BaseTool
from pydantic import BaseModel, ValidationError

from fusion_graph import prompts
from fusion_graph.routing.trouble import call_key
from fusion_graph.sizing.history_memo import HistoryMemo

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
