"""Calibrate on labels: the dial that sends most of the steps the local model gets wrong to cloud.

A label (``labels``) says whether the local model, asked a recorded step,
took the recorded action. Steps it did not (*disagreeing* steps) are the ones
worth a cloud call. ``calibrate_labels`` fits the calibrated dial
(``calibration.fit_quantiles``) on the labelled steps' scores and routes them
with the graph's rule (``shares.route_scores``) at every ``cloud_share`` up to
the target; the dial kept is the one whose share of continuation steps on cloud
stays within the target and whose *recall* (the disagreeing continuation steps
it puts on cloud, over all of them) is highest. With a trouble grid the same is
done for each pair of trouble weights (``FusionContext.trouble_weights``, the
escalation latch in place), and the best pair is kept with its dial.

It is compared on the same steps with the seed's four-term score under the
design rule (``T = 100 - cloud_share``, no table), with the chosen dial paced
(``pace_slack``), and with random routing, whose expected recall equals its
share. Plans (step 0 of each turn) run on cloud at any ``cloud_share > 0`` and
are left out of both the share and the recall: the dial does not decide them.

Everything here is a pure function over labels.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fusion_graph.context import FusionContext
from fusion_graph.errors import CalibrationError
from fusion_graph.replay.calibration import check_target, fit_quantiles, share_for
from fusion_graph.replay.labels import Label, rule_score
from fusion_graph.replay.shares import ScoredStep, route_scores
from fusion_graph.routing.score import TROUBLE_WEIGHTS, TroubleSignals

#: The trouble weights ``calibrate --labels --trouble-signals`` tries (every pair), in points.
TROUBLE_GRID: dict[str, tuple[int, ...]] = {
    "error_severity": (0, 25, 50, 75, 100),
    "no_progress": (0, 15, 30, 60),
}
#: How far past ``100 × target`` the search for the dial goes (a table's share can fall short of its dial).
SEARCH_PAST = 3


@dataclass(frozen=True)
class RecallPoint:
    """Where one dial sends the labelled continuation steps, and the disagreeing ones among them."""

    cloud_share: int
    steps: int
    """Continuation steps (after each turn's plan)."""
    cloud: int
    """Of them, those routed to cloud."""
    disagreeing: int
    """Continuation steps labelled disagreeing (``agrees`` false)."""
    caught: int
    """Of them, those routed to cloud."""

    @property
    def share(self) -> float:
        """Continuation steps on cloud, as a fraction (0 without any)."""
        return self.cloud / self.steps if self.steps else 0.0

    @property
    def recall(self) -> float:
        """Disagreeing continuation steps on cloud, as a fraction of them (0 without any)."""
        return self.caught / self.disagreeing if self.disagreeing else 0.0


@dataclass(frozen=True)
class LabelledTraces:
    """Labelled trajectories scored under one rule: what ``route_scores`` reads, and which steps disagree."""

    traces: list[list[ScoredStep]]
    disagree: list[list[bool]]


def scored_labels(trajectories: Sequence[Sequence[Label]], context: FusionContext) -> LabelledTraces:
    """Each labelled step scored under ``context``'s rule (``labels.rule_score``), with its latch signal."""
    traces, flags = [], []
    for labels in trajectories:
        traces.append(
            [
                ScoredStep(
                    label.step,
                    rule_score(label.signals, context),
                    progress=isinstance(label.signals, TroubleSignals) and label.signals.progress,
                )
                for label in labels
            ]
        )
        flags.append([label.agrees is False for label in labels])
    return LabelledTraces(traces, flags)


def recall_at(labelled: LabelledTraces, context: FusionContext) -> RecallPoint:
    """Route the labelled steps under ``context`` (the graph's rule) and count where they go."""
    steps = cloud = disagreeing = caught = 0
    for trace, flags in zip(labelled.traces, labelled.disagree, strict=True):
        for item, disagree, decision in zip(trace, flags, route_scores(trace, context), strict=True):
            if item.step == 0:
                continue
            on_cloud = decision.leg == "cloud"
            steps += 1
            cloud += on_cloud
            disagreeing += disagree
            caught += disagree and on_cloud
    return RecallPoint(context.cloud_share, steps, cloud, disagreeing, caught)


def recall_curve(
    labelled: LabelledTraces, context: FusionContext, shares: Sequence[int] = range(101)
) -> list[RecallPoint]:
    """``recall_at`` at each of ``shares`` (``cloud_share`` values), the rest of ``context`` kept."""
    return [recall_at(labelled, dataclasses.replace(context, cloud_share=share)) for share in shares]


def best_within(points: Sequence[RecallPoint], target: float) -> RecallPoint:
    """The point with the highest recall whose share is at most ``target`` (a tie: the lower share).

    ``cloud_share`` 0 (nothing on cloud) is always within; without it among ``points``,
    the lowest share stands in.
    """
    within = [point for point in points if point.share <= target + 1e-9]
    if not within:
        return min(points, key=lambda point: (point.share, point.cloud_share))
    return max(within, key=lambda point: (point.recall, -point.share, -point.cloud_share))


@dataclass(frozen=True)
class Dial:
    """A fitted dial on the labelled steps: its context (table, share, trouble weights) and what it gives."""

    context: FusionContext
    point: RecallPoint


@dataclass(frozen=True)
class LabelCalibration:
    """What ``calibrate_labels`` found, and what the baselines give on the same steps."""

    target: float
    chosen: Dial
    """The dial to run with (no pace: ``paced`` adds it)."""
    candidates: tuple[Dial, ...]
    """The best dial of each pair of trouble weights tried (one without a grid)."""
    seed: RecallPoint
    """The seed's four-term score under the design rule: the best ``cloud_share`` within the target."""
    paced: RecallPoint | None
    """The chosen dial paced by ``pace_slack`` at the same ``cloud_share`` (``None``: no pace)."""
    pace_slack: float | None
    labels: int
    """Labelled steps (``agrees`` true or false), plans included."""
    unlabelled: int
    """Steps without a label (no local answer, or no shadow check), routed but not counted in recall."""
    plans: int
    plans_disagreeing: int
    trouble_measured: int
    """Continuation steps whose labels carry the trouble signals (on the others the terms score 0)."""
    curves: dict[str, list[RecallPoint]] = field(default_factory=dict)
    """With ``curves=True``: every ``cloud_share`` 0-100 for ``chosen``, ``seed`` and ``paced``."""

    @property
    def random_recall(self) -> float:
        """Random routing's expected recall at the chosen dial's share: the share itself."""
        return self.chosen.point.share


def _weights(grid: Mapping[str, Sequence[int]]) -> list[dict[str, int]]:
    names = list(TROUBLE_WEIGHTS)
    values = [grid.get(name, (TROUBLE_WEIGHTS[name],)) for name in names]
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*values)]


def _distance(context: FusionContext) -> int:
    """How far a dial's trouble weights are from the defaults (ties between dials go to the nearest)."""
    if not context.trouble_signals or context.trouble_weights is None:
        return 0
    return sum(abs(context.trouble_weights[name] - TROUBLE_WEIGHTS[name]) for name in TROUBLE_WEIGHTS)


def fit_dial(trajectories: Sequence[Sequence[Label]], target: float, context: FusionContext) -> Dial:
    """The best dial within ``target`` for ``context``'s score (its trouble switch and weights).

    The table is fitted on the labelled steps for ``context.hysteresis`` (with the
    latch when ``trouble_signals`` is on); ``cloud_share`` 0 up to a little past
    ``100 × target`` is routed, and the share within the target with the highest
    recall is kept.
    """
    return _fit_dial(trajectories, target, context)[0]


def _fit_dial(
    trajectories: Sequence[Sequence[Label]], target: float, context: FusionContext
) -> tuple[Dial, LabelledTraces]:
    """``fit_dial``, and the steps it scored: the dial's own score, so its caller need not score again."""
    labelled = scored_labels(trajectories, context)
    table = fit_quantiles(labelled.traces, context.hysteresis, latch=context.trouble_signals)
    fitted = dataclasses.replace(context, score_quantiles=table)
    top = min(100, share_for(target) + SEARCH_PAST)
    best = best_within(recall_curve(labelled, fitted, range(top + 1)), target)
    return Dial(dataclasses.replace(fitted, cloud_share=best.cloud_share), best), labelled


def calibrate_labels(
    trajectories: Sequence[Sequence[Label]],
    target: float,
    context: FusionContext,
    *,
    grid: Mapping[str, Sequence[int]] | None = None,
    pace_slack: float | None = None,
    curves: bool = False,
) -> LabelCalibration:
    """The dial that sends the most disagreeing continuation steps to cloud within ``target`` of them.

    Args:
        trajectories: Labels grouped by trajectory, in step order (``labels.label_trajectories``).
        target: The share (0-1) of continuation steps the dial may send to cloud.
        context: The run context (its hysteresis, trouble switch and weights); its
            ``score_quantiles``, ``cloud_share`` and ``pace_slack`` are fitted or set here.
        grid: Trouble weights to try, every pair (``TROUBLE_GRID``), with the trouble
            signals on; ``None``: ``context``'s own score only.
        pace_slack: The pace of the ``paced`` comparison (``None``: none).
        curves: Also route every ``cloud_share`` 0-100 for the plot (``LabelCalibration.curves``).

    Raises:
        CalibrationError: The target is outside 0-1, or no continuation step is labelled disagreeing.
    """
    check_target(target)
    base = dataclasses.replace(context, mode="fusion", score_quantiles=None, pace_slack=None)
    labels = [label for trajectory in trajectories for label in trajectory]
    continuation = [label for label in labels if label.step > 0]
    if not any(label.agrees is False for label in continuation):
        labelled = sum(label.agrees is not None for label in continuation)
        raise CalibrationError(
            f"no continuation step is labelled disagreeing ({labelled} of {len(continuation)} labelled): "
            "there is nothing for the dial to send to cloud"
        )
    if grid is None:
        contexts = [base]
    else:
        contexts = [
            dataclasses.replace(base, trouble_signals=True, trouble_weights=w) for w in _weights(grid)
        ]
    fitted: list[Dial] = []

    def fit(ctx: FusionContext) -> tuple[Dial, LabelledTraces]:
        dial, labelled = _fit_dial(trajectories, target, ctx)
        fitted.append(dial)
        return dial, labelled

    # max() holds only the best fit's scored steps, and they are the chosen dial's own: the score
    # reads only the trouble switch and weights (``labels.rule_score``), which fitting leaves as is.
    chosen, chosen_labelled = max(
        map(fit, contexts),
        key=lambda one: (one[0].point.recall, -one[0].point.share, -_distance(one[0].context)),
    )
    candidates = tuple(fitted)
    seed_context = dataclasses.replace(base, trouble_signals=False, trouble_weights=None)
    seed_labelled = scored_labels(trajectories, seed_context)
    seed_curve = recall_curve(seed_labelled, seed_context)
    paced_context = dataclasses.replace(chosen.context, pace_slack=pace_slack)
    paced = recall_at(chosen_labelled, paced_context) if pace_slack is not None else None
    drawn: dict[str, list[RecallPoint]] = {}
    if curves:
        drawn["chosen"] = recall_curve(chosen_labelled, chosen.context)
        drawn["seed"] = seed_curve
        if pace_slack is not None:
            drawn["paced"] = recall_curve(chosen_labelled, paced_context)
    plans = [label for label in labels if label.step == 0]
    return LabelCalibration(
        target=target,
        chosen=chosen,
        candidates=candidates,
        seed=best_within(seed_curve, target),
        paced=paced,
        pace_slack=pace_slack,
        labels=sum(label.agrees is not None for label in labels),
        unlabelled=sum(label.agrees is None for label in labels),
        plans=len(plans),
        plans_disagreeing=sum(label.agrees is False for label in plans),
        trouble_measured=sum(isinstance(label.signals, TroubleSignals) for label in continuation),
        curves=drawn,
    )
