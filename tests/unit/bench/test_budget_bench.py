"""The budget benchmark's bookkeeping: per-trajectory budgets, rows, the table, missing traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.budget import VARIANTS, Variant, budgeted_context, main, markdown, row, run
from fusion_graph.context import FusionContext
from fusion_graph.providers.pricing import TokenPrices
from fusion_graph.replay.traces import StepPrices, load_trajectories

PRICES = StepPrices(TokenPrices(1.0, 2.0, None), TokenPrices(0.0, 0.0, 0.0))


def write_traces(path: Path) -> Path:
    lines = []
    for index in range(3):
        messages = []
        for turn in range(2):
            messages += [{"role": "user", "content": f"task {index}.{turn} " + "x" * 300 * (index + 1)}]
            messages += [{"role": "assistant", "content": "done " + "y" * 80}]
        lines.append(json.dumps({"id": f"r{index}", "messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_budgets_are_fractions_of_each_trajectory_own_all_cloud_cost() -> None:
    base = FusionContext()
    thread = budgeted_context(base, Variant("t", thread_fraction=0.25), 0.08, 4)
    assert (thread.thread_cloud_budget_usd, thread.turn_cloud_budget_usd) == (0.02, None)
    turn = budgeted_context(base, Variant("u", turn_fraction=0.5), 0.08, 4)
    assert (turn.thread_cloud_budget_usd, turn.turn_cloud_budget_usd) == (None, 0.01)
    assert budgeted_context(base, VARIANTS[0], 0.08, 4) == base


def test_rows_compare_with_all_cloud_and_the_table_has_one_line_per_row(tmp_path: Path) -> None:
    trajectories = load_trajectories([write_traces(tmp_path / "t.jsonl")])
    out = run(trajectories, PRICES, completions=[16], base=FusionContext(max_completion_tokens=16))
    rows = out["rows"]
    assert [r["variant"] for r in rows] == ["all cloud (mode cloud)", *(v.name for v in VARIANTS)]
    everything, free = rows[0], rows[1]
    assert everything["cloud_cost_usd"] == pytest.approx(out["all_cloud_cost_usd"])
    assert everything["cost_fraction"] == 1.0 and everything["cloud_fraction"] == 1.0
    assert free["budget_local_steps"] == 0 and free["plan_cloud_steps"] == free["plan_steps"] == 6
    by_name = {r["variant"]: r for r in rows}
    tenth = by_name["thread 10%"]
    assert tenth["budget_local_steps"] == 6 and tenth["cloud_cost_usd"] == 0  # no plan fits 10 %
    full = by_name["thread 100%"]
    assert 0 < full["cost_fraction"] <= 1.0
    assert full["budget_local_steps"] < tenth["budget_local_steps"]
    table = markdown(rows).splitlines()
    assert len(table) == 2 + len(rows) and table[0].startswith("| variant |")
    assert "| thread 10% | 16 | $0.0000 | 0.00 |" in table[3 + 1]


def test_a_row_reads_the_summary_against_the_all_cloud_total() -> None:
    summary = {
        "cloud_cost_usd": 0.25,
        "cloud_fraction": 0.5,
        "continuation_cloud_fraction": 0.1,
        "plan_cloud_steps": 3,
        "plan_steps": 4,
        "budget_local_steps": 2,
        "budget_local_plan_steps": 1,
        "resynthesis": {"turns_ending_local": 1, "added_cost_usd": 0.01, "skipped_by_budget": 2},
    }
    made = row("x", 4096, summary, 1.0)
    assert made["cost_fraction"] == 0.25 and made["resynthesis_skipped"] == 2
    assert "| x | 4096 | $0.2500 | 0.25 | 0.50 | 0.10 | 3/4 | 2 (1) | $0.0100 (2) |" in markdown([made])


def test_missing_traces_stop_the_run_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--traces", str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err
