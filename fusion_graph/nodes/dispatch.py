"""Tool dispatch: check a batch when the answer arrives, then run each call as its own task.

The batch rules run inside the executor that received the answer (so the
rejections, the notice and the repair flag are written with the answer
itself). What passes goes to LangGraph's own ``ToolNode`` one call per ``Send``,
as LangChain's ``create_agent`` does: each finished call is checkpointed on its
own, interrupts and ``Command`` returns propagate, and ``InjectedState``,
``InjectedStore`` and ``ToolRuntime`` work. Calls that touch the same file run
in batch order, one wave per superstep.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.messages.tool import ToolCall
from langchain_core.tools import BaseTool
from langgraph.types import Send

from fusion_graph.context import FusionContext
from fusion_graph.sizing.turn import turn_start
from fusion_graph.tools.batch import plan_batch

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
