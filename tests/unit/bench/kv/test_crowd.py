"""Pure helpers of ``bench.kv.crowd`` (no worker process, no server, no shared trace data)."""

from __future__ import annotations

import pytest

from bench.kv.crowd import (
    BOX_FLAGS,
    CrowdVariant,
    build_grid,
    checks,
    parse_args,
    parse_flags,
    parse_policies,
    returning_turns,
    table,
    turn_order,
)
from bench.kv.plan import PlannedStep, ThreadPlan
from bench.kv.results import StepRecord
from bench.kv.workers_results import PlacedStep
from bench.traces import Trajectory


def plan(name: str, legs: str) -> ThreadPlan:
    """A thread whose steps are ``legs`` (``l`` local, ``c`` cloud) at positions 2, 4, ..."""
    steps = tuple(
        PlannedStep(2 * (i + 1), i, "local" if leg == "l" else "cloud", 100, 10, 90)
        for i, leg in enumerate(legs)
    )
    return ThreadPlan(Trajectory("swe-x", 1, name, ()), steps)


def test_turns_go_round_robin_and_skip_cloud_steps() -> None:
    order = turn_order([plan("a", "llcll"), plan("b", "ll")], steps_per_turn=2)
    assert order == [(0, 0, [2, 4]), (1, 0, [2, 4]), (0, 1, [8, 10])]


def test_the_grid_runs_shared_everywhere_and_the_baselines_on_one_box() -> None:
    grid = build_grid([3], ("shared", "in-process", "no-slot"), ("documented",))
    assert [v.name for v in grid] == [
        "shared-w1-b1-x3-documented",
        "shared-w2-b1-x3-documented",
        "shared-w1-b2-x3-documented",
        "shared-w2-b2-x3-documented",
        "in-process-w1-b1-x3-documented",
        "no-slot-w1-b1-x3-documented",
    ]
    both = build_grid([3], ("no-slot",))  # llama-server's own flags, then the documented ones
    assert [v.name for v in both] == ["no-slot-w1-b1-x3-defaults", "no-slot-w1-b1-x3-documented"]
    assert BOX_FLAGS["defaults"] == () and "--slot-prompt-similarity" in BOX_FLAGS["documented"]
    assert CrowdVariant("shared", 2, 1, 10, "defaults").name == "shared-w2-b1-x10-defaults"
    with pytest.raises(Exception, match="policies"):
        parse_policies("shared,lru")
    with pytest.raises(Exception, match="flags"):
        parse_flags("documented,tuned")


def step(thread: str, slot: int | None, finished: float, *, prompt_n: int, minimum: int = 10) -> PlacedStep:
    record = StepRecord("swe-x", "local", prompt_n + 50, minimum, 0, prompt_n=prompt_n, cache_n=50)
    return PlacedStep(record, thread, int(finished), box=0, slot=slot, finished=finished)


def test_a_return_counts_as_displaced_when_its_slot_served_another_thread_and_restored_at_its_minimum() -> (
    None
):
    steps = [
        step("a", 0, 1.0, prompt_n=500),  # a's first request
        step("b", 0, 2.0, prompt_n=500),  # b takes a's slot
        step("a", 0, 3.0, prompt_n=10),  # a back: displaced, restored (its minimum)
        step("a", 0, 4.0, prompt_n=10),  # a again on its own slot: not displaced
        step("b", 1, 5.0, prompt_n=400),  # b back elsewhere, slot 1 never b's: displaced, cold
        step("c", None, 6.0, prompt_n=300),
        step("c", None, 7.0, prompt_n=10),  # no named slot: every return counts
    ]
    assert returning_turns(steps) == (3, 2)


def test_checks_judge_shared_rows_at_3x_and_10x_and_the_table_fits_80_columns() -> None:
    leaf = {
        "policy": "shared",
        "workers": 2,
        "box_count": 2,
        "box_slots": 5,
        "threads": 80,
        "multiple": 10,
        "processed_tokens": 108,
        "minimum_tokens": 100,
        "processed_over_minimum": 1.08,
        "displaced_returns": 140,
        "restored_returns": 128,
        "guest_requests": 0,
        "idle_leases_taken": 212,
        "wall_s": 70.2,
    }
    baseline = {**leaf, "policy": "no-slot", "processed_over_minimum": 1.5}
    over = {**leaf, "multiple": 3, "processed_over_minimum": 1.08, "processed_tokens": 108}
    found = checks({"a": leaf, "b": baseline, "c": over})
    assert [(name, holds) for name, holds, _ in found] == [("a", True), ("c", False)]
    # llama-server's own flags carry no prefill target; divergent answers fail any placement of the graph.
    loose = {**over, "flags": "defaults", "answers_checked": 48, "divergent_answers": 2}
    assert [(name, holds) for name, holds, _ in checks({"d": loose})] == [("d", False)]
    clean = {**loose, "divergent_answers": 0}
    assert [(name, holds) for name, holds, _ in checks({"e": clean})] == [("e", True)]
    assert all(len(line) <= 80 for line in table({"a": leaf, "b": baseline, "d": loose}).splitlines())


def test_the_arguments_refuse_what_cannot_run() -> None:
    assert parse_args([]).multiples == (1, 3, 10)
    for bad in (["--slots", "7"], ["--local-steps", "2"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
