"""Calibration math on synthetic scores: the fitted dial gives the share it promises."""

from __future__ import annotations

import dataclasses
import json
import random
from itertools import pairwise
from pathlib import Path

import pytest

from fusion_graph.context import FusionContext
from fusion_graph.errors import CalibrationError
from fusion_graph.replay.calibration import (
    best_plain_share,
    calibrate,
    calibrate_many,
    check_target,
    fit_quantiles,
    fit_threshold,
    fraction_at,
    share_for,
)
from fusion_graph.replay.evaluation import permutation_p, rank_auc, split_halves
from fusion_graph.replay.replayed import replay_trajectory
from fusion_graph.replay.shares import (
    ScoredStep,
    ShareCount,
    TargetOf,
    Trace,
    route_scores,
    scored_steps,
    share_of,
    shares_of,
)
from fusion_graph.replay.traces import load_trajectories
from fusion_graph.routing.rule import QUANTILE_TABLE_LENGTH
from fusion_graph.routing.score import StepScore


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


# --------------------------------------------------------------------------- all steps, cost


def priced(traces: list[Trace], cloud: float = 1.0, local: float = 0.0) -> list[Trace]:
    """``traces`` with every step priced ``cloud`` USD on cloud and ``local`` USD locally."""
    return [[dataclasses.replace(s, cloud_cost=cloud, local_cost=local) for s in trace] for trace in traces]


def test_shares_count_all_steps_continuations_plans_and_cost() -> None:
    traces = priced(random_traces(5, count=20), cloud=2.0, local=0.5)
    context = FusionContext(cloud_share=40)
    shares = shares_of(traces, context)
    legs = [[d.leg for d in route_scores(t, context)] for t in traces]
    steps = [(s.step, leg) for t, ls in zip(traces, legs, strict=True) for s, leg in zip(t, ls, strict=True)]
    assert shares.all == ShareCount(len(steps), sum(leg == "cloud" for _, leg in steps))
    assert shares.continuation == share_of(traces, context)
    plans = [leg for step, leg in steps if step == 0]
    assert shares.plans == ShareCount(len(plans), len(plans))  # every plan on cloud at cloud_share > 0
    assert shares.cost == pytest.approx(2.0 * shares.all.cloud + 0.5 * (shares.all.steps - shares.all.cloud))
    assert shares.all_cloud_cost == pytest.approx(2.0 * len(steps))
    assert shares.fraction("all") == shares.all.fraction
    assert shares.fraction("continuation") == shares.continuation.fraction
    assert shares.fraction("cost") == shares.cost_fraction
    unpriced = shares_of(random_traces(5, count=20), context)
    assert (unpriced.cost, unpriced.cost_fraction) == (None, None)


def test_an_all_steps_target_searches_the_share_with_the_same_table_and_pace() -> None:
    traces = random_traces(8, count=40)
    context = FusionContext(pace_slack=0.5)
    floor = shares_of(traces, dataclasses.replace(context, cloud_share=1)).plans
    total = shares_of(traces, context).all.steps
    target = round((floor.steps / total + 1) / 2, 2)  # halfway between the plans' floor and 1
    found = calibrate(traces, target, context, of="all")
    assert found.of == "all" and found.shares is not None
    assert found.context.score_quantiles == fit_quantiles(traces, 10)
    assert found.context.pace_slack == 0.5
    assert found.achieved == shares_of(traces, found.context).all.fraction == found.shares.all.fraction
    errors = {
        s: abs(shares_of(traces, dataclasses.replace(found.context, cloud_share=s)).all.fraction - target)
        for s in range(101)
    }
    assert errors[found.context.cloud_share] == min(errors.values())
    assert found.unreachable() is None
    # The continuation share it gives sits below: plans take part of the all-steps share.
    assert found.shares.continuation.fraction < found.achieved


def test_an_all_steps_target_below_the_plans_floor_is_unreachable_and_says_why() -> None:
    traces = random_traces(8, count=40)
    found = calibrate(traces, 0.1, FusionContext(), of="all")
    assert found.floor is not None and found.floor > 0.2
    assert found.context.cloud_share in (0, 1)  # the closest the dial can get
    reason = found.unreachable()
    assert reason is not None
    assert "no cloud_share gives 0.10 of all steps" in reason
    assert "Plans (step 0 of each turn) run on cloud whenever cloud_share > 0" in reason
    assert f"at least {found.floor:.2f}" in reason
    # A continuation target is never called unreachable, and 0 is always reachable.
    assert calibrate(traces, 0.05, FusionContext()).unreachable() is None
    zero = calibrate(traces, 0.0, FusionContext(), of="all")
    assert (zero.context.cloud_share, zero.achieved, zero.unreachable()) == (0, 0.0, None)


def test_a_cost_target_prices_each_step_on_its_leg() -> None:
    traces = priced(random_traces(8, count=40), cloud=3.0, local=0.0)
    found = calibrate(traces, 0.7, FusionContext(pace_slack=0.5), of="cost")
    assert found.shares is not None
    assert found.achieved == found.shares.cost_fraction == pytest.approx(found.shares.all.fraction)
    assert abs(found.achieved - 0.7) <= 0.05
    with pytest.raises(CalibrationError, match="cost target needs the cloud model's price"):
        calibrate(random_traces(8, count=40), 0.7, FusionContext(), of="cost")


def test_calibrate_many_fits_once_and_matches_calibrate() -> None:
    traces = random_traces(9, count=30)
    context = FusionContext(pace_slack=0.5)
    for of in ("continuation", "all"):
        many = calibrate_many(traces, [0.2, 0.6, 0.9], context, of=of)
        single = [calibrate(traces, t, context, of=of) for t in (0.2, 0.6, 0.9)]
        assert [(c.context, c.achieved) for c in many] == [(c.context, c.achieved) for c in single]


@pytest.mark.parametrize(
    ("of", "message"), [("cost", "target cost fraction"), ("all", "target cloud fraction")]
)
def test_targets_outside_0_1_are_refused_for_every_kind(of: TargetOf, message: str) -> None:
    with pytest.raises(CalibrationError, match=f"{message} must be between 0 and 1"):
        check_target(1.2, of)
    with pytest.raises(CalibrationError, match="fraction of one of"):
        check_target(0.2, "tokens")  # type: ignore[arg-type]


def test_scored_steps_carry_costs_for_cost_targets(tmp_path: Path) -> None:
    trajectory = load_trajectories([write_traces(tmp_path / "tiny.jsonl")])[0]
    replayed = replay_trajectory(trajectory, FusionContext()).steps
    costs = [(float(i), 0.5) for i in range(len(replayed))]
    steps = scored_steps(replayed, costs)
    assert [(s.cloud_cost, s.local_cost) for s in steps] == costs
    assert [s.score for s in steps] == [s.score for s in scored_steps(replayed)]
    with pytest.raises(CalibrationError, match="step costs"):
        scored_steps(replayed, costs[:-1])
