"""``bench/overhead.py`` runs every pair it measures, on tiny turns, and reports what it measured."""

from __future__ import annotations

import json

import pytest

from bench import overhead


@pytest.mark.parametrize("mode", [[], ["--floor"], ["--middleware"], ["--telemetry"], ["--warm"]])
def test_each_measure_runs_both_sides_and_writes_its_json(
    mode: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    overhead.main(["--steps", "3", "--rounds", "1", *mode])
    result = json.loads(capsys.readouterr().out)
    [row] = result["results"]
    assert (row["steps_per_turn"], row["rounds"]) == (3, 1)
    off, on = overhead.PAIRS[mode[0].removeprefix("--") if mode else "fusion"].names
    times = (row[f"{off}_ms_per_step"], row[f"{on}_ms_per_step"])
    assert all(t > 0 for t in times)
    assert row["ratio"] == pytest.approx(times[1] / times[0], rel=0.01)


async def test_the_floor_runs_the_same_turn_as_create_agent() -> None:
    # The same scripted turn through both: each asserts its own answers were all used.
    assert await overhead.run_floor(5, "floor") > 0
    assert await overhead.run_agent(5, "agent") > 0


async def test_warm_turns_run_through_one_graph_a_length() -> None:
    overhead.WARM_GRAPHS.clear()
    # The same script turn after turn, each on a new thread: each turn asserts its own answers.
    for thread in ("a", "b", "c"):
        assert await overhead.run_fusion_warm(4, thread) > 0
        assert await overhead.run_agent_warm(4, thread) > 0
    assert await overhead.run_fusion_warm(2, "d") > 0
    assert sorted(overhead.WARM_GRAPHS) == [("create_agent", 4), ("fusion", 2), ("fusion", 4)]


def test_two_measures_at_once_are_refused() -> None:
    with pytest.raises(SystemExit):
        overhead.main(["--floor", "--telemetry"])


def test_a_turn_too_long_to_stay_local_is_refused_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        overhead.main(["--steps", "30", str(overhead.LONGEST_TURN + 1)])
    assert "fills the conversation budget" in capsys.readouterr().err


async def test_the_longest_turn_allowed_stays_local_after_its_plan() -> None:
    # fusion_turn asserts the plan on cloud and every later step on local.
    graph = overhead.fusion_graph(overhead.LONGEST_TURN, overhead.replayed)
    assert await overhead.fusion_turn(graph, overhead.LONGEST_TURN, "longest") > 0
