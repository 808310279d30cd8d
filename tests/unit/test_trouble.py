"""The trouble signals: error severity, no progress and progress events, pure over a turn's messages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage

from fusion_graph.tools.batch import batch_notice
from fusion_graph.trouble import (
    ERROR_UNIT,
    NO_PROGRESS_WINDOW,
    call_key,
    no_progress_share,
    result_kind,
    text_kind,
    turn_trouble,
)

_ids = iter(range(1_000_000))


def step(*calls: tuple[str, dict[str, Any], str | tuple[str, str]]) -> list[BaseMessage]:
    """One batch: an AI message with ``calls`` and their results; a result is text, or (text, status)."""
    ai_calls, results = [], []
    for name, args, result in calls:
        call_id = f"id{next(_ids)}"
        ai_calls.append({"name": name, "args": args, "id": call_id, "type": "tool_call"})
        text, status = result if isinstance(result, tuple) else (result, "success")
        results.append(ToolMessage(text, tool_call_id=call_id, name=name, status=status))
    return [AIMessage("", tool_calls=ai_calls), *results]


def ok(key: str = "a") -> tuple[str, dict[str, Any], str]:
    return ("lookup", {"key": key}, f"value of {key}")


def failing(key: str = "a") -> tuple[str, dict[str, Any], tuple[str, str]]:
    return ("lookup", {"key": key}, (f"Error: ValueError('no {key}')\n Please fix your mistakes.", "error"))


def turn(*batches: list[BaseMessage]) -> list[BaseMessage]:
    return [message for batch in batches for message in batch]


# --------------------------------------------------------------------------- result kinds


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("Error: flight HAT030 not available on date 2024-05-13", id="tau-bench-error"),
        pytest.param("ERROR: no such file", id="shell-error"),
        pytest.param(
            'Traceback (most recent call last):\n  File "x.py", line 1\nZeroDivisionError: division by zero',
            id="traceback",
        ),
        pytest.param("running...\nSyntaxError: invalid syntax", id="exception-line"),
        pytest.param("json.decoder.JSONDecodeError: Expecting value", id="dotted-exception"),
        pytest.param("ERRORS:\n- E999 IndentationError: unexpected indent", id="lint-syntax-error"),
        pytest.param("make: *** [all] Error 2\nexit code 2", id="exit-code"),
        pytest.param("Command exited with status 1", id="exit-status"),
        pytest.param("returned non-zero exit status 127", id="non-zero-exit"),
        pytest.param("=== 1 failed, 4 passed in 0.2s ===", id="pytest-failure-beats-passed"),
        pytest.param("FAILED (failures=1)", id="unittest-failure"),
    ],
)
def test_error_patterns(text: str) -> None:
    assert text_kind(text) == "error"


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("===== 12 passed in 0.31s =====", id="pytest"),
        pytest.param("Tests:       5 passed, 5 total", id="jest"),
        pytest.param("......\n----\nRan 6 tests in 0.004s\n\nOK", id="unittest"),
        pytest.param("ok  \texample.com/pkg\t0.012s", id="go-test"),
        pytest.param("=== RUN   TestX\n--- PASS: TestX (0.00s)\nPASS", id="go-test-verbose"),
    ],
)
def test_passing_test_output(text: str) -> None:
    assert text_kind(text) == "pass"


@pytest.mark.parametrize(
    "text",
    [
        pytest.param('{"name": {"first_name": "Mia"}}', id="json"),
        pytest.param("Transfer successful", id="plain"),
        pytest.param("1466:            raise ValueError(msg)", id="source-listing"),
        pytest.param("1480:        except (TypeError, ValueError) as error:", id="source-except"),
        pytest.param("done, exit code 0", id="exit-0"),
        pytest.param("no errors found", id="errors-word"),
    ],
)
def test_ordinary_output_is_ok(text: str) -> None:
    assert text_kind(text) == "ok"


def test_an_error_status_is_an_error_whatever_the_text() -> None:
    assert result_kind(ToolMessage("all good", tool_call_id="x", status="error")) == "error"
    assert result_kind(ToolMessage("all good", tool_call_id="x")) == "ok"
    assert result_kind(ToolMessage([{"type": "text", "text": "Error: x"}], tool_call_id="x")) == "error"


# --------------------------------------------------------------------------- error severity


@pytest.mark.parametrize(
    ("batches", "expected"),
    [
        pytest.param([step(ok())], 0.0, id="no-error"),
        pytest.param([step(failing())], ERROR_UNIT, id="one-fresh-error"),
        pytest.param([step(failing()), step(failing("b"))], 0.75, id="errors-on-two-steps"),
        pytest.param([step(failing(), failing("b"))], 1.0, id="two-errors-in-one-batch"),
        pytest.param([step(failing()), step(ok())], 0.25, id="error-then-success"),
        pytest.param([step(failing()), step(ok()), step(ok("b"))], 0.125, id="older-weighs-less"),
        pytest.param([step(failing(), failing("b"), failing("c"))], 1.0, id="clipped-to-1"),
    ],
)
def test_error_severity_weighs_recent_and_repeated_errors_more(
    batches: list[list[BaseMessage]], expected: float
) -> None:
    assert turn_trouble(turn(*batches)).error_severity == expected


def test_a_text_error_counts_like_an_error_status() -> None:
    text_error = step(("search", {"q": "x"}, "Error: flight HAT030 not available"))
    assert turn_trouble(text_error).error_severity == ERROR_UNIT
    assert turn_trouble(text_error).errors == 1


# --------------------------------------------------------------------------- no progress


def cycle(length: int, laps: int) -> list[BaseMessage]:
    """A turn that repeats ``length`` distinct calls ``laps`` times, one call per step, all succeeding."""
    return turn(*(step(ok(f"k{i}")) for _ in range(laps) for i in range(length)))


@pytest.mark.parametrize("length", [2, 3, 8])
def test_loops_of_2_3_and_8_steps_are_caught(length: int) -> None:
    first_lap = turn_trouble(cycle(length, 1))
    assert (first_lap.no_progress, first_lap.repeated) == (0.0, 0)
    two_laps = turn_trouble(cycle(length, 2))
    window = min(NO_PROGRESS_WINDOW, 2 * length)
    assert two_laps.repeated == min(length, window)
    assert two_laps.no_progress == round(min(length, window) / window, 4)
    assert two_laps.no_progress >= 0.5
    # After enough laps every call of the window was already seen.
    assert turn_trouble(cycle(length, 2 + NO_PROGRESS_WINDOW // length)).no_progress == 1.0


@pytest.mark.parametrize("length", [3, 8])
def test_the_loop_detector_misses_cycles_longer_than_its_repeat_count(length: int) -> None:
    # Two laps of a 3- or 8-step cycle repeat each call only twice: the default detector (3) never fires.
    history = cycle(length, 2)
    fired = [
        batch_notice(m, earlier_in_turn=history[:i], max_calls=8, loop_repeat_limit=3)
        for i, m in enumerate(history)
        if isinstance(m, AIMessage)
    ]
    assert not any(fired)
    assert turn_trouble(history).no_progress >= 0.5


def test_abab_counts_half_the_window_after_two_laps() -> None:
    trouble = turn_trouble(cycle(2, 2))
    assert (trouble.repeated, trouble.window, trouble.no_progress) == (2, 4, 0.5)


def test_distinct_calls_make_no_progress_term() -> None:
    assert turn_trouble(turn(*(step(ok(f"k{i}")) for i in range(20)))).no_progress == 0.0


def test_arguments_are_compared_canonically() -> None:
    assert call_key("f", {"a": 1, "b": 2}) == call_key("f", {"b": 2, "a": 1})
    same = turn(step(("f", {"a": 1, "b": 2}, "x")), step(("f", {"b": 2, "a": 1}, "x")))
    assert turn_trouble(same).repeated == 1


def test_the_window_counts_repeats_of_calls_before_it() -> None:
    keys = [f"k{i}" for i in range(10)] + ["k0", "k1"]
    assert no_progress_share(keys, window=8) == (2, 8)
    assert no_progress_share([], window=8) == (0, 0)


# --------------------------------------------------------------------------- progress events


@pytest.mark.parametrize(
    ("batches", "expected"),
    [
        pytest.param([step(failing()), step(ok())], True, id="success-after-an-error"),
        pytest.param([step(failing()), step(failing("a"))], False, id="error-after-an-error"),
        pytest.param([step(failing()), step(failing("b")), step(ok("c"))], True, id="success-after-errors"),
        pytest.param([step(ok()), step(ok("b"))], False, id="success-without-errors"),
        pytest.param([step(failing()), step(ok("b")), step(ok("c"))], False, id="the-error-was-answered"),
        pytest.param([step(failing()), step(ok("a"))], True, id="a-retry-that-succeeds"),
        pytest.param(
            [step(ok()), step(("bash", {"command": "pytest"}, "==== 3 passed in 0.1s ===="))],
            True,
            id="passing-tests",
        ),
        pytest.param(
            [step(failing()), step(failing("b"), ok("c"))], True, id="a-success-beside-an-error-counts"
        ),
        pytest.param([step(ok("a")), step(ok("b")), step(ok("a")), step(ok("c"))], True, id="loop-broken"),
        pytest.param([step(ok("a")), step(ok("b")), step(ok("a")), step(ok("b"))], False, id="still-looping"),
        pytest.param([], False, id="no-batch"),
    ],
)
def test_progress_events(batches: list[list[BaseMessage]], expected: bool) -> None:
    assert turn_trouble(turn(*batches)).progress is expected


def test_the_trouble_of_an_empty_turn_is_none() -> None:
    trouble = turn_trouble([HumanMessage("hi")])
    assert (trouble.error_severity, trouble.no_progress, trouble.progress) == (0.0, 0.0, False)


def test_results_are_found_by_call_id_whatever_their_order() -> None:
    batch: Sequence[BaseMessage] = step(failing("a"), ok("b"))
    reordered = [batch[0], batch[2], batch[1]]
    assert turn_trouble(reordered) == turn_trouble(batch)
