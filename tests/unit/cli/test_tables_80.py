"""Every table reads at ``COLUMNS=80``: no line wider, and each number of its ``--json`` there whole."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import Result

from fusion_graph.cli.app import app
from fusion_graph.settings import FusionSettings
from fusion_graph_testing.fake_openai import FakeOpenAI
from tests.unit.cli.test_prices import PRICE, all_cloud_thread
from tests.unit.cli.test_report import PRICED, two_threads
from tests.unit.cli.test_traces import runner

NARROW = {"COLUMNS": "80"}


def as_json(*args: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(runner.invoke(app, [*args, "--json"], env=NARROW).stdout)
    return data


def at_80(*args: str) -> Result:
    """The tables of a command at 80 columns: no wider, nothing cut but the first message."""
    result = runner.invoke(app, list(args), env=NARROW)
    widest = max(len(line) for line in result.stdout.splitlines())
    assert widest <= 80, result.stdout
    assert "…" not in result.stdout.replace("e…", ""), result.stdout  # only the first message is cut
    return result


def money(value: float) -> str:
    return f"${value:.6f}"


async def test_report_at_80_columns_shows_every_number_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = FusionSettings(cloud_model="cloudfake", price_overrides=PRICED, workspace_root=str(tmp_path))
    db = await two_threads(tmp_path, settings)
    (tmp_path / "later").mkdir()
    later = await all_cloud_thread(tmp_path / "later")  # a third thread, in a file of its own
    monkeypatch.setenv("FUSION_CLOUD_MODEL", "cloudfake")
    monkeypatch.setenv("FUSION_PRICE_OVERRIDES", json.dumps(PRICE))
    monkeypatch.setenv("FUSION_THREAD_CLOUD_BUDGET_USD", "0.01")
    for path in (db, later):
        out = as_json("report", "--db", str(path))
        text = at_80("report", "--db", str(path)).stdout
        for tid, row in [*out["threads"].items(), ("total", out["totals"])]:
            assert tid in text
            expected = [
                f"{row['turns']}/{row['steps']}",
                f"{row['cloud_fraction']:.2f}/{row['continuation_cloud_fraction']:.2f}",
                money(row["cost_usd"]),
                money(row["all_cloud_cost_usd"]),
                money(row["savings_usd"]),
                f"{row['savings_fraction']:.0%}",
                money(row["cloud_spend_usd"]),
                money(row["max_turn_cloud_usd"]),
            ]
            expected += [f"{row['repriced']} repriced"] if row["repriced"] else []
            for cell in expected:
                assert cell in text, (cell, text)


def numbers(text: str) -> list[str]:
    """The numbers of a text (``4096``, ``127.0.0.1``, ``0.5``), three characters or longer."""
    return [n for n in re.findall(r"\d+(?:\.\d+)*", text) if len(n) >= 3]


def test_doctor_at_80_columns_shows_every_number_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPENAI_API_KEY", "doctor-width-key")
    with FakeOpenAI() as cloud, FakeOpenAI() as local:
        local.props = {"total_slots": 4, "default_generation_settings": {"n_ctx": 4096}, "model_alias": "q"}
        monkeypatch.setenv("FUSION_CLOUD_BASE_URL", cloud.base_url)
        monkeypatch.setenv("FUSION_CLOUD_MODEL", "fake")
        monkeypatch.setenv("FUSION_LOCAL_BASE_URL", local.base_url)
        out = as_json("doctor")
        text = at_80("doctor").stdout
    assert {"slot window", "cloud price", "llama-server"} <= {c["name"] for c in out["checks"]}
    for check in out["checks"]:
        assert check["name"] in text
        for number in numbers(check["detail"] + " " + check["fix"]):
            assert number in text, (number, check, text)
    assert "131072" in text and "8192" in text  # the start line's -c and the tokens a slot needs, whole
