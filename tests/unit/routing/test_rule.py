"""The pure routing engine: the step score and the leg decision."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from itertools import groupby, pairwise
from typing import Any

import pytest

from fusion_graph.context import FusionContext, ensure_context
from fusion_graph.errors import ContextError
from fusion_graph.routing import rule, score
from fusion_graph.routing.rule import (
    QUANTILE_TABLE_LENGTH,
    Latch,
    Pace,
    check_score_quantiles,
    cloud_threshold,
    decide_leg,
    hysteresis_band,
    latch_rule,
)
from fusion_graph.routing.score import (
    TROUBLE_WEIGHTS,
    WEIGHTS,
    Leg,
    Mode,
    RouteDecision,
    StepScore,
    StepSignals,
    TroubleScore,
    TroubleSignals,
    check_trouble_weights,
    score_step,
)


def sig(**overrides: object) -> StepSignals:
    """Signals that score 0, with ``overrides`` applied."""
    base: dict[str, Any] = {  # Any: some tests feed floats (9e9) to int fields on purpose
        "prompt_tokens": 0,
        "conversation_max_tokens": 1000,
        "step": 0,
        "max_steps": 10,
        "transient_notice": False,
        "tool_output_tokens": 0,
        "stable_prefix_tokens": 100,
    }
    base.update(overrides)
    return StepSignals(**base)


def score_of(value: int) -> StepScore:
    """A score object with the given total (the terms do not matter to ``decide_leg``)."""
    return StepScore(score=value, context_pressure=0, turn_depth=0, transient_notice=0, tail_growth=0)


SATURATED: dict[str, dict[str, object]] = {
    "context_pressure": {"prompt_tokens": 1000},
    "turn_depth": {"step": 10},
    "transient_notice": {"transient_notice": True},
    "tail_growth": {"tool_output_tokens": 100},
}

# --------------------------------------------------------------------------- score


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        pytest.param({}, 0, id="all-zero"),
        pytest.param(SATURATED["context_pressure"], 40, id="context-pressure-alone"),
        pytest.param(SATURATED["turn_depth"], 25, id="turn-depth-alone"),
        pytest.param(SATURATED["transient_notice"], 20, id="notice-alone"),
        pytest.param(SATURATED["tail_growth"], 15, id="tail-growth-alone"),
        pytest.param({k: v for d in SATURATED.values() for k, v in d.items()}, 100, id="all-saturated"),
        pytest.param({"prompt_tokens": 50_000}, 40, id="pressure-clipped"),
        pytest.param({"step": 99}, 25, id="depth-clipped"),
        pytest.param({"tool_output_tokens": 10_000}, 15, id="tail-clipped"),
        pytest.param(
            {"prompt_tokens": 9e9, "step": 999, "transient_notice": True, "tool_output_tokens": 9e9},
            100,
            id="everything-clipped",
        ),
        pytest.param({"prompt_tokens": -500, "tool_output_tokens": -5}, 0, id="negatives-clipped-to-0"),
        pytest.param({"conversation_max_tokens": 0, "prompt_tokens": 1}, 40, id="zero-budget-with-prompt"),
        pytest.param({"conversation_max_tokens": 0}, 0, id="zero-budget-empty-prompt"),
        pytest.param({"max_steps": 0, "step": 0}, 0, id="zero-max-steps-at-step-0"),
        pytest.param({"max_steps": 0, "step": 1}, 25, id="zero-max-steps-later"),
        pytest.param({"stable_prefix_tokens": 0, "tool_output_tokens": 1}, 15, id="zero-prefix-with-output"),
        pytest.param({"stable_prefix_tokens": 0}, 0, id="zero-prefix-no-output"),
    ],
)
def test_score_boundaries(overrides: dict[str, object], expected: int) -> None:
    result = score_step(sig(**overrides))
    assert result.score == expected
    assert isinstance(result.score, int)
    assert sum(result.breakdown().values()) == pytest.approx(expected)


@pytest.mark.parametrize("term", list(SATURATED))
def test_a_saturated_term_is_worth_exactly_its_weight(term: str) -> None:
    breakdown = score_step(sig(**SATURATED[term])).breakdown()
    assert breakdown[term] == WEIGHTS[term]
    assert all(points == 0 for name, points in breakdown.items() if name != term)


@pytest.mark.parametrize(
    ("prompt_tokens", "budget", "expected"),
    [
        pytest.param(1, 16, 3, id="2.5-rounds-half-up"),
        pytest.param(5, 16, 13, id="12.5-rounds-half-up"),
        pytest.param(1, 100, 0, id="0.4-rounds-down"),
        pytest.param(3, 200, 1, id="0.6-rounds-up"),
    ],
)
def test_score_rounds_to_nearest_int_half_up(prompt_tokens: int, budget: int, expected: int) -> None:
    result = score_step(sig(prompt_tokens=prompt_tokens, conversation_max_tokens=budget))
    assert result.score == expected
    assert result.context_pressure == pytest.approx(40 * prompt_tokens / budget)


def test_breakdown_points_are_rounded_to_two_decimals() -> None:
    result = score_step(sig(prompt_tokens=1, conversation_max_tokens=3))
    assert result.context_pressure == 13.33
    assert result.score == 13


def test_weights_sum_to_100_and_name_every_breakdown_term() -> None:
    assert sum(WEIGHTS.values()) == 100
    assert WEIGHTS == {"context_pressure": 40, "turn_depth": 25, "transient_notice": 20, "tail_growth": 15}
    assert set(score_step(sig()).breakdown()) == set(WEIGHTS)


def test_score_reads_the_weights_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(score.WEIGHTS, "context_pressure", 50)
    monkeypatch.setitem(score.WEIGHTS, "tail_growth", 5)
    assert score_step(sig(**SATURATED["context_pressure"])).score == 50
    assert score_step(sig(**SATURATED["tail_growth"])).breakdown()["tail_growth"] == 5


def test_score_has_no_prompt_cache_input() -> None:
    names = {f.name for f in dataclasses.fields(StepSignals)}
    assert not [name for name in names if "cache" in name]
    assert not [name for name in WEIGHTS if "cache" in name]


# --------------------------------------------------------------------------- decide_leg


def run_legs(
    scores: Sequence[int], *, start: Leg, cloud_share: int, hysteresis: int = 10
) -> tuple[list[Leg], list[float | None]]:
    """Feed continuation scores through ``decide_leg`` the way a turn does."""
    leg, legs, thresholds = start, [], []
    for step, value in enumerate(scores, start=1):
        decision = decide_leg(
            mode="fusion",
            step=step,
            current_leg=leg,
            score=score_of(value),
            cloud_share=cloud_share,
            hysteresis=hysteresis,
        )
        leg = decision.leg
        legs.append(leg)
        thresholds.append(decision.threshold)
    return legs, thresholds


def test_hysteresis_over_a_run_of_scores() -> None:
    # cloud_share=30 -> T=70, h=10: local escalates at >= 80, cloud stays down to 60.
    scores = [70, 75, 79, 80, 75, 61, 60, 59, 65, 79, 80, 100]
    legs, thresholds = run_legs(scores, start="local", cloud_share=30)
    assert legs == [
        "local", "local", "local", "cloud", "cloud", "cloud",
        "cloud", "local", "local", "local", "cloud", "cloud",
    ]  # fmt: skip
    assert thresholds == [80, 80, 80, 80, 60, 60, 60, 60, 80, 80, 80, 60]


def test_without_hysteresis_the_leg_follows_the_threshold() -> None:
    legs, _ = run_legs([69, 70, 69, 70], start="cloud", cloud_share=30, hysteresis=0)
    assert legs == ["local", "cloud", "local", "cloud"]


def test_the_band_narrows_near_the_ends_of_the_scale() -> None:
    # cloud_share=5 -> T=95: h' = min(10, 47, 2) = 2, so local escalates at 97 and cloud stays down to 93.
    legs, thresholds = run_legs([96, 97, 93, 92], start="local", cloud_share=5)
    assert legs == ["local", "cloud", "cloud", "local"]
    assert thresholds == [97, 97, 93, 93]


@pytest.mark.parametrize("cloud_share", [90, 95, 99])
def test_no_cliff_a_score_0_step_leaves_cloud_below_share_100(cloud_share: int) -> None:
    # The old rule clamped T - h at 0 from cloud_share 90 up, so after the plan nothing ever left cloud.
    legs, thresholds = run_legs([0, 0], start="cloud", cloud_share=cloud_share)
    assert legs == ["local", "local"]
    base = cloud_threshold(cloud_share)
    assert thresholds[0] == base - min(10, base // 2) >= 1


@pytest.mark.parametrize("cloud_share", range(1, 100))
@pytest.mark.parametrize("hysteresis", [0, 10, 50])
def test_band_bars_stay_inside_the_scale(cloud_share: int, hysteresis: int) -> None:
    base = cloud_threshold(cloud_share)
    escalate_at, stay_down_to = hysteresis_band(base, hysteresis)
    assert 1 <= stay_down_to <= base <= escalate_at <= 99
    assert escalate_at - base == base - stay_down_to <= hysteresis
    assert isinstance(escalate_at, int) and isinstance(stay_down_to, int)


def test_mid_scale_band_is_the_full_hysteresis() -> None:
    assert hysteresis_band(70, 10) == (80, 60)
    assert hysteresis_band(20, 10) == (30, 10)
    assert hysteresis_band(12.34, 10) == (18.34, 6.34)  # calibrated T: h' = 12.34 // 2 = 6


@pytest.mark.parametrize("cloud_share", [1, 30, 99, 100])
@pytest.mark.parametrize("score", [None, score_of(0), score_of(100)])
def test_step_0_goes_cloud_whenever_cloud_share_is_positive(
    cloud_share: int, score: StepScore | None
) -> None:
    decision = decide_leg(mode="fusion", step=0, current_leg=None, score=score, cloud_share=cloud_share)
    assert decision.leg == "cloud"
    assert decision.threshold is None
    assert f"cloud_share={cloud_share}" in decision.reason


@pytest.mark.parametrize("current", ["local", "cloud", None])
@pytest.mark.parametrize("step", [0, 1, 7])
def test_cloud_share_0_never_goes_cloud(current: Leg | None, step: int) -> None:
    decision = decide_leg(mode="fusion", step=step, current_leg=current, score=score_of(100), cloud_share=0)
    assert decision.leg == "local"
    assert "cloud_share=0" in decision.reason


def test_cloud_share_100_is_always_cloud() -> None:
    plan = decide_leg(mode="fusion", step=0, current_leg=None, score=score_of(0), cloud_share=100)
    assert plan.leg == "cloud"
    legs, thresholds = run_legs([0, 0, 50, 0], start=plan.leg, cloud_share=100)
    assert legs == ["cloud"] * 4
    assert thresholds == [None] * 4
    # Even a continuation from a local leg (after a local repair, say) goes cloud at score 0.
    decision = decide_leg(mode="fusion", step=3, current_leg="local", score=score_of(0), cloud_share=100)
    assert decision.leg == "cloud"
    assert "cloud_share=100" in decision.reason


@pytest.mark.parametrize(("mode", "leg"), [("cloud", "cloud"), ("local", "local")])
@pytest.mark.parametrize("cloud_share", [0, 30, 100])
def test_fixed_modes_pin_every_step(mode: Mode, leg: Leg, cloud_share: int) -> None:
    runs: list[tuple[int, Leg | None, int]] = [
        (0, None, 0),
        (1, "local", 100),
        (5, "cloud", 0),
        (9, "local", 0),
    ]
    for step, current, value in runs:
        decision = decide_leg(
            mode=mode, step=step, current_leg=current, score=score_of(value), cloud_share=cloud_share
        )
        assert decision.leg == leg
        assert decision.threshold is None
        assert f"mode={mode}" in decision.reason
        assert decision.score is not None and decision.score.score == value


def test_fusion_mode_routes_by_score() -> None:
    low = decide_leg(mode="fusion", step=3, current_leg="local", score=score_of(10), cloud_share=30)
    high = decide_leg(mode="fusion", step=3, current_leg="local", score=score_of(95), cloud_share=30)
    assert (low.leg, high.leg) == ("local", "cloud")


@pytest.mark.parametrize("cloud_share", [-1, 101, 150])
def test_invalid_cloud_share_names_the_range(cloud_share: int) -> None:
    with pytest.raises(ValueError, match=r"cloud_share must be between 0 and 100"):
        decide_leg(mode="fusion", step=1, current_leg="local", score=score_of(0), cloud_share=cloud_share)


def test_invalid_mode_names_the_valid_modes() -> None:
    with pytest.raises(ValueError, match=r"mode must be one of 'cloud', 'local', 'fusion', got 'x'"):
        decide_leg(mode="x", step=1, current_leg="local", score=score_of(0))  # type: ignore[arg-type]


def test_negative_hysteresis_is_refused() -> None:
    with pytest.raises(ValueError, match=r"hysteresis must be >= 0"):
        decide_leg(mode="fusion", step=1, current_leg="local", score=score_of(0), hysteresis=-1)


def test_fusion_continuation_needs_a_score() -> None:
    with pytest.raises(ValueError, match="need a score"):
        decide_leg(mode="fusion", step=1, current_leg="local", score=None)


@pytest.mark.parametrize("current", ["local", "cloud"])
@pytest.mark.parametrize("value", [0, 59, 60, 79, 80, 100])
def test_reasons_name_score_and_threshold(current: Leg, value: int) -> None:
    decision = decide_leg(mode="fusion", step=2, current_leg=current, score=score_of(value), cloud_share=30)
    assert decision.threshold is not None
    assert decision.reason.strip()
    assert f"score {value}" in decision.reason
    assert str(decision.threshold) in decision.reason
    assert "T=70" in decision.reason
    assert decision.score is not None and decision.score.score == value


@pytest.mark.parametrize(
    ("current", "value", "reason"),
    [
        ("cloud", 60, "score 60 >= 60 (T=70 - h=10): stay on cloud"),
        ("cloud", 59, "score 59 < 60 (T=70 - h=10): back to local"),
        ("local", 80, "score 80 >= 80 (T=70 + h=10): escalate to cloud"),
        (None, 79, "score 79 < 80 (T=70 + h=10): stay local"),
    ],
)
def test_each_side_of_the_band_has_its_reason(current: Leg | None, value: int, reason: str) -> None:
    decision = decide_leg(mode="fusion", step=2, current_leg=current, score=score_of(value), cloud_share=30)
    assert decision.reason == reason
    assert decision.leg == ("cloud" if ">=" in reason else "local")


def test_cloud_threshold_is_100_minus_cloud_share() -> None:
    assert [cloud_threshold(s) for s in (0, 30, 100)] == [100, 70, 0]


# --------------------------------------------------------------------------- calibrated dial


def table(base_for_share: dict[int, float], default: float = 50.0) -> tuple[float, ...]:
    """A non-decreasing table with entry ``100 - share`` set for each given share."""
    values = [default] * 101
    for share, base in base_for_share.items():
        values[100 - share] = base
    return tuple(values)


def points_of(total: float) -> StepScore:
    """A score whose exact points are ``total`` (all in context pressure)."""
    return StepScore(
        score=int(total + 0.5), context_pressure=total, turn_depth=0, transient_notice=0, tail_growth=0
    )


def test_points_are_the_unrounded_sum_of_the_terms() -> None:
    result = score_step(sig(prompt_tokens=1, conversation_max_tokens=3, step=1))
    assert result.points == round(13.33 + 2.78, 2) == 16.11
    assert result.score == 16


def test_calibrated_table_sets_the_threshold_and_compares_points() -> None:
    quantiles = [float(k) / 10 for k in range(101)]  # entry k = k / 10 points
    # cloud_share=30 -> entry 70 = 7.0; h' = min(10, 3, 46) = 3: escalate at 10.0, stay down to 4.0.
    up = decide_leg(
        mode="fusion", step=2, current_leg="local", score=points_of(9.99), score_quantiles=quantiles
    )
    assert (up.leg, up.threshold) == ("local", 10.0)
    up = decide_leg(
        mode="fusion", step=2, current_leg="local", score=points_of(10.0), score_quantiles=quantiles
    )
    assert (up.leg, up.threshold) == ("cloud", 10.0)
    assert "calibrated T=7" in up.reason and "h=3" in up.reason
    # 3.96 points round to score 4, but the calibrated dial compares points: below 4.0, back to local.
    down = decide_leg(
        mode="fusion", step=2, current_leg="cloud", score=points_of(3.96), score_quantiles=quantiles
    )
    assert down.score is not None and down.score.score == 4
    assert (down.leg, down.threshold) == ("local", 4.0)
    assert "3.96 points" in down.reason


def test_without_a_table_the_design_rule_is_unchanged() -> None:
    plain = decide_leg(mode="fusion", step=2, current_leg="local", score=score_of(80), cloud_share=30)
    explicit = decide_leg(
        mode="fusion", step=2, current_leg="local", score=score_of(80), cloud_share=30, score_quantiles=None
    )
    assert plain == explicit
    assert (plain.leg, plain.threshold) == ("cloud", 80)


@pytest.mark.parametrize("cloud_share", [0, 100])
def test_the_ends_of_the_dial_ignore_the_table(cloud_share: int) -> None:
    quantiles = table({}, default=50.0)
    decision = decide_leg(
        mode="fusion",
        step=3,
        current_leg="local",
        score=points_of(0.0 if cloud_share else 100.0),
        cloud_share=cloud_share,
        score_quantiles=quantiles,
    )
    assert decision.leg == ("cloud" if cloud_share else "local")
    assert decision.threshold is None


def test_plan_step_ignores_the_table() -> None:
    decision = decide_leg(
        mode="fusion", step=0, current_leg=None, score=None, cloud_share=1, score_quantiles=table({})
    )
    assert decision.leg == "cloud"


@pytest.mark.parametrize(
    ("quantiles", "message"),
    [
        pytest.param([1.0] * 100, "101 entries", id="too-short"),
        pytest.param([1.0] * 100 + [101.0], "between 0 and 100", id="above-100"),
        pytest.param([-1.0] + [1.0] * 100, "between 0 and 100", id="negative"),
        pytest.param([2.0, 1.0] + [3.0] * 99, "non-decreasing", id="decreasing"),
    ],
)
def test_invalid_tables_are_refused_with_the_reason(quantiles: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_score_quantiles(quantiles)
    with pytest.raises(ValueError, match=message):
        decide_leg(mode="fusion", step=1, current_leg="local", score=score_of(0), score_quantiles=quantiles)


def test_a_valid_table_is_returned_as_floats() -> None:
    assert check_score_quantiles(range(101)) == tuple(float(k) for k in range(101))


# --------------------------------------------------------------------------- paced dial


def run_paced(
    scores: Sequence[int],
    *,
    cloud_share: int,
    slack: float | None,
    hysteresis: int = 10,
    start: Leg = "cloud",
) -> list[Leg]:
    """Continuation scores through ``decide_leg`` with a pace counted as a thread counts it."""
    leg, legs = start, []
    pace = None if slack is None else rule.Pace(slack)
    for step, value in enumerate(scores, start=1):
        decision = decide_leg(
            mode="fusion",
            step=step,
            current_leg=leg,
            score=score_of(value),
            cloud_share=cloud_share,
            hysteresis=hysteresis,
            pace=pace,
        )
        leg = decision.leg
        legs.append(leg)
        if pace is not None:
            pace = pace.after(leg)
    return legs


def drifting_scores(seed: int, count: int = 200) -> list[int]:
    """Scores that wander like a conversation's: a random walk over 0-100."""
    rng = random.Random(seed)
    level, scores = rng.uniform(0, 100), []
    for _ in range(count):
        level = min(max(level + rng.uniform(-12, 12), 0), 100)
        scores.append(round(level))
    return scores


def switches(legs: Sequence[Leg]) -> int:
    return sum(a != b for a, b in pairwise(legs))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cloud_share", [10, 30, 50, 70])
@pytest.mark.parametrize("slack", [0.5, 1.0, 2.5])
def test_the_paced_count_stays_within_the_slack_so_the_share_converges(
    seed: int, cloud_share: int, slack: float
) -> None:
    scores = drifting_scores(seed)
    legs = run_paced(scores, cloud_share=cloud_share, slack=slack)
    for n in range(1, len(legs) + 1):
        cloud = legs[:n].count("cloud")
        assert abs(cloud - cloud_share * n / 100) <= slack + 1e-9, (n, cloud)
    assert abs(legs.count("cloud") / len(legs) - cloud_share / 100) <= slack / len(legs) + 1e-9


def test_without_a_pace_the_same_scores_miss_the_share() -> None:
    # Scores that never reach T + h = 80 at cloud_share 30: unpaced, nothing after step 1 goes cloud.
    scores = [20 + (k % 7) for k in range(60)]
    assert run_paced(scores, cloud_share=30, slack=None).count("cloud") == 0
    assert run_paced(scores, cloud_share=30, slack=0.5).count("cloud") == 18


def test_a_half_step_slack_pins_the_count_to_the_nearest_step() -> None:
    # Low scores at cloud_share 25: the pace alone places the cloud steps, one in every four, at the
    # step where staying local would leave the count 0.75 behind (at 0.5 exactly the band keeps local).
    legs = run_paced([5] * 40, cloud_share=25, slack=0.5, start="local")
    assert legs == ["local", "local", "cloud", "local"] * 10
    assert switches(legs) == 20  # at a half-step slack each cloud step is a run of its own


def test_the_score_picks_the_steps_inside_the_slack() -> None:
    # At cloud_share 20 with a slack of 2, one high score amid low ones goes cloud on its own,
    # before the count falls behind: the score, not the pace, placed it.
    scores = [10, 10, 95, 10, 10, 10, 10, 10]
    legs = run_paced(scores, cloud_share=20, slack=2.0, start="local")
    assert legs[2] == "cloud"
    assert legs.count("cloud") == 1


def test_hysteresis_still_keeps_runs_long_under_a_pace() -> None:
    # Scores inside the band around T = 70 (h = 10): the band never escalates on its own, and
    # once the pace has forced a step to cloud the band keeps it there until the pace ends the run.
    scores = [75, 65] * 50
    banded = run_paced(scores, cloud_share=30, slack=2.0, hysteresis=10, start="local")
    runs = [len(list(group)) for _, group in groupby(banded)]
    assert min(runs[1:-1]) >= 4, runs
    assert switches(banded) <= 12
    # Without the band the same scores flip the leg on most steps the pace leaves free.
    bare = run_paced(scores, cloud_share=30, slack=2.0, hysteresis=0, start="local")
    assert switches(bare) >= 3 * switches(banded)
    # Both keep the share.
    for legs in (banded, bare):
        assert abs(legs.count("cloud") - 30) <= 2


def test_the_pace_overrules_the_band_only_at_the_slack_and_says_so() -> None:
    behind = decide_leg(
        mode="fusion",
        step=3,
        current_leg="local",
        score=score_of(5),
        cloud_share=30,
        pace=rule.Pace(0.5, steps=2, cloud=0),
    )
    assert behind.leg == "cloud"
    assert behind.threshold == 80  # the band's bar, which the score missed
    assert behind.reason.startswith("score 5 < 80 (T=70 + h=10): stay local; paced to cloud")
    assert "0 of 2 continuation steps on cloud" in behind.reason
    assert "0.9 steps behind 30% (slack 0.5)" in behind.reason
    ahead = decide_leg(
        mode="fusion",
        step=3,
        current_leg="cloud",
        score=score_of(95),
        cloud_share=30,
        pace=rule.Pace(0.5, steps=2, cloud=1),
    )
    assert ahead.leg == "local"
    assert "1.1 steps ahead of 30%" in ahead.reason
    within = decide_leg(
        mode="fusion",
        step=3,
        current_leg="cloud",
        score=score_of(95),
        cloud_share=30,
        pace=rule.Pace(1.5, steps=2, cloud=1),
    )
    assert within == decide_leg(
        mode="fusion", step=3, current_leg="cloud", score=score_of(95), cloud_share=30
    )


@pytest.mark.parametrize("cloud", [0, 10])
def test_the_plan_and_the_ends_of_the_dial_ignore_the_pace(cloud: int) -> None:
    pace = rule.Pace(0.5, steps=10, cloud=cloud)  # all local (far behind) or all cloud (far ahead)
    plan = decide_leg(mode="fusion", step=0, current_leg=None, score=None, cloud_share=10, pace=pace)
    assert plan.leg == "cloud"
    for share, leg in ((0, "local"), (100, "cloud")):
        end = decide_leg(
            mode="fusion", step=4, current_leg="local", score=score_of(50), cloud_share=share, pace=pace
        )
        assert end.leg == leg
    for mode, leg in (("cloud", "cloud"), ("local", "local")):
        pinned = decide_leg(mode=mode, step=4, current_leg="local", score=score_of(50), pace=pace)  # type: ignore[arg-type]
        assert pinned.leg == leg


def test_no_pace_is_the_default() -> None:
    for leg in ("local", "cloud"):
        for value in (5, 65, 75, 95):
            kwargs: dict[str, Any] = {
                "mode": "fusion",
                "step": 2,
                "current_leg": leg,
                "score": score_of(value),
            }
            assert decide_leg(**kwargs) == decide_leg(**kwargs, pace=None)
    assert decide_leg.__kwdefaults__ is not None and decide_leg.__kwdefaults__["pace"] is None


@pytest.mark.parametrize(
    ("slack", "steps", "cloud", "message"),
    [(0.4, 0, 0, "between 0.5 and 100"), (101, 0, 0, "between 0.5 and 100"), (1, 2, 3, "cloud <= steps")],
)
def test_impossible_paces_are_refused(slack: float, steps: int, cloud: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rule.Pace(slack, steps, cloud)


def test_paced_leg_forces_at_most_one_leg() -> None:
    for share in range(1, 100):
        for steps in range(30):
            for cloud in range(steps + 1):
                forced = rule.paced_leg(rule.Pace(0.5, steps, cloud), share)
                behind = share * (steps + 1) / 100 - cloud
                assert (forced == "cloud") == (behind > 0.5 + 1e-9)
                assert (forced == "local") == (1 - behind > 0.5 + 1e-9)


# --------------------------------------------------------------------------- the ceiling


def test_a_step_carrying_the_whole_turn_escalates_on_its_own_at_the_defaults() -> None:
    # The last step a turn may run, its prompt filling the budget, with tool output at least the
    # size of the stable prefix: 40 + 25 + 15 = 80 without any notice, which is T + h at the defaults.
    last = score_step(
        sig(prompt_tokens=1000, step=24, max_steps=25, tool_output_tokens=100, stable_prefix_tokens=100)
    )
    assert (last.score, last.turn_depth) == (80, 25)
    decision = decide_leg(mode="fusion", step=24, current_leg="local", score=last)
    assert decision.leg == "cloud" and decision.threshold == 80
    # One step earlier it does not yet (depth 23/24 of 25 points).
    earlier = score_step(
        sig(prompt_tokens=1000, step=23, max_steps=25, tool_output_tokens=100, stable_prefix_tokens=100)
    )
    assert earlier.score == 79
    assert decide_leg(mode="fusion", step=23, current_leg="local", score=earlier).leg == "local"


def test_turn_depth_reaches_1_at_the_last_step_a_turn_may_run() -> None:
    assert score_step(sig(step=9, max_steps=10)).turn_depth == 25
    assert score_step(sig(step=1, max_steps=2)).turn_depth == 25
    assert score_step(sig(step=0, max_steps=1)).turn_depth == 0


# --------------------------------------------------------------------------- trouble signals and the latch


def troubled(severity: float = 0.0, no_progress: float = 0.0, **overrides: object) -> TroubleSignals:
    """``sig(**overrides)`` with the trouble signals (no latch, no progress event)."""
    return TroubleSignals(
        **vars(sig(**overrides)),
        error_severity=severity,
        no_progress=no_progress,
        progress=False,
        latched=None,
    )


def trouble_score(base: float, trouble: float) -> TroubleScore:
    """A trouble score whose four terms sum to ``base`` and whose error term is ``trouble`` points."""
    total = min(100, int(base + trouble + 0.5))
    return TroubleScore(
        score=total,
        context_pressure=base,
        turn_depth=0,
        transient_notice=0,
        tail_growth=0,
        error_severity=trouble,
        no_progress=0,
    )


def test_plain_signals_score_exactly_as_the_seed_rule() -> None:
    signals = sig(prompt_tokens=300, step=4, tool_output_tokens=50, transient_notice=True)
    score = score_step(signals)
    assert type(score) is StepScore
    assert set(score.breakdown()) == set(WEIGHTS)
    assert score.trouble == 0 and score.base_points == score.points


def test_no_trouble_scores_what_the_four_terms_give() -> None:
    for overrides in (
        {},
        {"prompt_tokens": 300, "step": 4},
        {"tool_output_tokens": 70, "transient_notice": True},
    ):
        plain, quiet = score_step(sig(**overrides)), score_step(troubled(**overrides))
        assert isinstance(quiet, TroubleScore)
        assert (quiet.score, quiet.points, quiet.base_points) == (plain.score, plain.points, plain.points)
        assert quiet.breakdown() == {**plain.breakdown(), "error_severity": 0.0, "no_progress": 0.0}


@pytest.mark.parametrize(("severity", "no_progress"), [(1.0, 0.0), (0.0, 1.0), (0.5, 0.5), (0.75, 0.25)])
def test_the_trouble_terms_weigh_their_weights(severity: float, no_progress: float) -> None:
    score = score_step(troubled(severity, no_progress, prompt_tokens=250))  # 10 points of pressure
    expected = TROUBLE_WEIGHTS["error_severity"] * severity + TROUBLE_WEIGHTS["no_progress"] * no_progress
    assert isinstance(score, TroubleScore)
    assert score.breakdown()["error_severity"] == TROUBLE_WEIGHTS["error_severity"] * severity
    assert score.breakdown()["no_progress"] == TROUBLE_WEIGHTS["no_progress"] * no_progress
    assert score.trouble == expected
    assert score.points == 10 + expected == pytest.approx(sum(score.breakdown().values()))
    assert score.score == int(10 + expected + 0.5)


def test_the_score_with_trouble_stays_on_the_0_100_scale() -> None:
    everything = {k: v for d in SATURATED.values() for k, v in d.items()}
    score = score_step(troubled(1.0, 1.0, **everything))
    assert (score.score, score.points, score.base_points) == (100, 100, 100)
    assert score.trouble == sum(TROUBLE_WEIGHTS.values())
    assert score_step(troubled(7.0, -3.0)).trouble == TROUBLE_WEIGHTS["error_severity"]  # ratios clipped


def latched_run(
    steps: Sequence[tuple[float, float, bool]], *, start: Leg = "local", cloud_share: int = 50
) -> list[RouteDecision]:
    """``decide_leg`` over ``(base, trouble, progress)`` steps, carrying the latch as a turn does."""
    leg, since, decisions = start, None, []
    for step, (base, trouble, progress) in enumerate(steps, start=1):
        decision = decide_leg(
            mode="fusion",
            step=step,
            current_leg=leg,
            score=trouble_score(base, trouble),
            cloud_share=cloud_share,
            latch=Latch(since, progress),
        )
        leg, since = decision.leg, decision.latch
        decisions.append(decision)
    return decisions


def test_a_step_escalated_for_trouble_latches_the_turn_on_cloud_until_progress() -> None:
    # cloud_share=50 -> T=50, h=10: escalate at 60, stay on cloud down to 40.
    decisions = latched_run(
        [
            (10, 0, False),  # local
            (15, 50, False),  # 65 >= 60 only with trouble: escalate, latch at step 2
            (12, 25, False),  # 37 < 40: the band says local, the latch holds cloud
            (12, 0, False),  # still no progress event: held
            (35, 12.5, True),  # progress: released; 47.5 >= 40 stays on cloud by hysteresis
            (30, 6.25, False),  # 36 < 40: back to local
        ]
    )
    assert [d.leg for d in decisions] == ["local", "cloud", "cloud", "cloud", "cloud", "local"]
    assert [d.latch for d in decisions] == [None, 2, 2, 2, None, None]
    assert "without trouble 15 < 60: latched on cloud until a progress event" in decisions[1].reason
    assert "trouble 50 (error severity 1 × 50 = 50, no progress 0 × 30 = 0)" in decisions[1].reason
    assert "score 37 < 40 (T=50 - h=10): back to local" in decisions[2].reason
    assert "latched on cloud since step 2: no progress event yet" in decisions[2].reason
    assert "progress event: latch from step 2 released" in decisions[4].reason
    assert "stay on cloud" in decisions[4].reason


def test_a_passing_test_run_releases_the_latch() -> None:
    decisions = latched_run([(15, 50, False), (5, 0, True)])
    assert [(d.leg, d.latch) for d in decisions] == [("cloud", 1), ("local", None)]


def test_escalating_on_the_four_terms_alone_does_not_latch() -> None:
    decisions = latched_run([(62, 10, False), (20, 0, False)])
    assert [(d.leg, d.latch) for d in decisions] == [("cloud", None), ("local", None)]


def test_staying_on_cloud_for_trouble_does_not_latch() -> None:
    # From cloud (the plan's leg) trouble keeps the step there by the band; only escalations latch,
    # so the step a progress event releases never latches again.
    decisions = latched_run([(20, 25, False), (10, 0, False)], start="cloud")
    assert [(d.leg, d.latch) for d in decisions] == [("cloud", None), ("local", None)]


def test_a_calibrated_table_latches_on_points() -> None:
    table = [float(k) / 2 for k in range(QUANTILE_TABLE_LENGTH)]  # cloud_share 50 -> T = 25 points
    decision = decide_leg(
        mode="fusion",
        step=1,
        current_leg="local",
        score=trouble_score(20.5, 15),
        cloud_share=50,
        score_quantiles=table,
        latch=Latch(),
    )
    assert (decision.leg, decision.latch) == ("cloud", 1)
    assert "without trouble 20.5 < 35: latched" in decision.reason


def test_the_pace_overrules_a_held_latch_and_keeps_it() -> None:
    decision = decide_leg(
        mode="fusion",
        step=3,
        current_leg="cloud",
        score=trouble_score(5, 0),
        cloud_share=50,
        pace=Pace(0.5, steps=2, cloud=2),
        latch=Latch(since=1),
    )
    assert (decision.leg, decision.latch) == ("local", 1)
    assert "latched on cloud since step 1" in decision.reason and "paced to local" in decision.reason


@pytest.mark.parametrize(
    ("mode", "cloud_share"), [("cloud", 30), ("local", 30), ("fusion", 0), ("fusion", 100)]
)
def test_fixed_rules_never_latch(mode: Mode, cloud_share: int) -> None:
    decision = decide_leg(
        mode=mode,
        step=2,
        current_leg="local",
        score=trouble_score(10, 90),
        cloud_share=cloud_share,
        latch=Latch(since=1),
    )
    assert decision.latch is None


def test_without_a_latch_decisions_are_the_seed_rule() -> None:
    rng = random.Random(7)
    for _ in range(500):
        score = score_of(rng.randint(0, 100))
        kwargs: dict[str, Any] = {
            "mode": "fusion",
            "step": rng.randint(0, 5),
            "current_leg": rng.choice(["local", "cloud", None]),
            "score": score,
            "cloud_share": rng.randint(0, 100),
        }
        plain = decide_leg(**kwargs)
        assert decide_leg(**kwargs, latch=None) == plain
        assert plain.latch is None
        with_latch = decide_leg(**kwargs, latch=Latch())  # a plain score has no trouble: never latches
        assert (with_latch.leg, with_latch.threshold, with_latch.latch) == (plain.leg, plain.threshold, None)


@pytest.mark.parametrize(
    ("band", "since", "progress", "for_trouble", "expected"),
    [
        ("local", None, False, False, ("local", None)),
        ("cloud", None, False, False, ("cloud", None)),
        ("cloud", None, False, True, ("cloud", 4)),
        ("local", 2, False, False, ("cloud", 2)),
        ("cloud", 2, False, True, ("cloud", 2)),
        ("local", 2, True, False, ("local", None)),
        ("cloud", 2, True, False, ("cloud", None)),
        ("cloud", 2, True, True, ("cloud", 4)),
    ],
)
def test_latch_rule(
    band: Leg, since: int | None, progress: bool, for_trouble: bool, expected: tuple[Leg, int | None]
) -> None:
    assert latch_rule(band, Latch(since, progress), step=4, for_trouble=for_trouble) == expected


def test_trouble_signals_know_when_the_latch_holds() -> None:
    base = troubled()
    assert not base.held
    assert dataclasses.replace(base, latched=2).held
    assert not dataclasses.replace(base, latched=2, progress=True).held


def test_one_latch_rule_says_when_it_holds() -> None:
    assert rule.Latch is score.Latch
    assert [Latch().held, Latch(2).held, Latch(2, progress=True).held, Latch(None, True).held] == [
        False,
        True,
        False,
        False,
    ]
    signals = dataclasses.replace(troubled(), latched=2, progress=True)
    assert signals.latch == Latch(2, progress=True) and signals.held is signals.latch.held


def test_the_base_points_are_the_four_terms_alone() -> None:
    plain = StepScore(score=0, context_pressure=10.1, turn_depth=2.2, transient_notice=0, tail_growth=0.33)
    assert plain.base_points == plain.points == round(10.1 + 2.2 + 0 + 0.33, 2)
    scored = trouble_score(40.25, 30.5)
    assert scored.base_points == 40.25 and scored.points == round(40.25 + 30.5 + 0, 2)


def test_trouble_weights_replace_the_default_points_of_the_trouble_terms() -> None:
    signals = troubled(0.5, 0.5, prompt_tokens=250)  # 10 points of pressure
    weighted = score_step(signals, check_trouble_weights({"error_severity": 80, "no_progress": 0}))
    assert weighted.breakdown()["error_severity"] == 40 and weighted.breakdown()["no_progress"] == 0
    assert weighted.points == 50 and weighted.base_points == score_step(signals).base_points
    assert score_step(signals, None) == score_step(signals)  # None: TROUBLE_WEIGHTS
    decision = decide_leg(
        mode="fusion",
        step=2,
        current_leg="local",
        score=weighted,
        cloud_share=70,
        latch=Latch(),
        trouble_weights={"error_severity": 80, "no_progress": 0},
    )
    assert "error severity 0.5 × 80 = 40" in decision.reason and "no progress off" in decision.reason


@pytest.mark.parametrize(
    ("weights", "says"),
    [
        ({"errors": 1}, "no term 'errors'"),
        ({"no_progress": 101}, "whole number 0-100"),
        ({"no_progress": 2.5}, "got 2.5"),
    ],
)
def test_trouble_weights_outside_the_terms_or_the_scale_are_refused(
    weights: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        check_trouble_weights(weights)
    with pytest.raises(ContextError, match="trouble_weights"):
        ensure_context({"trouble_weights": weights})
    assert check_trouble_weights({"no_progress": 10}) == {
        "error_severity": TROUBLE_WEIGHTS["error_severity"],
        "no_progress": 10,
    }
    from_env: Any = '{"error_severity": 5}'  # JSON text, as FUSION_TROUBLE_WEIGHTS gives it
    assert FusionContext(trouble_weights=from_env).trouble_weights == {
        "error_severity": 5,
        "no_progress": TROUBLE_WEIGHTS["no_progress"],
    }
