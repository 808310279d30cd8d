"""The trouble signals: error severity, no progress and progress events, pure over a turn's messages."""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage

from fusion_graph.nodes.tools import batch_notice
from fusion_graph.routing.score import call_key
from fusion_graph.routing.trouble import (
    ERROR_DECAY,
    ERROR_UNIT,
    NO_PROGRESS_WINDOW,
    Batch,
    TurnTrouble,
    error_severity,
    fold_trouble,
    fold_turn,
    no_progress_share,
    progress_event,
    result_kind,
    text_kind,
    turn_batches,
    turn_trouble,
)
from fusion_graph.sizing.turn import turn_fold

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


# --------------------------------------------------------------------------- incremental fold


def reference_batches(turn_messages: Sequence[BaseMessage]) -> list[Batch]:
    """The turn's batches as the whole-turn pass read them before the fold (kept verbatim to pin it)."""
    batches: list[Batch] = []
    seen: set[str] = set()
    for message in turn_messages:
        if isinstance(message, AIMessage):
            batch = Batch()
            for call in message.tool_calls:
                key = call_key(call["name"], call["args"])
                batch.keys.append(key)
                batch.new.append(key not in seen)
                batch.ids.append(call.get("id"))
                seen.add(key)
            batches.append(batch)
        elif isinstance(message, ToolMessage) and batches:
            batches[-1].results[message.tool_call_id] = result_kind(message)
    return batches


def reference_severity(batches: Sequence[Batch]) -> float:
    total = 0.0
    for age, batch in enumerate(reversed(batches)):
        total += ERROR_UNIT * ERROR_DECAY**age * batch.kinds.count("error")
    return min(total, 1.0)


def reference_progress(batches: Sequence[Batch]) -> bool:
    if not batches:
        return False
    *earlier, latest = batches
    kinds = latest.kinds
    if "pass" in kinds:
        return True
    unanswered = False
    for batch in earlier:
        done = batch.kinds
        unanswered = "error" in done or (unanswered and all(kind == "error" for kind in done))
    if unanswered and any(kind != "error" for kind in kinds):
        return True
    looped = bool(earlier) and bool(earlier[-1].keys) and not any(earlier[-1].new)
    return looped and latest.new_success()


def reference_trouble(turn_messages: Sequence[BaseMessage], window: int = NO_PROGRESS_WINDOW) -> TurnTrouble:
    """The trouble signals folded over the whole turn, as every step computed them before the fold."""
    batches = reference_batches(turn_messages)
    repeated, calls = no_progress_share([key for batch in batches for key in batch.keys], window)
    return TurnTrouble(
        error_severity=round(reference_severity(batches), 4),
        no_progress=round(repeated / calls, 4) if calls else 0.0,
        progress=reference_progress(batches),
        errors=sum(batch.kinds.count("error") for batch in batches),
        repeated=repeated,
        window=calls,
    )


def long_turn(steps: int = 120, seed: int = 7) -> list[BaseMessage]:
    """A long turn with errors (status and text), repeats, cycles, passing tests, empty and odd batches."""
    rng = random.Random(seed)
    messages: list[BaseMessage] = []
    for index in range(steps):
        roll = rng.random()
        if roll < 0.05:
            messages.append(AIMessage("thinking"))  # a batch without calls
            continue
        calls = []
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            key = f"k{index}" if rng.random() < 0.4 else f"k{rng.randrange(6)}"  # new input, or a repeat
            result: str | tuple[str, str]
            kind = rng.random()
            if kind < 0.2:
                result = (f"Error: no {key}", "error")
            elif kind < 0.3:
                result = "Traceback (most recent call last):\n  x\nValueError: bad"
            elif kind < 0.4:
                result = "==== 3 passed in 0.1s ===="
            else:
                result = f"value of {key}"
            calls.append(("lookup", {"key": key}, result))
        batch = step(*calls)
        if len(batch) > 2 and rng.random() < 0.3:
            batch = [batch[0], *reversed(batch[1:])]  # results out of call order
        if rng.random() < 0.05:  # a result sent again for the same call: the later one counts
            first = batch[1]
            assert isinstance(first, ToolMessage)
            batch.append(ToolMessage("fine now", tool_call_id=first.tool_call_id))
        messages.extend(batch)
    return messages


def test_the_long_turn_has_every_kind_of_trouble() -> None:
    messages = long_turn()
    states = [reference_trouble(messages[:end]) for end in range(len(messages) + 1)]
    assert any(0 < state.error_severity < 1 for state in states)
    assert any(state.error_severity == 1 for state in states)
    assert any(state.no_progress >= 0.5 for state in states)
    assert any(state.progress for state in states) and not all(state.progress for state in states)


@pytest.mark.parametrize("window", [NO_PROGRESS_WINDOW, 0, 3, 1000])
def test_the_fold_extended_message_by_message_is_the_whole_turn_pass(window: int) -> None:
    messages = long_turn()
    folded = fold_turn([])
    for end in range(len(messages) + 1):
        prefix = messages[:end]
        if end:
            folded = fold_turn(prefix[end - 1 :], folded)
        batches = reference_batches(prefix)
        assert list(folded.batches) == batches == turn_batches(prefix)
        assert folded.length == end
        assert (
            fold_trouble(folded, window) == reference_trouble(prefix, window) == turn_trouble(prefix, window)
        )
        assert error_severity(batches) == reference_severity(batches)  # bit for bit, before rounding
        assert progress_event(batches) is reference_progress(batches)


def test_the_remembered_fold_is_the_whole_turn_pass_on_every_prefix() -> None:
    messages = long_turn(seed=11)
    for end in range(len(messages) + 1):
        assert fold_trouble(turn_fold(messages[:end])) == reference_trouble(messages[:end])
    # Steps of several messages at once, and a repeated step (an exact hit), fold the same.
    for end in [*range(0, len(messages) + 1, 5), len(messages), len(messages)]:
        assert fold_trouble(turn_fold(messages[:end])) == reference_trouble(messages[:end])


def test_extending_a_fold_leaves_the_remembered_one_as_it_was() -> None:
    messages = long_turn(seed=3)
    end = next(i for i, m in enumerate(messages) if isinstance(m, ToolMessage))  # mid-batch
    folded = turn_fold(messages[:end])
    before = copy.deepcopy(folded)
    assert turn_fold(messages) != folded
    assert folded == before
    assert fold_trouble(turn_fold(messages[:end])) == reference_trouble(messages[:end])


def test_a_turn_whose_earlier_message_changed_is_folded_again() -> None:
    messages = long_turn(seed=5)
    assert fold_trouble(turn_fold(messages)) == reference_trouble(messages)
    index, earlier = next(
        (i, m) for i, m in enumerate(messages[:40]) if isinstance(m, ToolMessage) and m.status == "error"
    )
    replaced = [*messages[:index], earlier.model_copy(update={"status": "success"}), *messages[index + 1 :]]
    for end in (index + 1, index + 10, len(replaced)):
        assert fold_trouble(turn_fold(replaced[:end])) == reference_trouble(replaced[:end])
    # Back on the first history, and on a prefix shorter than the one remembered.
    assert fold_trouble(turn_fold(messages)) == reference_trouble(messages)
    assert fold_trouble(turn_fold(messages[:index])) == reference_trouble(messages[:index])
