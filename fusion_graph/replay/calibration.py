"""Calibrate the dial on recorded trajectories, as RouteLLM calibrates its threshold.

The design's rule (``T = 100 - cloud_share``) reads the score on its own
scale, and real continuation steps rarely score past 40-50, so most of the
dial does nothing. A calibrated dial is a table of 101 score bars
(``FusionContext.score_quantiles``): entry ``100 - s`` is the threshold at
which a share ``s`` percent of the calibration set's continuation steps (the
steps after each turn's plan) go to cloud. The graph compares it with the
step's exact points (``StepScore.points``), so steps that share an integer
score can still be split.

Hysteresis composes by being inside the fit: each entry is found by replaying
the calibration set with the same band ``decide_leg`` applies around it
(``routing.hysteresis_band``), so the share it gives already includes the
dead band's effect. A table is therefore learned *for one hysteresis*; the
context ``calibrate`` returns carries both.

A table alone does not hold its share on trajectories it was not fitted on:
each set of conversations has its own score distribution, and the steps of one
conversation rise and fall together. The paced dial (``FusionContext.pace_slack``,
``routing.paced_leg``) adds feedback: each thread's cloud count is held within
the slack of its share, and the table, fitted without the pace, still ranks
the steps inside that slack (which steps are in the top ``s`` percent). It is
not fitted with the pace inside: a pace of half a step fixes the count whatever
the bar, so such a fit would be free to drop every bar to 0 and leave the
score no say. ``calibrate`` recommends a pace (``CALIBRATED_PACE_SLACK``);
bench/calibration.py measures both on unseen halves.

Targets. ``cloud_share`` (and a target) counts continuation steps, but the plan
(step 0 of each turn) runs on cloud whenever ``cloud_share > 0``, so the share of
*all* steps sits above it: on the shared traces about half the steps are plans.
``calibrate`` can also aim at the share of all steps (``of="all"``) or at cost as a
fraction of the all-cloud cost (``of="cost"``): it then searches ``cloud_share``
with the same table and pace (``calibrate_many``). Neither can go below what the
plans alone give, except at ``cloud_share`` 0 (nothing on cloud); ``Calibration.unreachable``
says so when a target falls in that gap.

Everything here is a pure function over scores. Scores come from
``replay.route_history`` (the graph's own signals and score), and they do not
depend on the dial, so a trajectory is replayed once and then re-routed under
any dial by ``route_scores``, which calls ``decide_leg`` exactly as a turn does.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from langchain_core.messages import BaseMessage

from fusion_graph.context import FusionContext
from fusion_graph.errors import CalibrationError
from fusion_graph.replay.history import ReplayedStep, route_history
from fusion_graph.routing import (
    QUANTILE_TABLE_LENGTH,
    Leg,
    Pace,
    RouteDecision,
    StepScore,
    decide_leg,
    hysteresis_band,
)

#: Bars are searched on a grid of hundredths of a point (the precision of ``StepScore.points``).
GRID = 100
#: The 0.01-point grid spans 0 to 100 points.
GRID_MAX = 100 * GRID
#: The ``pace_slack`` ``calibrate`` puts in the context unless told otherwise: each thread's cloud
#: count within half a step of its share. Chosen before measuring, as the tightest pace whole
#: steps allow; on unseen halves of the shared traces it is what meets the goal (bench/calibration.py).
CALIBRATED_PACE_SLACK = 0.5
#: How far a target of all steps or of cost may be missed before ``Calibration.unreachable`` says
#: why (plans alone put a floor under both; see the module note on targets).
TARGET_TOLERANCE = 0.05

TargetOf = Literal["continuation", "all", "cost"]
"""What a target is a fraction of: continuation steps on cloud, all steps on cloud, or cost."""
TARGET_KINDS: tuple[TargetOf, ...] = ("continuation", "all", "cost")


@dataclass(frozen=True)
class ScoredStep:
    """One replayed step: its index in the turn (0 is the plan) and its score.

    The two costs (USD) price the step on each leg, for cost targets
    (``traces.step_costs``); routing never reads them. ``cloud_cost`` is ``None``
    when the cloud model's price is unknown.
    """

    step: int
    score: StepScore
    cloud_cost: float | None = None
    local_cost: float = 0.0


Trace = Sequence[ScoredStep]


def scored_steps(
    replayed: Iterable[ReplayedStep], costs: Sequence[tuple[float | None, float]] | None = None
) -> list[ScoredStep]:
    """The steps of a ``route_history`` result, reduced to what routing reads.

    Args:
        replayed: The steps of one ``route_history`` result.
        costs: Each step's ``(cloud, local)`` cost in USD (``traces.step_costs``);
            ``None`` leaves the steps unpriced.
    """
    steps = []
    items = list(replayed)
    if costs is not None and len(costs) != len(items):
        raise CalibrationError(f"{len(costs)} step costs for {len(items)} steps")
    for index, item in enumerate(items):
        if item.decision.score is None:  # route_history scores every step; guard for the type
            raise CalibrationError(f"step at position {item.position} has no score")
        cloud_cost, local_cost = (None, 0.0) if costs is None else costs[index]
        steps.append(ScoredStep(item.step, item.decision.score, cloud_cost, local_cost))
    return steps


def score_trajectory(messages: Sequence[BaseMessage], context: FusionContext) -> list[ScoredStep]:
    """Replay one conversation with the graph's own routing and keep each step's score."""
    return scored_steps(route_history(messages, context))


# -- routing recorded scores --------------------------------------------------


def route_scores(trace: Trace, context: FusionContext) -> list[RouteDecision]:
    """Route a scored trajectory under ``context``'s dial, as ``route_history`` would.

    Scores do not depend on the dial, so this equals re-running ``route_history``
    with ``context`` (same ``max_steps``, budget and system prompt) at a fraction
    of the cost: the plan gets no current leg, every other step the previous one's,
    and the paced dial counts the continuation steps routed so far, as
    ``turn.pace_of`` counts them in the route log.
    """
    decisions = []
    leg: Leg | None = None
    pace = None if context.pace_slack is None else Pace(context.pace_slack)
    for item in trace:
        decision = decide_leg(
            mode=context.mode,
            step=item.step,
            current_leg=None if item.step == 0 else leg,
            score=item.score,
            cloud_share=context.cloud_share,
            hysteresis=context.hysteresis,
            score_quantiles=context.score_quantiles,
            pace=pace,
        )
        leg = decision.leg
        if pace is not None and item.step > 0:
            pace = pace.after(leg)
        decisions.append(decision)
    return decisions


@dataclass(frozen=True)
class ShareCount:
    """Continuation steps (after each turn's plan) and how many of them went to cloud."""

    steps: int = 0
    cloud: int = 0

    @property
    def fraction(self) -> float:
        """The cloud fraction (0 when there are no continuation steps)."""
        return self.cloud / self.steps if self.steps else 0.0

    def __add__(self, other: ShareCount) -> ShareCount:
        return ShareCount(self.steps + other.steps, self.cloud + other.cloud)


def continuation_share(steps: Sequence[int], legs: Sequence[Leg]) -> ShareCount:
    """Count the continuation steps (``step > 0``) of one trajectory and those on cloud."""
    pairs = [(step, leg) for step, leg in zip(steps, legs, strict=True) if step > 0]
    return ShareCount(len(pairs), sum(leg == "cloud" for _, leg in pairs))


def share_of(traces: Iterable[Trace], context: FusionContext) -> ShareCount:
    """Continuation steps of ``traces`` on cloud under ``context`` (via ``route_scores``)."""
    total = ShareCount()
    for trace in traces:
        legs = [decision.leg for decision in route_scores(trace, context)]
        total = total + continuation_share([item.step for item in trace], legs)
    return total


def _add_cost(total: float | None, value: float | None) -> float | None:
    return None if total is None or value is None else total + value


@dataclass(frozen=True)
class Shares:
    """Where one dial sends the steps of a set of trajectories: all of them, the continuations, cost.

    Plans (step 0 of each turn) run on cloud whenever ``cloud_share > 0``, so the
    share of all steps never drops below ``plans.steps / all.steps`` there;
    ``continuation`` (the steps after each turn's plan) is what the dial's score decides.
    """

    all: ShareCount
    continuation: ShareCount
    cost: float | None = None
    """USD of the routed steps (each on its leg's price); ``None`` when a cloud price is unknown."""
    all_cloud_cost: float | None = None
    """USD of the same steps, all on cloud."""

    @property
    def plans(self) -> ShareCount:
        """The plans (step 0 of each turn) and how many of them went to cloud."""
        return ShareCount(self.all.steps - self.continuation.steps, self.all.cloud - self.continuation.cloud)

    @property
    def cost_fraction(self) -> float | None:
        """``cost`` as a fraction of ``all_cloud_cost`` (``None`` when unknown or nothing to price)."""
        if self.cost is None or not self.all_cloud_cost:
            return None
        return self.cost / self.all_cloud_cost

    def fraction(self, of: TargetOf) -> float | None:
        """The share ``of`` (a target kind) measures: continuation or all steps on cloud, or cost."""
        if of == "continuation":
            return self.continuation.fraction
        if of == "all":
            return self.all.fraction
        return self.cost_fraction


def shares_of(traces: Iterable[Trace], context: FusionContext) -> Shares:
    """All steps, continuation steps and cost of ``traces`` under ``context`` (via ``route_scores``).

    Costs come from each step's ``cloud_cost``/``local_cost``; ``cost`` and
    ``all_cloud_cost`` are ``None`` when any step's cloud price is unknown.
    """
    steps = cloud = continuation = continuation_cloud = 0
    cost: float | None = 0.0
    all_cloud: float | None = 0.0
    for trace in traces:
        for item, decision in zip(trace, route_scores(trace, context), strict=True):
            on_cloud = decision.leg == "cloud"
            steps += 1
            cloud += on_cloud
            if item.step > 0:
                continuation += 1
                continuation_cloud += on_cloud
            cost = _add_cost(cost, item.cloud_cost if on_cloud else item.local_cost)
            all_cloud = _add_cost(all_cloud, item.cloud_cost)
    return Shares(ShareCount(steps, cloud), ShareCount(continuation, continuation_cloud), cost, all_cloud)


def sweep(traces: Sequence[Trace], context: FusionContext) -> list[Shares]:
    """``shares_of`` at every ``cloud_share`` from 0 to 100 (list index), the rest of ``context`` kept."""
    return [shares_of(traces, dataclasses.replace(context, cloud_share=share)) for share in range(101)]


# -- fitting the table --------------------------------------------------------


def _points(traces: Iterable[Trace]) -> list[list[tuple[int, float]]]:
    return [[(item.step, item.score.points) for item in trace] for trace in traces]


def fraction_at(traces: Sequence[Sequence[tuple[int, float]]], base: float, hysteresis: int) -> float:
    """Continuation cloud fraction with base threshold ``base`` (points) and the graph's band.

    The same rule as ``decide_leg`` with a calibrated table for ``0 < share < 100``
    (the plan on cloud; escalate at, or stay on cloud down to, ``hysteresis_band``'s bars),
    on ``(step, points)`` pairs; ``tests/unit/replay/test_calibration.py`` checks they agree.
    """
    escalate_at, stay_down_to = hysteresis_band(base, hysteresis)
    steps = cloud = 0
    for trace in traces:
        leg: Leg | None = None
        for step, points in trace:
            if step == 0:
                leg = "cloud"
                continue
            bar = stay_down_to if leg == "cloud" else escalate_at
            leg = "cloud" if points >= bar else "local"
            steps += 1
            cloud += leg == "cloud"
    return cloud / steps if steps else 0.0


def _fit(fraction: Callable[[int], float], target: float, high: int) -> int:
    """Grid point ``c`` whose ``fraction(c)`` (non-increasing in ``c``) is closest to ``target``."""
    low, top = 0, high  # invariant: fraction(low) >= target (fraction(0) == 1)
    if fraction(top) >= target:
        return top
    while top - low > 1:
        middle = (low + top) // 2
        if fraction(middle) >= target:
            low = middle
        else:
            top = middle
    # On a tie the higher bar wins: the cheaper side.
    return top if abs(fraction(top) - target) <= abs(fraction(low) - target) else low


def fit_threshold(traces: Iterable[Trace], target: float, hysteresis: int) -> float:
    """The base threshold (points, 2 decimals) whose share of continuation steps is closest to ``target``."""
    pairs = _points(traces)
    return _fit(lambda c: fraction_at(pairs, c / GRID, hysteresis), target, GRID_MAX) / GRID


def fit_quantiles(traces: Iterable[Trace], hysteresis: int) -> tuple[float, ...]:
    """A calibrated ``score_quantiles`` table: entry ``100 - s`` gives share ``s`` percent.

    Each entry for ``s`` in 1..99 is fitted with ``hysteresis`` in place; the
    table is then made non-decreasing (a higher share never gets a higher bar).
    Entries 0 and 100 (shares 100 and 0, fixed rules that never read the
    table) repeat their neighbours. A pace plays no part (see the module note).

    Raises:
        CalibrationError: The traces have no continuation step.
    """
    pairs = _points(traces)
    if not any(step > 0 for trace in pairs for step, _ in trace):
        raise CalibrationError("no continuation steps (steps after a turn's plan) to calibrate on")
    cache: dict[int, float] = {}

    def fraction(c: int) -> float:
        if c not in cache:
            cache[c] = fraction_at(pairs, c / GRID, hysteresis)
        return cache[c]

    bars: dict[int, float] = {}
    previous = GRID_MAX
    for share in range(1, 100):
        grid_point = min(_fit(fraction, share / 100, GRID_MAX), previous)
        bars[share] = grid_point / GRID
        previous = grid_point
    table = [0.0] * QUANTILE_TABLE_LENGTH
    for share, bar in bars.items():
        table[100 - share] = bar
    table[0], table[100] = table[1], table[99]
    return tuple(table)


@dataclass(frozen=True)
class Calibration:
    """What ``calibrate`` found: the context to run with and what it gives on its own traces."""

    target: float
    achieved: float
    """The share ``of`` measures, achieved on the calibration traces (pace included)."""
    context: FusionContext
    continuation_steps: int
    of: TargetOf = "continuation"
    shares: Shares | None = None
    """All steps, continuation steps and cost under ``context`` on the calibration traces."""
    floor: float | None = None
    """For ``all``/``cost`` targets: the lowest share any ``cloud_share > 0`` gives (plans run on cloud)."""

    def unreachable(self) -> str | None:
        """Why an ``all``/``cost`` target was missed by more than ``TARGET_TOLERANCE``, or ``None``.

        A continuation target is never called unreachable: ``cloud_share = 100 × target``
        is its definition, and ``achieved`` shows how close the traces allow.
        """
        if self.of == "continuation" or abs(self.achieved - self.target) <= TARGET_TOLERANCE:
            return None
        what = "of all steps on cloud" if self.of == "all" else "of the all-cloud cost"
        reason = (
            f"no cloud_share gives {self.target:.2f} {what} on these traces; "
            f"the closest is cloud_share={self.context.cloud_share} ({self.achieved:.2f})"
        )
        if self.shares is not None and self.floor is not None and self.target < self.floor:
            plans = self.shares.plans.steps
            reason += (
                f". Plans (step 0 of each turn) run on cloud whenever cloud_share > 0: {plans} of "
                f"{self.shares.all.steps} steps, so every cloud_share > 0 gives at least "
                f"{self.floor:.2f} and cloud_share 0 gives 0"
            )
        return reason


def check_target(target: float, of: TargetOf = "continuation") -> float:
    """``target`` if it is a fraction 0-1, else a ``CalibrationError`` naming what it is a fraction of.

    Raises:
        CalibrationError: ``target`` is outside 0-1, or ``of`` is not a target kind.
    """
    if of not in TARGET_KINDS:
        raise CalibrationError(f"a target is a fraction of one of {', '.join(TARGET_KINDS)}, got {of!r}")
    if not 0 <= target <= 1 or math.isnan(target):
        kind = "cost" if of == "cost" else "cloud"
        raise CalibrationError(f"the target {kind} fraction must be between 0 and 1, got {target}")
    return target


def share_for(target: float) -> int:
    """The ``cloud_share`` that asks for ``target`` (a fraction 0-1) with a calibrated table.

    Raises:
        CalibrationError: ``target`` is outside 0-1.
    """
    return round(check_target(target) * 100)


def calibrate_many(
    traces: Sequence[Trace],
    targets: Sequence[float],
    context: FusionContext,
    *,
    of: TargetOf = "continuation",
) -> list[Calibration]:
    """``calibrate`` for each of ``targets``, fitting the table once (for ``calibrate --plot``).

    A continuation target sets ``cloud_share = round(100 × target)`` (the table
    makes each share mean its own fraction of continuation steps). An ``all`` or
    ``cost`` target searches ``cloud_share`` 0-100 with the same table and pace,
    routing the traces with ``route_scores`` (the graph's rule), and keeps the
    share whose fraction is closest (a tie goes to the lower share: the cheaper side).
    Plans run on cloud whenever ``cloud_share > 0``, so an ``all``/``cost`` target
    below what the plans alone give cannot be met; ``Calibration.unreachable`` says so.

    Raises:
        CalibrationError: A target is outside 0-1, the traces have no continuation
            step, or a cost target meets a step whose cloud price is unknown.
    """
    for target in targets:
        check_target(target, of)
    table = fit_quantiles(traces, context.hysteresis)
    fitted = dataclasses.replace(context, mode="fusion", score_quantiles=table)
    found: list[Calibration] = []
    if of == "continuation":
        cache: dict[int, Shares] = {}
        for target in targets:
            share = share_for(target)
            if share not in cache:
                cache[share] = shares_of(traces, dataclasses.replace(fitted, cloud_share=share))
            shares = cache[share]
            calibrated = dataclasses.replace(fitted, cloud_share=share)
            found.append(
                Calibration(
                    target, shares.continuation.fraction, calibrated, shares.continuation.steps, of, shares
                )
            )
        return found
    swept = sweep(traces, fitted)
    if of == "cost" and swept[100].cost_fraction is None:
        raise CalibrationError(
            "a cost target needs the cloud model's price: set FUSION_PRICE_OVERRIDES or pick a "
            "cloud model the price catalogue knows"
        )
    values = [shares.fraction(of) or 0.0 for shares in swept]
    floor = min(values[1:])
    for target in targets:
        share = min(range(101), key=lambda s: (abs(values[s] - target), s))
        shares = swept[share]
        calibrated = dataclasses.replace(fitted, cloud_share=share)
        found.append(
            Calibration(target, values[share], calibrated, shares.continuation.steps, of, shares, floor)
        )
    return found


def calibrate(
    traces: Sequence[Trace], target: float, context: FusionContext, *, of: TargetOf = "continuation"
) -> Calibration:
    """The context that sends ``target`` of ``traces``' continuation steps (or all steps, or cost) to cloud.

    It is ``context`` with a fitted ``score_quantiles`` table (for ``context.hysteresis``)
    and, for a continuation target, ``cloud_share = round(100 × target)``; the table makes every
    other share mean its own fraction too, and ``context.pace_slack`` (kept as given) holds
    each thread to it. ``of="all"`` or ``"cost"`` searches the ``cloud_share`` whose share of
    all steps (plans included) or whose cost as a fraction of the all-cloud cost is closest
    (``calibrate_many``). ``achieved`` is measured on ``traces`` themselves, pace included.
    Target 0 gives ``cloud_share`` 0: nothing on cloud, plans included.
    """
    return calibrate_many(traces, [target], context, of=of)[0]


def best_plain_share(traces: Sequence[Trace], target: float, context: FusionContext) -> int:
    """The design-rule ``cloud_share`` (no table) whose share is closest to ``target``.

    The baseline calibration can only do this; the table exists because it
    misses most targets (a dead zone below the scores traces reach, a cliff above).
    """
    plain = dataclasses.replace(context, mode="fusion", score_quantiles=None, pace_slack=None)
    best = min(
        range(101),
        key=lambda s: abs(share_of(traces, dataclasses.replace(plain, cloud_share=s)).fraction - target),
    )
    return best


# -- evaluation helpers -----------------------------------------------------------


def split_halves(count: int, seed: int) -> tuple[list[int], list[int]]:
    """Shuffle ``0..count-1`` with ``seed`` and cut it into two halves (the first may be smaller)."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    middle = count // 2
    return sorted(order[:middle]), sorted(order[middle:])


def rank_auc(positives: Sequence[float], negatives: Sequence[float]) -> float:
    """Probability that a random positive outranks a random negative (ties count half).

    The Mann-Whitney U statistic over ``len(positives) × len(negatives)``; 0.5 is no separation.

    Raises:
        ValueError: Either group is empty.
    """
    if not positives or not negatives:
        raise ValueError("rank_auc needs at least one value in each group")
    wins = 0.0
    for p in positives:
        for n in negatives:
            wins += 1.0 if p > n else 0.5 if p == n else 0.0
    return wins / (len(positives) * len(negatives))


def permutation_p(
    positives: Sequence[float], negatives: Sequence[float], *, rounds: int = 2000, seed: int = 0
) -> float:
    """Two-sided permutation p-value of ``|rank_auc - 0.5|`` (labels shuffled ``rounds`` times)."""
    observed = abs(rank_auc(positives, negatives) - 0.5)
    pooled = list(positives) + list(negatives)
    rng = random.Random(seed)
    hits = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        shuffled = abs(rank_auc(pooled[: len(positives)], pooled[len(positives) :]) - 0.5)
        hits += shuffled >= observed - 1e-12
    return (hits + 1) / (rounds + 1)
