"""Prices in ``report`` and ``doctor``: savings over priced steps only, steps priced late, no stale advice."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer
from langchain_core.messages import AIMessage

from fusion_graph.cli.app import app
from fusion_graph.cli.doctor import doctor
from fusion_graph.cli.prices import priced_costs
from fusion_graph.cli.run import run_task
from fusion_graph.context import FusionContext
from fusion_graph.providers.pricing import TokenPrices
from fusion_graph.routing.records import RouteRecord, make_record
from fusion_graph.routing.score import Leg, RouteDecision
from fusion_graph.settings import FusionSettings
from fusion_graph_testing.fake_openai import FakeOpenAI
from tests.plugins.fakes import scripted
from tests.unit.cli.test_run import usage
from tests.unit.cli.test_traces import invoke_json, runner

PRICE = {"cloudfake": [1.0, 2.0, 0.5]}


async def all_cloud_thread(tmp_path: Path) -> Path:
    """One thread that ran entirely on cloud while the cloud model had no price (cost unknown)."""
    db = tmp_path / "threads.sqlite"
    answer = AIMessage("done", usage_metadata=usage(400, 50))
    result = await run_task(
        "hi",
        context=FusionContext(mode="cloud", sub_runners="off"),
        settings=FusionSettings(cloud_model="cloudfake", workspace_root=str(tmp_path)),
        db=db,
        models=(scripted("cloudfake", [answer]), scripted("localfake", [])),
    )
    assert [r["cost_usd"] for r in result.route_log] == [None]  # unpriced when it ran
    return db


async def test_a_thread_run_unpriced_is_priced_now_and_saves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = await all_cloud_thread(tmp_path)
    monkeypatch.setenv("FUSION_CLOUD_MODEL", "cloudfake")
    monkeypatch.setenv("FUSION_PRICE_OVERRIDES", json.dumps(PRICE))  # the price is known now
    out = invoke_json("report", "--db", str(db), "--json")
    [row] = out["threads"].values()
    cost = (400 * 1.0 + 50 * 2.0) / 1e6
    assert (row["repriced"], row["unpriced"], row["priced_inferences"]) == (1, 0, 1)
    assert row["cost_usd"] == pytest.approx(cost) == row["all_cloud_cost_usd"]
    assert row["savings_usd"] == pytest.approx(0.0) and row["savings_fraction"] == 0.0  # not 100 %
    assert out["savings_fraction"] == 0.0
    assert "priced now from their recorded tokens" in out["price_hint"]
    assert (
        "FUSION_CLOUD_PRICE_LIKE" not in out["price_hint"]
        and "FUSION_PRICE_OVERRIDES" not in out["price_hint"]
    )

    table = runner.invoke(app, ["report", "--db", str(db)])
    assert table.exit_code == 0, table.output
    assert f"${cost:.6f}" in table.stdout and "1 repriced" in table.stdout and "0%" in table.stdout
    assert "100%" not in table.stdout
    assert "priced now" in " ".join(table.stderr.split())


async def test_a_price_still_unknown_is_counted_apart_and_the_note_skips_settings_already_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = await all_cloud_thread(tmp_path)
    monkeypatch.setenv("FUSION_CLOUD_MODEL", "cloudfake")
    monkeypatch.setenv("FUSION_CLOUD_PRICE_LIKE", "openai")  # set, and the catalogue has no cloudfake there
    out = invoke_json("report", "--db", str(db), "--json")
    [row] = out["threads"].values()
    assert (row["repriced"], row["unpriced"], row["priced_inferences"]) == (0, 1, 0)
    assert row["unpriced_providers"] == ["cloud:cloudfake"]
    assert row["cost_usd"] == 0.0 and row["all_cloud_cost_usd"] is None
    assert row["savings_usd"] is None and row["savings_fraction"] is None
    hint = out["price_hint"]
    assert "FUSION_CLOUD_PRICE_LIKE=openai is set" in hint and "FUSION_PRICE_OVERRIDES" in hint
    assert "or FUSION_CLOUD_PRICE_LIKE" not in hint  # not suggested: it is set

    table = runner.invoke(app, ["report", "--db", str(db)])
    assert table.exit_code == 0, table.output
    assert "+1 unpriced" in table.stdout and "unknown" in table.stdout and "100%" not in table.stdout
    assert "or FUSION_CLOUD_PRICE_LIKE" not in " ".join(table.stderr.split())


def record(provider: str, leg: Leg, cost: float | None) -> RouteRecord:
    """A step answered by ``provider`` with 1000 prompt and 100 completion tokens, costing ``cost``."""
    made = make_record(
        turn=0,
        step=1,
        kind="step",
        leg=leg,
        decision=RouteDecision(leg, None, None, "r"),
        signals=None,
        provider=provider,
        answer=AIMessage("x", usage_metadata=usage(1000, 100)),
    )
    made["cost_usd"] = cost
    return made


def test_savings_count_only_the_inferences_with_a_price() -> None:
    cloud = TokenPrices(1.0, 2.0, 0.5)
    records = [
        record("local:qwen", "local", 0.0),  # priced: free, all-cloud $0.0012
        record("cloud:other", "cloud", None),  # another model, no price: left out of both
        record("cloud:cloudfake", "cloud", None),  # priced now: $0.0012 on both sides
    ]
    costs = priced_costs(records, cloud, "cloudfake")
    assert (costs.priced, costs.repriced, costs.unpriced) == (2, 1, 1)
    assert costs.unpriced_providers == ("cloud:other",)
    assert costs.cost_usd == pytest.approx(0.0012)
    assert costs.all_cloud_usd == pytest.approx(0.0024)
    saved, fraction = costs.savings
    assert saved == pytest.approx(0.0012) and fraction == 0.5
    assert priced_costs(records, None, "cloudfake").savings == (None, None)


def test_doctor_warns_when_the_cloud_model_has_no_price(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    command = typer.Typer()
    command.command()(doctor)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPENAI_API_KEY", "doctor-price-key")
    with FakeOpenAI() as cloud:
        monkeypatch.setenv("FUSION_CLOUD_BASE_URL", cloud.base_url)
        monkeypatch.setenv("FUSION_LOCAL_BASE_URL", cloud.base_url)
        monkeypatch.setenv("FUSION_CLOUD_MODEL", "fake")
        monkeypatch.setenv("FUSION_CLOUD_PRICE_LIKE", "openai")

        def price_row() -> dict[str, str]:
            result = runner.invoke(command, ["--json"])
            rows: dict[str, dict[str, str]] = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
            return rows["cloud price"]

        unknown = price_row()
        assert unknown["status"] == "warn" and "'fake' has no known price" in unknown["detail"]
        assert (
            "FUSION_PRICE_OVERRIDES" in unknown["fix"] and "or FUSION_CLOUD_PRICE_LIKE" not in unknown["fix"]
        )
        table = runner.invoke(command, [])
        assert re.search(r"│ cloud price\s+│ warn", table.stdout), table.stdout

        monkeypatch.setenv("FUSION_PRICE_OVERRIDES", json.dumps({"fake": [1.0, 2.0, 0.5]}))
        known = price_row()
        assert known["status"] == "ok" and "$1 in, $2 out, $0.5 cached" in known["detail"]


def test_an_inference_nobody_answered_is_not_unpriced_and_no_price_is_suggested() -> None:
    from fusion_graph.cli.prices import price_note
    from fusion_graph.routing.records import make_record, totals_of

    cloud = TokenPrices(1.0, 2.0, 0.5)
    nobody = make_record(turn=0, step=1, kind="step", decision=RouteDecision("cloud", None, None, "r"))
    records = [record("local:qwen", "local", 0.0), nobody]
    costs = priced_costs(records, cloud, "cloudfake")
    assert (costs.priced, costs.unpriced, costs.unanswered) == (1, 0, 1)
    assert costs.unpriced_providers == ()
    note = price_note(FusionSettings(cloud_model="cloudfake"), "cloudfake", cloud, costs)
    assert note is not None and "1 inference(s) got no answer from any provider" in note
    assert "FUSION_PRICE_OVERRIDES" not in note and ":?" not in note
    assert totals_of(nobody)["unpriced"] == 0
