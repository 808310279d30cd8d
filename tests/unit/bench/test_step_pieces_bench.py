"""``bench/step_pieces.py`` times each piece of real fusion turns and leaves the package as it found it."""

from __future__ import annotations

import json

import pytest

from bench import step_pieces
from fusion_graph.nodes import step, tools


def timed_names() -> tuple[object, ...]:
    """What the bench patches while it runs."""
    names = vars(step)
    return step.RouteNode.decide, names["decide_step"], names["ask"], tools.wrap_tool_call


def test_every_piece_is_timed_and_the_rest_adds_up(capsys: pytest.CaptureFixture[str]) -> None:
    originals = timed_names()
    step_pieces.main(["--steps", "3", "--rounds", "1"])
    [row] = json.loads(capsys.readouterr().out)["results"]
    assert (row["steps_per_turn"], row["rounds"]) == (3, 1)
    assert set(row["us_per_step"]) == set(step_pieces.PIECES)
    # Each piece ran in the turn: a stopwatch that saw nothing would read 0.
    assert all(value > 0 for value in row["us_per_step"].values()), row
    assert all(value > 0 for value in row["model_run_us_per_step"].values()), row
    model = row["model_run_us_per_step"]
    own = sum(row["us_per_step"].values()) + model["fusion"] - model["agent"]
    expected = row["fusion_us_per_step"] - row["create_agent_us_per_step"] - own
    assert row["rest_us_per_step"] == pytest.approx(expected, abs=0.5)
    assert timed_names() == originals


def test_the_watch_subtracts_the_inner_call() -> None:
    watch = step_pieces.Stopwatch()
    watch.ns.update({"decide": 5, "infer": 30, "ask": 20, "model fusion": 12, "hook": 9, "tool": 4})
    assert watch.pieces() == {"decision": 5, "executor": 10, "provider call": 8, "tool hook": 5}
