"""Shadow agreement with its uncertainty: Wilson intervals, and a not-worse claim only against a margin."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import typer

from fusion_graph.cli.agreement import agreement, checks_needed, non_inferiority, wilson
from fusion_graph.cli.report import since_time


def shadow(score: int, agrees: bool | None, cost: float = 0.001) -> Any:
    return {"kind": "shadow", "extra": {}, "shadow": {"score": score, "agrees": agrees, "cost_usd": cost}}


def test_the_wilson_interval_matches_its_textbook_values() -> None:
    low, high = wilson(8, 10) or (0, 0)
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)
    low, high = wilson(100, 100) or (0, 0)
    assert high == 1.0 and round(low, 4) == 0.963
    assert wilson(0, 0) is None


def test_checks_needed_is_the_fewest_whose_lower_bound_clears_the_floor() -> None:
    needed = checks_needed(0.97, 0.9)
    assert needed is not None
    assert (wilson(round(0.97 * needed), needed) or (0, 0))[0] >= 0.9
    assert (wilson(round(0.97 * (needed - 1)), needed - 1) or (0, 0))[0] < 0.9
    assert checks_needed(0.9, 0.9) is None and checks_needed(0.5, 0.9) is None


def test_no_claim_without_a_margin_nor_without_enough_checks() -> None:
    assert non_inferiority(50, 50, None)["holds"] is None
    few = non_inferiority(19, 20, 0.1)
    assert few["holds"] is False and few["checks_needed"] > 0
    assert "more checks" in few["statement"]
    many = non_inferiority(970, 1000, 0.1)
    assert many["holds"] is True and many["lower_bound"] >= 0.9 and many["checks_needed"] is None
    below = non_inferiority(80, 100, 0.1)
    assert below["holds"] is False and below["checks_needed"] is None and "at or under" in below["statement"]


def test_agreement_by_band_carries_intervals_and_the_verdict() -> None:
    records = [shadow(10, True)] * 9 + [shadow(10, False), shadow(70, True), shadow(70, None)]
    summary = agreement(records, margin=0.2)
    assert summary["checked"] == 11 and summary["agree"] == 10
    assert summary["bands"]["0-19"]["ci95"] == [round(x, 4) for x in wilson(9, 10) or ()]
    assert summary["non_inferiority"]["margin"] == 0.2
    assert summary["cost_usd"] == pytest.approx(0.011)


def test_since_takes_a_span_or_a_time_and_refuses_anything_else() -> None:
    now = datetime(2026, 12, 4, 12, tzinfo=UTC)
    assert since_time("24h", now) == now - timedelta(hours=24)
    assert since_time("7d", now) == now - timedelta(days=7)
    assert since_time("2026-12-01T00:00:00", now) == datetime(2026, 12, 1, tzinfo=UTC)
    with pytest.raises(typer.Exit):
        since_time("yesterday", now)
