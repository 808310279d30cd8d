"""Tool-batch validation: malformed calls, trimming and the loop detector."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, tool

from fusion_graph import prompts
from fusion_graph.nodes.tools import BatchPlan, Rejected, call_key, plan_batch, prior_call_counts
from fusion_graph.sizing.turn import turn_start
from tests.plugins.fakes import ai_calls, call


@tool
def echo(text: str) -> str:
    """Echo the text back."""
    return text


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


TOOLS: dict[str, BaseTool] = {"echo": echo, "add": add}


def plan(
    message: AIMessage,
    *,
    earlier: Sequence[BaseMessage] = (),
    max_calls: int = 8,
    loop_repeat_limit: int = 3,
) -> BatchPlan:
    return plan_batch(
        message,
        tools=TOOLS,
        earlier_in_turn=earlier,
        max_calls=max_calls,
        loop_repeat_limit=loop_repeat_limit,
    )


def test_a_valid_batch_runs_in_order() -> None:
    message = ai_calls(call("echo", {"text": "a"}, "1"), call("add", {"a": 1, "b": 2}, "2"))
    result = plan(message)
    assert [c["id"] for c in result.run] == ["1", "2"]
    assert result.rejected == []
    assert (result.trimmed, result.loop_fired, result.notice, result.malformed) == (False, False, False, [])


def test_unknown_tool_is_malformed_and_lists_the_tools() -> None:
    result = plan(ai_calls(call("nope", {}, "x1"), call("echo", {"text": "ok"}, "x2")))
    assert [c["id"] for c in result.run] == ["x2"]
    assert result.malformed == result.rejected
    (rejected,) = result.rejected
    assert (rejected.call_id, rejected.name, rejected.malformed) == ("x1", "nope", True)
    assert "Unknown tool 'nope'" in rejected.message
    assert "Available tools: add, echo." in rejected.message
    assert not result.notice


@pytest.mark.parametrize(
    ("args", "needle"),
    [({"a": "not a number", "b": 2}, "a: Input should be a valid integer"), ({"a": 1}, "b: Field required")],
)
def test_schema_failure_is_malformed_and_names_the_field(args: dict[str, object], needle: str) -> None:
    result = plan(ai_calls(call("add", args, "s1")))
    assert result.run == []
    (rejected,) = result.malformed
    assert rejected.call_id == "s1"
    assert "do not match the schema of add" in rejected.message
    assert needle in rejected.message
    assert rejected.message.endswith("Fix the arguments and call again.")


def test_invalid_tool_calls_are_malformed_with_the_raw_arguments() -> None:
    message = AIMessage(
        content="",
        invalid_tool_calls=[
            {
                "name": "echo",
                "args": '{"text": ',
                "id": "bad1",
                "error": "truncated JSON",
                "type": "invalid_tool_call",
            }
        ],
    )
    result = plan(message)
    assert result.run == []
    (rejected,) = result.malformed
    assert (rejected.call_id, rejected.name) == ("bad1", "echo")
    assert "Malformed tool call 'echo': truncated JSON" in rejected.message
    assert repr('{"text": ') in rejected.message


def test_invalid_tool_call_without_error_text_gets_a_default_reason() -> None:
    message = AIMessage(
        content="",
        invalid_tool_calls=[
            {"name": None, "args": "{", "id": None, "error": None, "type": "invalid_tool_call"}
        ],
    )
    (rejected,) = plan(message).malformed
    assert rejected.call_id == ""
    assert "arguments are not valid JSON" in rejected.message


def test_batch_over_the_limit_is_trimmed() -> None:
    calls = [call("echo", {"text": str(i)}, f"t{i}") for i in range(5)]
    result = plan(ai_calls(*calls), max_calls=2)
    assert [c["id"] for c in result.run] == ["t0", "t1"]
    assert [r.call_id for r in result.rejected] == ["t2", "t3", "t4"]
    assert result.trimmed and result.notice
    assert result.malformed == []
    expected = prompts.TRIMMED.format(requested=5, limit=2)
    assert all(r.message == expected and not r.malformed for r in result.rejected)
    assert "asked for 5 tool calls and at most 2 run" in expected


def test_trimming_counts_only_valid_calls() -> None:
    message = ai_calls(
        call("nope", {}, "u"), call("echo", {"text": "a"}, "a"), call("echo", {"text": "b"}, "b")
    )
    result = plan(message, max_calls=2)
    assert [c["id"] for c in result.run] == ["a", "b"]
    assert not result.trimmed
    assert len(result.malformed) == 1


def earlier_turn(*texts: str) -> list[BaseMessage]:
    """AI messages each calling ``echo(text)``, with their tool results."""
    out: list[BaseMessage] = []
    for i, text in enumerate(texts):
        out.append(ai_calls(call("echo", {"text": text}, f"e{i}")))
        out.append(ToolMessage(content=text, tool_call_id=f"e{i}"))
    return out


def test_loop_detector_fires_exactly_at_the_limit() -> None:
    repeat = ai_calls(call("echo", {"text": "same"}, "now"))
    below = plan(repeat, earlier=earlier_turn("same"), loop_repeat_limit=3)
    assert [c["id"] for c in below.run] == ["now"]
    assert not below.loop_fired and not below.notice

    at_limit = plan(repeat, earlier=earlier_turn("same", "same"), loop_repeat_limit=3)
    assert at_limit.run == []
    assert at_limit.loop_fired and at_limit.notice
    (rejected,) = at_limit.rejected
    assert not rejected.malformed
    assert rejected.message == prompts.LOOP_CORRECTION.format(name="echo", args='{"text": "same"}', count=3)
    assert "requested 3 times" in rejected.message


def test_loop_detector_counts_repeats_within_one_batch() -> None:
    message = ai_calls(call("echo", {"text": "x"}, "1"), call("echo", {"text": "x"}, "2"))
    result = plan(message, loop_repeat_limit=2)
    assert [c["id"] for c in result.run] == ["1"]
    assert result.loop_fired
    assert [r.call_id for r in result.rejected] == ["2"]


def test_loop_detector_ignores_other_arguments_and_earlier_turns() -> None:
    now = ai_calls(call("echo", {"text": "same"}, "now"))
    history: list[BaseMessage] = [
        HumanMessage("first turn"),
        *earlier_turn("same", "same"),
        AIMessage("done"),
        HumanMessage("second turn"),
        *earlier_turn("other"),
        now,
    ]
    earlier = history[turn_start(history) + 1 : -1]
    result = plan(now, earlier=earlier, loop_repeat_limit=2)
    assert [c["id"] for c in result.run] == ["now"]
    assert not result.loop_fired
    # The same history counted as one turn would trip it.
    assert plan(now, earlier=history[:-1], loop_repeat_limit=2).loop_fired


def test_call_key_is_canonical() -> None:
    assert call_key("add", {"a": 1, "b": 2}) == call_key("add", {"b": 2, "a": 1})
    assert call_key("add", {"a": 1, "b": 2}) != call_key("add", {"a": 2, "b": 1})
    assert call_key("add", {"a": 1}) != call_key("echo", {"a": 1})
    counts = prior_call_counts(
        [ai_calls(call("add", {"a": 1, "b": 2}, "1")), ai_calls(call("add", {"b": 2, "a": 1}, "2"))]
    )
    assert counts[call_key("add", {"a": 1, "b": 2})] == 2


@pytest.mark.parametrize(
    ("trimmed", "loop_fired", "notice"),
    [(False, False, False), (True, False, True), (False, True, True), (True, True, True)],
)
def test_notice_property(trimmed: bool, loop_fired: bool, notice: bool) -> None:
    assert BatchPlan(trimmed=trimmed, loop_fired=loop_fired).notice is notice


def test_malformed_rejections_alone_are_not_a_notice() -> None:
    batch = BatchPlan(rejected=[Rejected("1", "nope", "bad", True), Rejected("2", "echo", "trimmed", False)])
    assert [r.call_id for r in batch.malformed] == ["1"]
    assert not batch.notice
