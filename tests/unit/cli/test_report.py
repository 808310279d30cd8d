"""``fusion-graph report``: totals, savings, both cloud shares, thread starts and first messages."""

from __future__ import annotations

import json
import sqlite3
from datetime import datetime
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage

from fusion_graph.cli.app import app
from fusion_graph.cli.run import run_task
from fusion_graph.context import FusionContext
from fusion_graph.settings import FusionSettings
from tests.plugins.fakes import ai_calls, call, scripted
from tests.unit.cli.test_run import usage
from tests.unit.cli.test_traces import invoke_json, runner


def test_report_of_a_missing_database_says_so(tmp_path: Path) -> None:
    result = runner.invoke(app, ["report", "--db", str(tmp_path / "none.sqlite")])
    assert result.exit_code == 2
    assert "no checkpoint database" in result.stderr
    assert not (tmp_path / "none.sqlite").exists()


async def two_threads(tmp_path: Path, settings: FusionSettings) -> Path:
    """Two stored threads: a plan on cloud (1000 in, 100 out), a local step (2000 in, 1500 cached, 50 out)."""
    (tmp_path / "notes.txt").write_text("milk\n")
    db = tmp_path / "threads.sqlite"
    for task in ("Please read my notes file and tell me everything it says", "second"):
        plan = ai_calls(call("read_file", {"path": "notes.txt"}, "r1"))
        plan.usage_metadata = usage(1000, 100)
        local = AIMessage("done", usage_metadata=usage(2000, 50, cached=1500))
        await run_task(
            task,
            context=FusionContext(sub_runners="off"),
            settings=settings,
            db=db,
            models=(scripted("cloudfake", [plan]), scripted("localfake", [local])),
        )
    return db


PRICED = {"cloudfake": (1.0, 2.0, 0.5)}


async def test_report_totals_savings_start_and_first_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = FusionSettings(cloud_model="cloudfake", price_overrides=PRICED, workspace_root=str(tmp_path))
    db = await two_threads(tmp_path, settings)
    monkeypatch.setenv("FUSION_CLOUD_MODEL", "cloudfake")
    monkeypatch.setenv("FUSION_PRICE_OVERRIDES", json.dumps(PRICED))

    out = invoke_json("report", "--db", str(db), "--json")
    first, second = out["threads"].values()  # oldest thread first
    assert first["first_message"] == "Please read my notes file and tell me e…"
    assert len(first["first_message"]) == 40 and second["first_message"] == "second"
    assert datetime.fromisoformat(first["started_at"]) <= datetime.fromisoformat(second["started_at"])
    one_cost, one_all_cloud = 0.0012, 0.0012 + (500 + 750 + 100) / 1e6
    assert first["cost_usd"] == pytest.approx(one_cost)
    assert first["all_cloud_cost_usd"] == pytest.approx(one_all_cloud)
    assert first["savings_usd"] == pytest.approx(one_all_cloud - one_cost)
    assert first["savings_fraction"] == pytest.approx((one_all_cloud - one_cost) / one_all_cloud, abs=1e-4)
    # Both shares: of all steps (the plan is on cloud) and of continuation steps.
    assert (first["steps"], first["plans"], first["continuation_steps"]) == (2, 1, 1)
    assert (first["cloud_fraction"], first["continuation_cloud_fraction"]) == (0.5, 0.0)
    totals = out["totals"]
    assert (totals["threads"], totals["turns"], totals["steps"], totals["switches"]) == (2, 2, 4, 2)
    assert totals["cost_usd"] == pytest.approx(2 * one_cost)
    assert out["savings_usd"] == pytest.approx(2 * (one_all_cloud - one_cost))
    assert out["savings_fraction"] == totals["savings_fraction"] == first["savings_fraction"]
    assert out["price_hint"] is None

    table = runner.invoke(app, ["report", "--db", str(db)])
    assert table.exit_code == 0, table.output
    text = table.stdout
    assert "total (2)" in text and "$0.002400" in text  # the totals row
    assert f"${2 * (one_all_cloud - one_cost):.6f}" in text and "53%" in text  # savings, dollars and percent
    assert "Please read my notes" in text and "second" in text
    assert "cloud" in text and "cont." in text and "plans (one per turn) run on cloud" in text
    assert table.stderr == ""


async def test_an_unknown_price_names_the_settings_that_give_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = await two_threads(tmp_path, FusionSettings(cloud_model="cloudfake", workspace_root=str(tmp_path)))
    monkeypatch.setenv("FUSION_CLOUD_MODEL", "cloudfake")
    out = invoke_json("report", "--db", str(db), "--json")
    assert out["savings_usd"] is None and out["totals"]["all_cloud_cost_usd"] is None
    assert "FUSION_PRICE_OVERRIDES" in out["price_hint"] and "FUSION_CLOUD_PRICE_LIKE" in out["price_hint"]
    table = runner.invoke(app, ["report", "--db", str(db)])
    assert table.exit_code == 0
    assert "unknown" in table.stdout
    assert "FUSION_PRICE_OVERRIDES" in table.stderr and "FUSION_CLOUD_PRICE_LIKE" in table.stderr
    assert '{"cloudfake": [input, output, cached_input]}' in " ".join(table.stderr.split())


async def test_report_of_one_thread_and_of_a_thread_not_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = FusionSettings(cloud_model="cloudfake", price_overrides=PRICED, workspace_root=str(tmp_path))
    db = await two_threads(tmp_path, settings)
    ids = list(invoke_json("report", "--db", str(db), "--json")["threads"])
    one = invoke_json("report", "--db", str(db), "--thread", ids[1], "--json")
    assert list(one["threads"]) == [ids[1]] and one["totals"]["threads"] == 1
    missing = runner.invoke(app, ["report", "--db", str(db), "--thread", "nope"])
    assert missing.exit_code == 2 and "thread 'nope' is not in" in missing.stderr


def test_report_of_an_empty_database(tmp_path: Path) -> None:
    db = tmp_path / "empty.sqlite"
    sqlite3.connect(str(db)).close()  # an empty SQLite file: no checkpoint tables
    out = invoke_json("report", "--db", str(db), "--json")
    assert out["threads"] == {} and out["totals"]["threads"] == 0 and out["totals"]["cost_usd"] == 0
