"""Pure helpers of ``bench.kv.reuse --workers`` (no worker process, no server, no shared trace data)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from bench.kv.plan import PlannedStep, ThreadPlan
from bench.kv.results import StepRecord
from bench.kv.reuse import parse_args
from bench.kv.workers import (
    CACHE_RAM_MIB,
    WorkersVariant,
    build_grid,
    check_arguments,
    database_name,
    parse_counts,
    parse_placements,
    runs_of,
    step_workers,
    truncate_plan,
    worker_env,
    worker_for,
)
from bench.kv.workers_results import (
    SHARED_OVER_MINIMUM,
    PlacedStep,
    evaluate_checks,
    format_checks,
    format_workers_table,
    slot_collisions,
    summarize_workers,
    thread_moves,
)
from bench.traces import Trajectory

BOX_A, BOX_B = "http://127.0.0.1:1", "http://127.0.0.1:2"


def test_workers_arguments_and_their_defaults() -> None:
    args = parse_args(["--workers", "1,2,4"])
    assert args.workers == (1, 2, 4) and args.threads == [8]
    assert args.placements == ("in-process", "shared")
    assert (args.boxes, args.spare_at, args.steps_per_run) == ((1, 2), (2,), 5)
    assert args.cache_ram == CACHE_RAM_MIB == 0
    assert not args.gateway
    chosen = parse_args(
        ["--workers", "2", "--placements", "shared", "--boxes", "2", "--spare-at", "", "--steps-per-run", "3"]
    )
    assert (chosen.workers, chosen.placements, chosen.boxes, chosen.spare_at) == ((2,), ("shared",), (2,), ())
    assert chosen.steps_per_run == 3
    assert parse_args([]).workers is None  # the one-box benchmark stays the default


def test_counts_and_placements_parse_in_order_and_refuse_the_rest() -> None:
    assert parse_counts("4, 1,4,2") == (4, 1, 2)
    assert parse_counts("", allow_empty=True) == ()
    for bad in ("", "0", "1,x", "-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_counts(bad)
    assert parse_placements("shared, in-process,shared") == ("shared", "in-process")
    for bad in ("", "in_process", "shared,gateway"):
        with pytest.raises(argparse.ArgumentTypeError, match="in-process"):
            parse_placements(bad)


def test_arguments_workers_cannot_run_are_refused() -> None:
    for argv, message in (
        (["--workers", "2", "--gateway"], "--gateway"),
        (["--workers", "2", "--threads", "4,8"], "one thread count"),
        (["--workers", "2", "--boxes", "3"], "--boxes"),
        (["--workers", "2", "--steps-per-run", "0"], "--steps-per-run"),
    ):
        with pytest.raises(SystemExit, match=message):
            check_arguments(parse_args(argv))
    check_arguments(parse_args(["--workers", "2", "--threads", "4"]))


def test_the_default_grid_and_each_variants_slots() -> None:
    grid = build_grid((1, 2, 4))
    assert len(grid) == 2 * 3 * 2 + 2 * 2
    assert [v.name for v in grid[:4]] == [
        "in-process-w1-b1-tight",
        "shared-w1-b1-tight",
        "in-process-w2-b1-tight",
        "shared-w2-b1-tight",
    ]
    assert [v.name for v in grid[-4:]] == [
        "in-process-w2-b1-spare",
        "shared-w2-b1-spare",
        "in-process-w2-b2-spare",
        "shared-w2-b2-spare",
    ]
    # tight: as many conversation slots in all as threads, plus each box's reflection slot; spare: twice
    assert WorkersVariant("shared", 2, 1, "tight").box_slots(8) == 9
    assert WorkersVariant("shared", 2, 2, "tight").box_slots(8) == 5
    assert WorkersVariant("shared", 2, 1, "spare").box_slots(8) == 17
    assert WorkersVariant("shared", 2, 2, "spare").box_slots(8) == 9
    assert WorkersVariant("shared", 2, 2, "tight").box_slots(7) == 5  # rounded up per box
    assert build_grid((2,), boxes=(2,), placements=("shared",), spare_at=(2,)) == [
        WorkersVariant("shared", 2, 2, "tight"),
        WorkersVariant("shared", 2, 2, "spare"),
    ]
    assert database_name(WorkersVariant("in-process", 4, 2, "spare")) == "kv_in_process_w4_b2_spare"


def test_a_threads_runs_go_round_robin_from_its_own_worker() -> None:
    assert runs_of([1, 2, 3, 4, 5, 6, 7], 3) == [[1, 2, 3], [4, 5, 6], [7]]
    assert runs_of([], 5) == []
    with pytest.raises(ValueError):
        runs_of([1], 0)
    assert [worker_for(i, k, 2) for i in range(2) for k in range(3)] == [0, 1, 0, 1, 0, 1]
    assert [worker_for(3, k, 4) for k in range(3)] == [3, 0, 1]
    assert step_workers(12, 0, steps_per_run=5, workers=2) == [0] * 5 + [1] * 5 + [0] * 2
    assert step_workers(12, 1, steps_per_run=5, workers=2) == [1] * 5 + [0] * 5 + [1] * 2
    assert step_workers(7, 5, steps_per_run=5, workers=1) == [0] * 7
    assert step_workers(4, 2, steps_per_run=5, workers=4) == [2] * 4  # one run: never handed over


def _planned(position: int, leg: str) -> PlannedStep:
    return PlannedStep(position, position, leg, 10 * position, 5, 9 * position)  # type: ignore[arg-type]


def test_quick_keeps_a_threads_first_local_steps() -> None:
    trajectory = Trajectory("swe-x", 1, "id1", ())
    legs = ["cloud", "local", "local", "cloud", "local", "local"]
    plan = ThreadPlan(trajectory, tuple(_planned(2 * i + 2, leg) for i, leg in enumerate(legs)))
    cut = truncate_plan(plan, 3)
    assert [s.leg for s in cut.steps] == ["cloud", "local", "local", "cloud", "local"]
    assert truncate_plan(plan, 10) == plan
    assert truncate_plan(plan, 0).steps == ()


def test_worker_settings_per_placement() -> None:
    in_process = worker_env(
        "in-process",
        local_base_url=f"{BOX_A}/v1",
        boxes=[BOX_A],
        database=None,
    )
    assert in_process["FUSION_LOCAL_BASE_URL"] == f"{BOX_A}/v1"
    assert in_process["FUSION_LOCAL_MODEL"] == "local"
    assert in_process["FUSION_SHARED_STATE"] == "off"
    assert "FUSION_LOCAL_WORKERS" not in in_process and "FUSION_SHARED_STATE_URL" not in in_process
    shared = worker_env(
        "shared",
        local_base_url="http://127.0.0.1:9/v1",
        boxes=[BOX_A, f"{BOX_B}/"],
        database="postgresql://x@127.0.0.1:5/kv",
    )
    assert shared["FUSION_SHARED_STATE"] == "postgres"
    assert shared["FUSION_SHARED_STATE_URL"] == "postgresql://x@127.0.0.1:5/kv"
    assert json.loads(shared["FUSION_LOCAL_WORKERS"]) == [BOX_A, BOX_B]
    with pytest.raises(ValueError, match="database"):
        worker_env("shared", local_base_url=BOX_A, boxes=[BOX_A], database=None)


def _step(
    thread: str,
    position: int,
    box: int,
    slot: int,
    finished: float,
    *,
    prompt_n: int = 10,
    minimum: int = 10,
    notes: dict[str, Any] | None = None,
) -> PlacedStep:
    record = StepRecord("swe-x", "local", prompt_n + 100, minimum, 0, prompt_n=prompt_n, cache_n=100)
    return PlacedStep(
        record, thread, position, run=0, worker=0, box=box, slot=slot, finished=finished, notes=notes or {}
    )


def test_collisions_follow_each_slots_order_and_moves_each_threads() -> None:
    steps = [
        PlacedStep(StepRecord("swe-x", "cloud", 50, 0, 40), "a", 1),  # cloud: ignored
        _step("a", 4, 0, 3, finished=3.0),  # b ran on (0, 3) before: a collision
        _step("b", 2, 0, 3, finished=1.0),
        _step("a", 2, 0, 0, finished=2.0),  # a's first request: a slot nobody used
        _step("b", 4, 0, 3, finished=4.0),  # a ran there last: another collision
        _step("a", 6, 1, 3, finished=5.0),  # another box, same slot number: no collision
        _step("c", 2, 0, 5, finished=0.5),
        _step("c", 4, 0, 5, finished=6.0),  # c again on its own slot
    ]
    assert slot_collisions(steps) == 2
    assert thread_moves(steps) == 2  # a: (0, 0) -> (0, 3) -> (1, 3)
    assert slot_collisions([]) == thread_moves([]) == 0


def test_summary_adds_collisions_moves_and_where_the_excess_ran() -> None:
    steps = [
        PlacedStep(StepRecord("swe-x", "cloud", 50, 0, 40), "a", 1),
        _step("a", 2, 0, 0, 1.0, prompt_n=100, minimum=100),
        _step("b", 2, 0, 0, 2.0, prompt_n=100, minimum=100, notes={"lease": "shared", "guest": True}),
        _step("a", 4, 1, 0, 3.0, prompt_n=130, minimum=30, notes={"lease": "in-process: down"}),
    ]
    leaf = summarize_workers(steps, 2)
    assert (leaf["processed_tokens"], leaf["minimum_tokens"], leaf["processed_over_minimum"]) == (
        330,
        230,
        1.4348,
    )
    assert (leaf["local_steps"], leaf["cloud_steps"]) == (3, 1)
    assert leaf["threads_per_box"] == [2, 1]
    assert (leaf["slot_collisions"], leaf["thread_moves"]) == (1, 1)
    assert (leaf["guest_requests"], leaf["fallback_requests"]) == (1, 1)
    assert leaf["excess_detail"] == [
        {
            "thread": "a",
            "position": 4,
            "run": 0,
            "worker": 0,
            "box": 1,
            "slot": 0,
            "prompt_n": 130,
            "cache_n": 100,
            "minimum": 30,
        }
    ]


def test_table_and_check() -> None:
    base = {"local_steps": 72, "minimum_tokens": 52_824, "wall_s": 14.04, "box_count": 2, "box_slots": 5}
    variants: dict[str, Any] = {
        "in-process-w2-b2-tight": {
            **base,
            "placement": "in-process",
            "workers": 2,
            "slots": "tight",
            "processed_tokens": 80_000,
            "processed_over_minimum": 1.5145,
            "slot_collisions": 12,
            "thread_moves": 5,
            "threads_per_box": [4, 4],
        },
        "shared-w2-b2-tight": {
            **base,
            "placement": "shared",
            "workers": 2,
            "slots": "tight",
            "processed_tokens": 52_824,
            "processed_over_minimum": 1.0,
            "slot_collisions": 0,
            "thread_moves": 0,
            "threads_per_box": [4, 4],
        },
        "shared-w4-b2-tight": {
            **base,
            "placement": "shared",
            "processed_tokens": 60_000,
            "processed_over_minimum": 1.1358,
        },
    }
    table = format_workers_table(variants).splitlines()
    assert table[0].startswith("| placement | workers |") and "processed / minimum" in table[0]
    assert table[1].count("---") == 12
    assert len(table) == 2 + 3
    assert table[2] == (
        "| in-process | 2 | 2 × 5 | tight | 72 | 80,000 | 52,824 | 1.514 | 12 | 5 | 4 / 4 | 14.0 |"
    )
    assert "| - | - |  | 14.0 |" in table[4]  # missing counts print as "-"
    checks = evaluate_checks(variants)
    assert [(c.variant, c.holds) for c in checks] == [
        ("shared-w2-b2-tight", True),
        ("shared-w4-b2-tight", False),
    ]
    lines = format_checks(checks).splitlines()
    assert "HOLDS" in lines[0] and "FAILS" in lines[1] and f"{SHARED_OVER_MINIMUM:.2f}" in lines[1]
    assert evaluate_checks({"shared-w1-b1-tight": {"placement": "shared"}})[0].holds is None
