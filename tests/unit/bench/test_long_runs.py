"""The long-runs benchmark's bookkeeping (no server, no traces)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.long_runs import StepRecord, main, quantile, report, summarize, targets


def local(
    estimate: int, reported: int, *, basis: str = "anchored", prompt_n: int = 10, minimum: int = 10
) -> StepRecord:
    return StepRecord(
        "swe-x", "local", "local", estimate=estimate, basis=basis, baseline=reported // 2, reported=reported,
        prompt_n=prompt_n, minimum=minimum,
    )  # fmt: skip


def test_quantile_is_the_nearest_rank() -> None:
    assert quantile([], 0.95) is None
    assert quantile([0.1, 0.2, 0.3, 0.4], 0.5) == 0.2
    assert quantile([float(i) for i in range(100)], 0.95) == 94.0


def test_summary_counts_escalations_compactions_overflows_and_errors() -> None:
    records = [
        local(101, 100),
        local(95, 100, basis="server", prompt_n=30, minimum=20),
        StepRecord("swe-x", "local", "cloud", fit_escalation=True, reported=5000),
        StepRecord("swe-x", "cloud", "cloud", compacted=True, reported=3000),
        StepRecord("swe-x", "local", "cloud", overflow=True, reported=9000),
    ]
    summary = summarize(records)
    assert (summary["local_steps"], summary["cloud_steps"]) == (2, 3)
    assert (summary["fit_escalations"], summary["compactions"], summary["overflow_errors"]) == (1, 1, 1)
    assert summary["estimator_median"] == pytest.approx(0.03)  # median of 1 % and 5 %
    assert summary["estimator_max"] == pytest.approx(0.05)
    assert (summary["anchored_steps"], summary["server_counted_steps"]) == (1, 1)
    assert summary["baseline_median"] == 0.5
    assert (summary["processed_tokens"], summary["minimum_tokens"], summary["prefill_ratio"]) == (
        40,
        30,
        1.3333,
    )


def test_targets_say_which_hold() -> None:
    good = report([local(101, 100), local(99, 100)])
    lines = targets({"variants": {"profile": good}})
    assert all("HOLDS" in line for line in lines) and len(lines) == 4
    bad = report([local(150, 100), StepRecord("swe-x", "local", "cloud", overflow=True)])
    lines = targets({"variants": {"8192": bad}})
    assert [line.split()[3] for line in lines] == ["MISSED", "MISSED", "MISSED", "HOLDS"]


def test_missing_traces_stop_the_run_with_the_path(tmp_path: Path) -> None:
    assert main(["--traces", str(tmp_path / "nowhere")]) == 2
