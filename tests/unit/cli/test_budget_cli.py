"""Cloud budgets on the command line: ``replay``/``calibrate --turn-budget/--thread-budget``,
``replay --resynthesize``, and ``report``'s spend against the operator's budgets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fusion_graph.cli.app import app
from fusion_graph.cli.report import budget_summary
from fusion_graph.routing.records import RecordParts, RouteRecord, StepKind, kept_local_by_budget, make_record
from fusion_graph.routing.score import Leg, RouteDecision
from fusion_graph.settings import FusionSettings
from tests.unit.cli.test_report import PRICED, two_threads
from tests.unit.cli.test_traces import (
    dollar_prices,  # noqa: F401  (a fixture)
    invoke_json,
    runner,
    write_tiny_traces,
    write_varied_traces,
)


def test_replay_thread_budget_moves_cloud_steps_local(tmp_path: Path, dollar_prices: None) -> None:  # noqa: F811
    traces = str(write_tiny_traces(tmp_path / "tiny.jsonl"))
    free = invoke_json("replay", traces, "--json")
    assert free["cloud_steps"] == free["plan_steps"] == 4 and free["budget_local_steps"] == 0
    tight = invoke_json("replay", traces, "--json", "--thread-budget", "0.000001")
    assert tight["budget"] == {"turn_usd": None, "thread_usd": 0.000001}
    assert tight["cloud_steps"] == 0 and tight["cloud_cost_usd"] == 0
    assert tight["budget_local_steps"] == tight["budget_local_plan_steps"] == 4
    turn = invoke_json("replay", traces, "--json", "--turn-budget", "0.000001")
    assert turn["budget"] == {"turn_usd": 0.000001, "thread_usd": None} and turn["cloud_steps"] == 0
    # A roomy budget changes nothing.
    roomy = invoke_json("replay", traces, "--json", "--thread-budget", "10")
    assert roomy["cloud_steps"] == 4 and roomy["cloud_cost_usd"] == pytest.approx(free["cloud_cost_usd"])
    text = runner.invoke(app, ["replay", traces, "--thread-budget", "0.000001"])
    assert text.exit_code == 0, text.output
    assert "cloud budget (thread $1e-06): 4 step(s) moved local" in " ".join(text.stdout.split())


def test_replay_resynthesize_prints_what_re_writing_local_replies_adds(
    tmp_path: Path,
    dollar_prices: None,  # noqa: F811
) -> None:
    traces = str(write_varied_traces(tmp_path / "varied.jsonl"))
    out = invoke_json("replay", traces, "--json", "--cloud-share", "50")
    again = out["resynthesis"]
    endings = sum(t["turns_ending_local"] for t in out["trajectories"])
    assert again["turns"] == 20 and again["turns_ending_local"] == endings > 0
    assert again["added_cost_usd"] > 0
    assert again["fraction_of_all_cloud_cost"] == round(
        again["added_cost_usd"] / out["all_cloud_cost_usd"], 4
    )
    plain = runner.invoke(app, ["replay", traces, "--cloud-share", "50"])
    assert "re-synthesis" not in plain.stdout
    shown = runner.invoke(app, ["replay", traces, "--cloud-share", "50", "--resynthesize"])
    assert shown.exit_code == 0, shown.output
    words = " ".join(shown.stdout.split())
    assert f"{endings} of 20 turns end on a local reply" in words


def test_calibrate_under_a_budget_reports_the_budgeted_run(tmp_path: Path, dollar_prices: None) -> None:  # noqa: F811
    traces = str(write_varied_traces(tmp_path / "varied.jsonl"))
    args = ["calibrate", traces, "--target-cloud-fraction", "0.3", "--json"]
    context = '{"max_steps": 30, "max_completion_tokens": 16}'
    free = invoke_json(*args, "--context", context)
    assert free["budget_local_steps"] == 0 and free["without_budget"] is None
    out = invoke_json(*args, "--context", context, "--thread-budget", "0.001")
    assert out["budget"] == {"turn_usd": None, "thread_usd": 0.001}
    assert out["budget_local_steps"] > 0
    assert out["without_budget"]["cloud_fraction"] == free["cloud_fraction"]
    assert out["cloud_fraction"] < free["cloud_fraction"]
    assert out["cloud_cost_usd"] < free["cloud_cost_usd"]
    assert out["context"]["thread_cloud_budget_usd"] == 0.001
    # Replaying the printed context (which carries the budget) gives the same figures.
    again = invoke_json("replay", traces, "--json", "--context", json.dumps(out["context"]))
    assert again["cloud_fraction"] == out["cloud_fraction"]
    assert again["continuation_cloud_fraction"] == out["achieved"]


# --------------------------------------------------------------------------- report


def record(
    turn: int,
    leg: Leg,
    cost: float | None,
    *,
    kind: StepKind = "step",
    reason: str = "r",
    budget: str | None = None,
    parts: RecordParts | None = None,
) -> RouteRecord:
    made = make_record(
        turn=turn,
        step=1,
        kind=kind,
        leg=leg,
        decision=RouteDecision(leg, None, None, reason, budget=budget),
        signals=None,
        provider=None,
        answer=None,
        **(parts or {}),
    )
    made["cost_usd"] = cost
    return made


def test_budget_summary_counts_spend_turns_kept_local_and_syntheses() -> None:
    moved = "score 90 >= 80: cloud; thread budget $0.05: $0.049 spent, step ~$0.004: local"
    records = [
        record(0, "cloud", 0.01),
        record(0, "cloud", 0.02),
        record(0, "local", 0.5),  # local: not cloud spend
        record(1, "cloud", 0.015),
        record(1, "local", None, reason=moved, budget="thread budget $0.05"),
        record(1, "local", None, budget="turn budget $0.01", parts={"budget": {"over": "turn"}}),
        record(1, "local", None, reason="thread budget $0.05 said nothing"),  # not ending ": local"
        record(1, "cloud", 0.001, kind="synthesis", parts={"synthesis": {"draft": "d"}}),
        record(2, "cloud", None, kind="synthesis", parts={"synthesis": {"skipped": "over budget"}}),
    ]
    assert [kept_local_by_budget(r) for r in records[4:7]] == [True, True, False]
    out = budget_summary(records)
    assert out["cloud_spend_usd"] == pytest.approx(0.046)
    assert out["max_turn_cloud_usd"] == pytest.approx(0.03)
    assert out["budget_local_steps"] == 2
    assert (out["synthesis_done"], out["synthesis_skipped"]) == (1, 1)


async def test_report_shows_cloud_spend_against_the_operator_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = FusionSettings(cloud_model="cloudfake", price_overrides=PRICED, workspace_root=str(tmp_path))
    db = await two_threads(tmp_path, settings)
    monkeypatch.setenv("FUSION_CLOUD_MODEL", "cloudfake")
    monkeypatch.setenv("FUSION_PRICE_OVERRIDES", json.dumps(PRICED))
    monkeypatch.setenv("FUSION_THREAD_CLOUD_BUDGET_USD", "0.01")
    out = invoke_json("report", "--db", str(db), "--json")
    assert out["cloud_budget"] == {"turn_usd": None, "thread_usd": 0.01}
    first, _ = out["threads"].values()
    assert first["cloud_spend_usd"] == pytest.approx(0.0012)  # the cloud plan; the local step is free
    assert first["max_turn_cloud_usd"] == pytest.approx(0.0012)
    assert (first["budget_local_steps"], first["synthesis_done"], first["synthesis_skipped"]) == (0, 0, 0)
    assert out["totals"]["cloud_spend_usd"] == pytest.approx(0.0024)
    assert out["totals"]["max_turn_cloud_usd"] == pytest.approx(0.0012)
    table = runner.invoke(app, ["report", "--db", str(db)])
    assert table.exit_code == 0, table.output
    text = table.stdout
    assert "cloud spend against budget (operator budgets: thread $0.01)" in text
    assert "12% of $0.01" in text
