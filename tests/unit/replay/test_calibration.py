"""Calibration math on synthetic scores: the fitted dial gives the share it promises."""

from __future__ import annotations

import dataclasses
import json
import random
from itertools import pairwise
from pathlib import Path

import pytest

from fusion_graph.context import FusionContext
from fusion_graph.replay.calibration import (
    CalibrationError,
    ScoredStep,
    ShareCount,
    Trace,
    best_plain_share,
    calibrate,
    fit_quantiles,
    fit_threshold,
    fraction_at,
    permutation_p,
    rank_auc,
    route_scores,
    scored_steps,
    share_for,
    share_of,
    split_halves,
)
from fusion_graph.replay.traces import load_trajectories, replay_trajectory
from fusion_graph.routing import QUANTILE_TABLE_LENGTH, StepScore


def points(value: float) -> StepScore:
    """A score of ``value`` exact points (all in the turn-depth term)."""
    return StepScore(
        score=int(value + 0.5), context_pressure=0, turn_depth=value, transient_notice=0, tail_growth=0
    )


def one_step_turns(values: list[float]) -> list[Trace]:
    """One trajectory per value: a plan, then one continuation step scoring ``value``."""
    return [[ScoredStep(0, points(1.0)), ScoredStep(1, points(v))] for v in values]


def random_traces(seed: int, count: int = 12) -> list[Trace]:
    """Trajectories of 1-3 turns, each a plan then 0-6 steps with rising scores."""
    rng = random.Random(seed)
    traces: list[Trace] = []
    for _ in range(count):
        trace: list[ScoredStep] = []
        for _ in range(rng.randint(1, 3)):
            trace.append(ScoredStep(0, points(round(rng.uniform(0, 5), 2))))
            level = rng.uniform(0, 30)
            for step in range(1, rng.randint(1, 7)):
                level += rng.uniform(-4, 8)
                trace.append(ScoredStep(step, points(round(min(max(level, 0), 100), 2))))
        traces.append(trace)
    return traces


def with_table(table: tuple[float, ...], share: int, hysteresis: int = 10) -> FusionContext:
    return FusionContext(cloud_share=share, hysteresis=hysteresis, score_quantiles=table)


# --------------------------------------------------------------------------- fitting


def test_without_hysteresis_each_share_is_exact_on_independent_steps() -> None:
    traces = one_step_turns([v / 2 for v in range(1, 201)])  # 200 distinct continuation scores, 0.5-100
    table = fit_quantiles(traces, hysteresis=0)
    for share in range(1, 100):
        count = share_of(traces, with_table(table, share, hysteresis=0))
        assert count.steps == 200
        assert count.cloud == 2 * share, share
    # The bar for share s is the (2s)-th highest score: (201 - 2s) / 2.
    assert table[100 - 30] == 70.5


def test_fit_threshold_splits_steps_that_share_an_integer_score() -> None:
    # Ten steps all scoring 5 as an integer; only their points differ.
    traces = one_step_turns([4.6 + 0.09 * i for i in range(10)])
    bar = fit_threshold(traces, 0.3, hysteresis=0)
    assert bar == pytest.approx(5.23)  # the three highest: 5.23, 5.32, 5.41
    assert fraction_at([[(s.step, s.score.points) for s in t] for t in traces], bar, 0) == pytest.approx(0.3)


def test_table_is_valid_and_non_decreasing() -> None:
    table = fit_quantiles(random_traces(1), hysteresis=10)
    assert len(table) == QUANTILE_TABLE_LENGTH
    assert all(a <= b for a, b in pairwise(table))
    assert all(0 <= value <= 100 for value in table)
    assert FusionContext(score_quantiles=table).score_quantiles == table


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("hysteresis", [0, 10])
def test_fitted_shares_hold_in_sample_with_hysteresis(seed: int, hysteresis: int) -> None:
    traces = random_traces(seed, count=30)
    table = fit_quantiles(traces, hysteresis)
    total = share_of(traces, with_table(table, 50, hysteresis)).steps
    for share in (10, 20, 30, 50, 70):
        achieved = share_of(traces, with_table(table, share, hysteresis)).fraction
        # The achievable fractions move in steps of about 1/total (a flip can cascade through a run).
        assert abs(achieved - share / 100) <= 3 / total, (share, achieved)


@pytest.mark.parametrize("seed", range(6))
def test_fast_fraction_agrees_with_decide_leg(seed: int) -> None:
    rng = random.Random(seed)
    traces = random_traces(seed)
    pairs = [[(s.step, s.score.points) for s in t] for t in traces]
    for _ in range(20):
        bar = round(rng.uniform(0, 60), 2)
        hysteresis = rng.choice([0, 3, 10, 25])
        context = with_table((bar,) * QUANTILE_TABLE_LENGTH, rng.randint(1, 99), hysteresis)
        assert fraction_at(pairs, bar, hysteresis) == share_of(traces, context).fraction


def test_a_pace_counts_each_trajectory_on_its_own() -> None:
    # Two one-turn trajectories of 5 low-scoring steps at 40 %: each gets its own 2 cloud steps,
    # whereas a count carried over from the first would change the second.
    traces: list[Trace] = [
        [ScoredStep(0, points(1.0)), *(ScoredStep(k, points(2.0)) for k in range(1, 6))]
    ] * 2
    context = dataclasses.replace(with_table((50.0,) * QUANTILE_TABLE_LENGTH, 40), pace_slack=0.5)
    for trace in traces:
        legs = [d.leg for d in route_scores(trace, context)]
        assert legs[1:].count("cloud") == 2
    assert share_of(traces, context) == ShareCount(10, 4)
    assert share_of(traces, dataclasses.replace(context, pace_slack=None)) == ShareCount(10, 0)


def test_no_continuation_steps_is_an_error() -> None:
    with pytest.raises(CalibrationError, match="no continuation steps"):
        fit_quantiles([[ScoredStep(0, points(3.0))]], hysteresis=10)


@pytest.mark.parametrize("slack", [0.5, 1.0])
def test_a_paced_table_holds_every_trajectory_within_the_slack(slack: float) -> None:
    traces = random_traces(3, count=30)
    table = fit_quantiles(traces, 10)
    for share in (10, 30, 50):
        context = dataclasses.replace(with_table(table, share), pace_slack=slack)
        for trace in traces:
            count = share_of([trace], context)
            assert abs(count.cloud - share / 100 * count.steps) <= slack + 1e-9, (share, count)
        total = share_of(traces, context)
        assert abs(total.fraction - share / 100) <= slack * len(traces) / total.steps


def leveled_traces(seed: int, levels: tuple[float, float], count: int = 20) -> list[Trace]:
    """One-turn trajectories of 4-12 steps whose scores sit around a level of their own.

    Steps of one trajectory rise and fall together, as on real traces: the level is drawn per
    trajectory from ``levels``, each step adds a little noise.
    """
    rng = random.Random(seed)
    traces: list[Trace] = []
    for _ in range(count):
        level = rng.uniform(*levels)
        steps = [ScoredStep(0, points(1.0))]
        for step in range(1, rng.randint(4, 12)):
            steps.append(ScoredStep(step, points(round(min(max(level + rng.uniform(-3, 3), 0), 100), 2))))
        traces.append(steps)
    return traces


def test_a_pace_holds_the_share_on_trajectories_the_table_was_not_fitted_on() -> None:
    # Fitted on trajectories scoring 5-25, replayed on ones scoring 20-40: the table alone sends
    # far more than its share to cloud; the paced dial holds each trajectory within its slack.
    seen, unseen = leveled_traces(1, (5, 25)), leveled_traces(2, (20, 40))
    table = fit_quantiles(seen, 10)
    for slack in (None, 0.5):
        context = dataclasses.replace(with_table(table, 30), pace_slack=slack)
        assert abs(share_of(seen, context).fraction - 0.3) <= 0.03  # in sample, both hold
        count = share_of(unseen, context)
        if slack is None:
            assert count.fraction - 0.3 > 0.2
        else:  # each of the 20 trajectories within half a step of 30 % of its own steps
            assert abs(count.cloud - 0.3 * count.steps) <= 0.5 * len(unseen)
            assert abs(count.fraction - 0.3) <= 0.05


# --------------------------------------------------------------------------- calibrate


def test_calibrate_returns_the_context_to_run_with() -> None:
    traces = random_traces(7, count=40)
    base = FusionContext(hysteresis=10, max_steps=30)
    found = calibrate(traces, 0.25, base)
    assert found.context.cloud_share == 25
    assert found.context.max_steps == 30  # the rest of the context is kept
    assert found.context.score_quantiles is not None
    assert found.achieved == share_of(traces, found.context).fraction
    assert abs(found.achieved - 0.25) <= 3 / found.continuation_steps
    assert found.context.pace_slack is None  # the context's pace (none) is kept


def test_calibrate_keeps_the_contexts_pace_and_fits_the_table_without_it() -> None:
    traces = random_traces(7, count=40)
    found = calibrate(traces, 0.25, FusionContext(pace_slack=0.5))
    assert found.context.pace_slack == 0.5
    assert found.context.score_quantiles == fit_quantiles(traces, 10)
    assert found.achieved == share_of(traces, found.context).fraction
    # The design-rule baseline is the plain dial: no table, no pace.
    paced_plain = best_plain_share(traces, 0.25, FusionContext(pace_slack=0.5))
    assert paced_plain == best_plain_share(traces, 0.25, FusionContext())


@pytest.mark.parametrize(("target", "share"), [(0.0, 0), (0.204, 20), (0.5, 50), (1.0, 100)])
def test_share_for_rounds_the_target_to_a_percent(target: float, share: int) -> None:
    assert share_for(target) == share


@pytest.mark.parametrize("target", [-0.1, 1.5, float("nan")])
def test_share_for_refuses_targets_outside_0_1(target: float) -> None:
    with pytest.raises(CalibrationError, match="between 0 and 1"):
        share_for(target)


def test_the_design_rule_cannot_reach_targets_its_scores_never_reach() -> None:
    # Continuation scores 5-8, as on real traces: every share up to 50 leaves them all local, and
    # above it the integer scores move the share in jumps of about a third.
    traces = one_step_turns([5.0 + 0.03 * i for i in range(100)])
    plain = FusionContext(hysteresis=10)
    assert {share_of(traces, dataclasses.replace(plain, cloud_share=s)).fraction for s in range(1, 51)} == {
        0.0
    }
    best = best_plain_share(traces, 0.3, plain)
    errors = {
        s: abs(share_of(traces, dataclasses.replace(plain, cloud_share=s)).fraction - 0.3) for s in range(101)
    }
    assert errors[best] == min(errors.values())
    assert errors[best] > 0.1  # while the calibrated table hits it
    assert abs(calibrate(traces, 0.3, plain).achieved - 0.3) <= 0.01


# --------------------------------------------------------------------------- against the graph's replay


def write_traces(path: Path) -> Path:
    """Three small single-turn tool-loop conversations with growing tool output."""
    lines = []
    for index in range(3):
        messages: list[dict[str, object]] = [
            {"role": "system", "content": "You are an agent."},
            {"role": "user", "content": f"task {index}"},
        ]
        for step in range(4 + index):
            call_id = f"c{index}-{step}"
            call = {"id": call_id, "type": "function", "function": {"name": "read", "arguments": "{}"}}
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": "x" * (200 * step * (index + 1))}
            )
        messages.append({"role": "assistant", "content": "done"})
        lines.append(json.dumps({"id": f"t{index}", "messages": messages, "reward": index % 2}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("slack", [None, 0.5, 1.0])
def test_route_scores_equals_route_history_under_a_calibrated_dial(
    tmp_path: Path, slack: float | None
) -> None:
    trajectories = load_trajectories([write_traces(tmp_path / "tiny.jsonl")])
    base = FusionContext(conversation_max_tokens=2048, pace_slack=slack)
    scored = [scored_steps(replay_trajectory(t, base).steps) for t in trajectories]
    table = fit_quantiles(scored, base.hysteresis)
    for share in (10, 40, 70):
        context = dataclasses.replace(base, cloud_share=share, score_quantiles=table)
        for trajectory, trace in zip(trajectories, scored, strict=True):
            replayed = replay_trajectory(trajectory, context).steps
            assert [d.leg for d in route_scores(trace, context)] == [s.leg for s in replayed]
            assert [d.threshold for d in route_scores(trace, context)] == [
                s.decision.threshold for s in replayed
            ]


# --------------------------------------------------------------------------- evaluation helpers


def test_split_halves_is_a_seeded_partition() -> None:
    first, second = split_halves(9, seed=3)
    assert sorted(first + second) == list(range(9))
    assert (len(first), len(second)) == (4, 5)
    assert split_halves(9, seed=3) == (first, second)
    assert split_halves(9, seed=4) != (first, second)


def test_rank_auc() -> None:
    assert rank_auc([3, 4], [1, 2]) == 1.0
    assert rank_auc([1, 2], [3, 4]) == 0.0
    assert rank_auc([1, 3], [2, 2]) == 0.5
    assert rank_auc([2], [2]) == 0.5
    with pytest.raises(ValueError, match="each group"):
        rank_auc([], [1])


def test_permutation_p_is_small_only_for_a_real_difference() -> None:
    separated = permutation_p([10, 11, 12, 13, 14, 15], [1, 2, 3, 4, 5, 6], rounds=500)
    mixed = permutation_p([1, 4, 5, 8, 9, 12], [2, 3, 6, 7, 10, 11], rounds=500)
    assert separated < 0.01
    assert mixed > 0.5
