"""The live view of ``fusion-graph run`` at 80 columns, pinned by a snapshot of a recorded event stream;
its rows and the per-provider counts after the turn agree."""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from rich.console import Console

from fusion_graph.cli import run as cli_run
from fusion_graph.cli.app import app
from fusion_graph.cli.live import ANSWER_EVENT, ROUTE_EVENT, TOKENS_EVENT, StepTable, attempt_label
from fusion_graph.context import FusionContext
from fusion_graph.settings import FusionSettings
from tests.plugins.fakes import scripted
from tests.unit.cli.test_traces import runner

SNAPSHOT = Path(__file__).resolve().parent / "snapshots" / "live_table_80.txt"
REGENERATE = "UPDATE_SNAPSHOTS=1 .venv/bin/pytest -q tests/unit/cli/test_live.py"


def decision(step: int, kind: str, routed: str, score: int | None, threshold: float | None, reason: str):  # type: ignore[no-untyped-def]
    return {
        "event": ROUTE_EVENT,
        "phase": "decision",
        "turn": 1,
        "step": step,
        "kind": kind,
        "routed_leg": routed,
        "score": score,
        "threshold": threshold,
        "reason": reason,
        "slot": 0 if routed == "local" else None,
    }


def outcome(start: dict[str, Any], leg: str, provider: str | None, **fields: Any) -> dict[str, Any]:
    latency = fields.pop("latency_s", None)
    return {
        **start,
        "phase": "outcome",
        "leg": leg,
        "provider": provider,
        "attempts": fields.pop("attempts", []),
        "outcome": {"latency_s": latency} if latency is not None else {},
        **fields,
    }


def answer(start: dict[str, Any], *tools: str, finish_reason: str = "stop") -> dict[str, Any]:
    return {
        "event": ANSWER_EVENT,
        "turn": start["turn"],
        "step": start["step"],
        "kind": start["kind"],
        "tools": list(tools),
        "finish_reason": finish_reason,
    }


def failed(leg: str, kind: str, message: str) -> dict[str, Any]:
    return {"provider": f"{leg}:m", "leg": leg, "error": "X", "kind": kind, "message": message}


def tokens(start: dict[str, Any], chunks: int) -> dict[str, Any]:
    return {"event": TOKENS_EVENT, "step": start["step"], "kind": start["kind"], "chunks": chunks}


def recorded_stream() -> list[dict[str, Any]]:
    """A second turn: a folded memory job, a plan, fallovers both ways, a repair, a cut answer."""
    memory = {
        "event": ROUTE_EVENT,
        "phase": "outcome",
        "turn": 0,
        "step": 2,
        "kind": "memory",
        "routed_leg": "local",
        "leg": "local",
        "provider": "local:qwen",
        "attempts": [],
        "score": None,
        "threshold": None,
        "reason": "memory job turn_memories on the local leg",
        "prompt_tokens": 3100,
        "cached_tokens": 3072,
        "cost_usd": 0.0,
        "outcome": {"latency_s": 1.92},
    }
    plan = decision(0, "plan", "cloud", 41, None, "plan step: cloud (cloud_share 30 > 0)")
    one = decision(1, "step", "local", 12, 60, "score 12 < 60 (T=70 - h=10): back to local")
    two = decision(2, "step", "cloud", 77, 60, "score 77 >= 60 (T=70 - h=10): cloud")
    three = decision(3, "step", "local", 30, 80, "score 30 < 80 (T=70 + h=10): stays local")
    four = decision(
        4, "repair", "cloud", None, None, "repair 1/2 of a malformed tool call: kept on the cloud leg"
    )
    five = decision(
        5,
        "step",
        "local",
        25,
        80,
        "score 25 < 80 (T=70 + h=10): stays local; context pressure 0.41, tool result of 6120 "
        "tokens, no transient notice, 3 local steps in a row",
    )
    return [
        memory,
        plan,
        tokens(plan, 40),
        outcome(
            plan,
            "cloud",
            "cloud:gpt-4o-mini",
            prompt_tokens=2400,
            cached_tokens=None,
            cost_usd=0.00042,
            latency_s=1.31,
        ),
        answer(plan, "read_file", "list_dir"),
        one,
        outcome(
            one, "local", "local:qwen", prompt_tokens=5210, cached_tokens=2380, cost_usd=0.0, latency_s=2.05
        ),
        answer(one, "replace_in_file"),
        two,
        outcome(
            two,
            "local",
            "local:qwen",
            prompt_tokens=6020,
            cached_tokens=5200,
            cost_usd=0.0,
            latency_s=3.4,
            attempts=[failed("cloud", "server_error", "Error code: 503 - service unavailable")],
        ),
        answer(two, "read_file"),
        three,
        outcome(
            three,
            "cloud",
            "cloud:gpt-4o-mini",
            prompt_tokens=123456,
            cached_tokens=118000,
            cost_usd=0.0123,
            latency_s=61.7,
            attempts=[failed("local", "timeout", "local:qwen gave no answer within request_timeout=60 s")],
        ),
        answer(three, "read_file", "replace_in_file", "read_file"),
        four,
        outcome(
            four,
            "cloud",
            "cloud:gpt-4o-mini",
            prompt_tokens=6400,
            cached_tokens=6144,
            cost_usd=0.000503,
            latency_s=0.9,
        ),
        answer(four, "replace_in_file"),
        five,
        tokens(five, 512),
        outcome(
            five, "local", "local:qwen", prompt_tokens=7100, cached_tokens=6400, cost_usd=0.0, latency_s=14.2
        ),
        answer(five, finish_reason="length"),
    ]


def rendered(table: StepTable, width: int = 80) -> str:
    """What ``table`` prints at ``width`` columns, without trailing blanks (rich pads each line)."""
    console = Console(width=width, record=True)
    console.print(table.render())
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"


def test_the_live_table_of_a_recorded_stream_fits_80_columns_and_matches_the_snapshot() -> None:
    steps = StepTable(clock=lambda: 100.0)
    for event in recorded_stream():
        steps.apply(event)
    text = rendered(steps)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    if os.environ.get("UPDATE_SNAPSHOTS"):
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(text, encoding="utf-8")
    expected = SNAPSHOT.read_text(encoding="utf-8")
    diff = "\n".join(
        difflib.unified_diff(expected.splitlines(), text.splitlines(), "snapshot", "now", lineterm="")
    )
    assert text == expected, f"the live table changed (regenerate: {REGENERATE}):\n{diff}"
    # What the snapshot must show, whatever its layout.
    assert steps.rows[(1, 2, "step")].leg_text() == "cloud 503 → local"
    assert steps.rows[(1, 3, "step")].leg_text() == "local timeout → cloud"
    # At 80 columns the leg never wraps: the failed attempts are said below the table.
    assert "cloud→local" in text and "local→cloud" in text
    assert "failed attempts: step 2 cloud 503, step 3 local timeout" in text
    assert "(cut)" in text and "max_tokens" in text
    assert "2400/-" in text and "5210/2380" in text and "123k/118k" in text
    assert "62s" in text and "$0.012300" in text
    assert "0.2" in text  # a memory job of the previous turn, folded into this one
    # The long reason is shown once, below the table, for the last step only.
    assert "3 local steps in a row" in text and "back to local" not in text


def test_details_show_every_reason() -> None:
    steps = StepTable(details=True, clock=lambda: 100.0)
    for event in recorded_stream():
        steps.apply(event)
    text = rendered(steps)
    assert "back to local" in text and "3 local steps in a row" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_a_running_step_ticks_elapsed_time_and_streamed_tokens() -> None:
    now = [10.0]
    steps = StepTable(clock=lambda: now[0])
    start = decision(1, "step", "local", 12, 60, "back to local")
    steps.apply(start)
    now[0] = 13.5
    steps.apply(tokens(start, 7))
    steps.apply(tokens(start, 5))
    text = rendered(steps)
    assert "local …" in text and "running, 12 tok" in text
    assert "3.5s" in text and "12 tokens streamed" in text
    now[0] = 14.0
    # An outcome without a latency takes the time since the decision.
    steps.apply({**start, "phase": "outcome", "leg": "local", "provider": "local:m", "attempts": []})
    text = rendered(steps)
    assert "running" not in text and "4.0s" in text


def test_the_running_spinner_turns_between_refreshes() -> None:
    from rich.spinner import Spinner

    steps = StepTable(clock=lambda: 10.0)
    start = decision(1, "step", "local", 12, 60, "back to local")
    steps.apply(start)
    drawn = [[n for n in steps.notes() if isinstance(n, Spinner)] for _ in range(2)]
    assert [len(d) for d in drawn] == [1, 1]
    first, second = drawn[0][0], drawn[1][0]
    # Each refresh draws the same spinner, so its frame follows the time since it was first drawn.
    assert str(first.render(100.0)) != str(second.render(100.5))  # a fresh one would start at frame 0


def test_nobody_answered() -> None:
    steps = StepTable(clock=lambda: 0.0)
    start = decision(1, "step", "cloud", 90, 60, "cloud")
    steps.apply(start)
    steps.apply(
        {
            **start,
            "phase": "outcome",
            "leg": "cloud",
            "provider": None,
            "attempts": [
                failed("cloud", "rate_limited", "slow down"),
                failed("local", "connection", "refused"),
            ],
        }
    )
    assert "cloud 429 ✗" in steps.rows[(1, 1, "step")].leg_text()
    narrow = rendered(steps)
    assert "cloud✗" in narrow and "failed attempts: step 1 cloud 429\n" in narrow


def test_attempt_labels() -> None:
    assert attempt_label({"kind": "server_error", "message": "Error code: 502 - bad gateway"}) == "502"
    assert attempt_label({"kind": "server_error", "message": "boom"}) == "5xx"
    assert attempt_label({"kind": "timeout", "message": "no answer"}) == "timeout"
    assert attempt_label({"kind": "weird"}) == "weird"
    assert attempt_label({}) == "failed"


def test_a_second_turn_labels_folded_memory_rows_and_counts_the_rows_it_shows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Turn 0's memory job needs a repair (two local inferences); it is folded into turn 1.
    good = json.dumps({"items": [{"kind": "fact", "text": "The list is in notes.txt."}]})
    pairs = [
        (scripted("cloudfake", ["Noted."]), scripted("localfake", ["not json", good])),
        (scripted("cloudfake", ["It is in notes.txt."]), scripted("localfake", [good])),
    ]

    async def models(context: FusionContext, settings: FusionSettings) -> tuple[BaseChatModel, BaseChatModel]:
        return pairs.pop(0)

    monkeypatch.setattr(cli_run, "MODELS", models)
    common = ["--workspace", str(tmp_path), "--db", str(tmp_path / "t.sqlite"), "--thread", "t1"]
    assert runner.invoke(app, ["run", "My list is in notes.txt", *common, "--new-thread"]).exit_code == 0
    second = runner.invoke(app, ["run", "Where is it?", *common], env={"COLUMNS": "80"})
    assert second.exit_code == 0, second.output
    text = second.stdout
    rows = re.findall(r"^ *(\d+(?:\.\d+)?) +(plan|step|repair|memory|synthesis) ", text, re.MULTILINE)
    assert rows == [("0.0", "memory"), ("0.0", "memory"), ("0", "plan")]  # one row per inference
    words = " ".join(text.split())
    assert "0.0 memory: of turn 0, finished after it; folded into this turn" in words
    assert "3 inferences, one per row above (2 memory, 1 plan)" in words  # the counts below agree
    assert re.search(r"^local:localfake +2 ", text, re.MULTILINE)
    assert re.search(r"^answered by local +2 ", text, re.MULTILINE)
    assert re.search(r"^total +3 ", text, re.MULTILINE)
