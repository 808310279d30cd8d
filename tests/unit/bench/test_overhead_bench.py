"""``bench/overhead.py`` runs every pair it measures, on tiny turns, and reports what it measured."""

from __future__ import annotations

import json

import pytest

from bench import overhead


@pytest.mark.parametrize("mode", [[], ["--floor"], ["--middleware"], ["--telemetry"]])
def test_each_measure_runs_both_sides_and_writes_its_json(
    mode: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    overhead.main(["--steps", "3", "--rounds", "1", *mode])
    result = json.loads(capsys.readouterr().out)
    [row] = result["results"]
    assert (row["steps_per_turn"], row["rounds"]) == (3, 1)
    times = (
        (row["fusion_ms_per_step"], row["create_agent_ms_per_step"])
        if not mode
        else (row["off_ms_per_step"], row["on_ms_per_step"])
    )
    assert all(t > 0 for t in times)
    assert row["ratio"] == pytest.approx(times[0] / times[1] if not mode else times[1] / times[0], rel=0.01)


async def test_the_floor_runs_the_same_turn_as_create_agent() -> None:
    # The same scripted turn through both: each asserts its own answers were all used.
    assert await overhead.run_floor(5, "floor") > 0
    assert await overhead.run_agent(5, "agent") > 0


def test_two_measures_at_once_are_refused() -> None:
    with pytest.raises(SystemExit):
        overhead.main(["--floor", "--telemetry"])
