"""The trouble-signals benchmark: both replays, the separation report, the routing rows, missing traces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.trouble import SHARES, TARGETS, main, run
from fusion_graph.context import FusionContext
from fusion_graph.replay.traces import load_trajectories


def tool_step(call_id: str, result: str) -> list[dict[str, Any]]:
    arguments = json.dumps({"flight": call_id})  # a new input every step: no repeats
    call = {"id": call_id, "type": "function", "function": {"name": "book", "arguments": arguments}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


def write_traces(path: Path) -> Path:
    """Four tasks: the failed ones hit tool errors, the successful ones do not."""
    lines = []
    for index in range(4):
        failed = index % 2 == 0
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"book it {index} " + "x" * 200}]
        for step in range(3):
            result = "Error: flight HAT1 not available" if failed and step else f"booked {step}"
            messages += tool_step(f"c{index}-{step}", result)
        messages.append({"role": "assistant", "content": "done"})
        lines.append(json.dumps({"id": f"r{index}", "messages": messages, "reward": 0 if failed else 1}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_report_compares_the_score_with_and_without_trouble(tmp_path: Path) -> None:
    trajectories = load_trajectories([write_traces(tmp_path / "t.jsonl")])
    report = run(trajectories, FusionContext())
    separation = report["separation"]
    off = separation["off"]["features"]["mean continuation score"]
    on = separation["on"]["features"]["mean continuation score"]
    assert on["failed_mean"] > off["failed_mean"]  # the errors add points to failed tasks only
    assert on["successful_mean"] == off["successful_mean"]
    assert on["auc"] == 1.0
    terms = separation["terms"]
    assert terms["features"]["mean error severity"]["auc"] == 1.0
    assert terms["trajectories_with_trouble"] == {"failed": 2, "successful": 0}
    rows = report["routing"]
    assert len(rows) == len(SHARES) + len(TARGETS)
    assert all(row["on"]["after_error_steps"] == 4 for row in rows)
    assert report["meta"]["families"] == {"t": 4}


def test_main_writes_json_and_stops_on_missing_traces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.json"
    assert main(["--traces", str(write_traces(tmp_path / "t.jsonl")), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["separation"]["on"]["failed"] == 2
    assert "rank AUC" in capsys.readouterr().out
    assert main(["--traces", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err
