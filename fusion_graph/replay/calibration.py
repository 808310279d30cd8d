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
(``routing.rule.hysteresis_band``), so the share it gives already includes the
dead band's effect. A table is therefore learned *for one hysteresis*; the
context ``calibrate`` returns carries both.

A table alone does not hold its share on trajectories it was not fitted on:
each set of conversations has its own score distribution, and the steps of one
conversation rise and fall together. The paced dial (``FusionContext.pace_slack``,
``routing.rule.paced_leg``) adds feedback: each thread's cloud count is held within
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
any dial by ``shares.route_scores``, which calls ``decide_leg`` exactly as a turn
does. Measuring a calibration on unseen trajectories: ``evaluation``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from fusion_graph.context import FusionContext
from fusion_graph.errors import CalibrationError
from fusion_graph.replay.shares import TARGET_KINDS, Shares, TargetOf, Trace, share_of, shares_of, sweep
from fusion_graph.routing.rule import QUANTILE_TABLE_LENGTH, Latch, band_leg, for_trouble_only, latch_rule
from fusion_graph.routing.score import Leg

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


def target_verdict(target: float, achieved: float, tolerance: float = TARGET_TOLERANCE) -> str:
    """How an achieved share compares with its target, in words that say so plainly.

    Within ``tolerance`` it is on target; past it, the words say how far above or
    below, so a share of 0.55 for a target of 0.10 never reads as close.
    """
    gap = achieved - target
    if abs(gap) <= tolerance:
        return f"on target, within the {tolerance:.2f} tolerance"
    side = "above" if gap > 0 else "below"
    return f"off target: {abs(gap):.2f} {side} it, past the {tolerance:.2f} tolerance"


Troubles = Sequence[Sequence[tuple[float, float, bool]]]
"""Per trajectory, per step: ``(trouble points, points without them, progress event)``, for the latch."""


def _points(traces: Iterable[Trace]) -> list[list[tuple[int, float]]]:
    return [[(item.step, item.score.points) for item in trace] for trace in traces]


def _troubles(traces: Iterable[Trace]) -> list[list[tuple[float, float, bool]]]:
    return [[(s.score.trouble, s.score.base_points, s.progress) for s in trace] for trace in traces]


def fraction_at(
    traces: Sequence[Sequence[tuple[int, float]]],
    base: float,
    hysteresis: int,
    *,
    troubles: Troubles | None = None,
) -> float:
    """Continuation cloud fraction with base threshold ``base`` (points) and the graph's band.

    The same rule as ``decide_leg`` with a calibrated table for ``0 < share < 100``
    (the plan on cloud; the band's leg from ``routing.rule.band_leg``, as the graph decides it),
    on ``(step, points)`` pairs; ``tests/unit/replay/test_calibration.py`` checks they agree.
    With ``troubles`` (``trouble_signals``: each step's trouble points, points without them and
    progress event) the escalation latch applies as well (``routing.rule.latch_rule``).
    """
    steps = cloud = 0
    for index, trace in enumerate(traces):
        leg: Leg | None = None
        latch: int | None = None
        for position, (step, points) in enumerate(trace):
            if step == 0:
                leg, latch = "cloud", None
                continue
            escalating = leg != "cloud"
            leg, bar = band_leg(points, base, hysteresis, on_cloud=not escalating)
            if troubles is not None:
                trouble, without, progress = troubles[index][position]
                for_trouble = for_trouble_only(
                    leg, escalating=escalating, trouble=trouble, base_value=without, bar=bar
                )
                leg, latch = latch_rule(leg, Latch(latch, progress), step=step, for_trouble=for_trouble)
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


def fit_threshold(traces: Sequence[Trace], target: float, hysteresis: int, *, latch: bool = False) -> float:
    """The base threshold (points, 2 decimals) whose share of continuation steps is closest to ``target``.

    ``latch``: route with the escalation latch (``trouble_signals``), as ``fraction_at`` does.
    """
    pairs = _points(traces)
    troubles = _troubles(traces) if latch else None
    return (
        _fit(lambda c: fraction_at(pairs, c / GRID, hysteresis, troubles=troubles), target, GRID_MAX) / GRID
    )


def fit_quantiles(traces: Sequence[Trace], hysteresis: int, *, latch: bool = False) -> tuple[float, ...]:
    """A calibrated ``score_quantiles`` table: entry ``100 - s`` gives share ``s`` percent.

    Each entry for ``s`` in 1..99 is fitted with ``hysteresis`` in place, and with
    ``latch`` the escalation latch (``trouble_signals``) too; the table is then
    made non-decreasing (a higher share never gets a higher bar). Entries 0 and
    100 (shares 100 and 0, fixed rules that never read the table) repeat their
    neighbours. A pace plays no part (see the module note).

    The latch can make the share rise a little with the bar (a higher bar can
    make a step's trouble the reason it escalated, and latch what follows); the
    search takes the share as falling, and the table ends non-decreasing all the same.

    Raises:
        CalibrationError: The traces have no continuation step.
    """
    pairs = _points(traces)
    if not any(step > 0 for trace in pairs for step, _ in trace):
        raise CalibrationError("no continuation steps (steps after a turn's plan) to calibrate on")
    troubles = _troubles(traces) if latch else None
    cache: dict[int, float] = {}

    def fraction(c: int) -> float:
        if c not in cache:
            cache[c] = fraction_at(pairs, c / GRID, hysteresis, troubles=troubles)
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
    table = fit_quantiles(traces, context.hysteresis, latch=context.trouble_signals)
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
