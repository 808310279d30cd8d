"""Recorded scores re-routed under any dial, and where the dial sends them: shares of steps and cost.

Scores come from ``history.route_history`` (the graph's own signals and score)
and do not depend on the dial, so a trajectory is replayed once and then
re-routed under any dial by ``route_scores``, which calls ``decide_leg`` exactly
as a turn does. Calibration (``calibration``), the plots and the benchmarks
count shares this way. Everything here is a pure function over scores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from fusion_graph.context import FusionContext
from fusion_graph.errors import CalibrationError
from fusion_graph.replay.history import ReplayedStep
from fusion_graph.replay.replayed import add_cost
from fusion_graph.routing.rule import Latch, Pace, decide_leg
from fusion_graph.routing.score import Leg, RouteDecision, StepScore, TroubleSignals

TargetOf = Literal["continuation", "all", "cost"]
"""What a target is a fraction of: continuation steps on cloud, all steps on cloud, or cost."""
TARGET_KINDS: tuple[TargetOf, ...] = ("continuation", "all", "cost")


@dataclass(frozen=True)
class ScoredStep:
    """One replayed step: its index in the turn (0 is the plan) and its score.

    The two costs (USD) price the step on each leg, for cost targets
    (``replayed.step_costs``); routing never reads them. ``cloud_cost`` is ``None``
    when the cloud model's price is unknown. ``progress`` is the step's progress
    event (``TroubleSignals.progress``), which the escalation latch reads.
    """

    step: int
    score: StepScore
    cloud_cost: float | None = None
    local_cost: float = 0.0
    progress: bool = False


Trace = Sequence[ScoredStep]


def scored_steps(
    replayed: Iterable[ReplayedStep], costs: Sequence[tuple[float | None, float]] | None = None
) -> list[ScoredStep]:
    """The steps of a ``route_history`` result, reduced to what routing reads.

    Args:
        replayed: The steps of one ``route_history`` result.
        costs: Each step's ``(cloud, local)`` cost in USD (``replayed.step_costs``);
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
        progress = isinstance(item.signals, TroubleSignals) and item.signals.progress
        steps.append(ScoredStep(item.step, item.decision.score, cloud_cost, local_cost, progress))
    return steps


def route_scores(trace: Trace, context: FusionContext) -> list[RouteDecision]:
    """Route a scored trajectory under ``context``'s dial, as ``route_history`` would.

    Scores do not depend on the dial, so this equals re-running ``route_history``
    with ``context`` (same ``max_steps``, budget and system prompt) at a fraction
    of the cost: the plan gets no current leg, every other step the previous one's,
    and the paced dial counts the continuation steps routed so far, as
    ``turn.pace_of`` counts them in the route log. With ``trouble_signals`` the
    escalation latch is carried from step to step (reset at each plan), as
    ``route_history`` carries it.
    """
    decisions = []
    leg: Leg | None = None
    latch: int | None = None
    pace = None if context.pace_slack is None else Pace(context.pace_slack)
    for item in trace:
        found = Latch(latch, item.progress) if context.trouble_signals and item.step > 0 else None
        decision = decide_leg(
            mode=context.mode,
            step=item.step,
            current_leg=None if item.step == 0 else leg,
            score=item.score,
            cloud_share=context.cloud_share,
            hysteresis=context.hysteresis,
            score_quantiles=context.score_quantiles,
            pace=pace,
            latch=found,
            trouble_weights=context.trouble_weights,
        )
        leg, latch = decision.leg, decision.latch
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


def share_of(traces: Iterable[Trace], context: FusionContext) -> ShareCount:
    """Continuation steps of ``traces`` on cloud under ``context``: ``shares_of(...).continuation``."""
    return shares_of(traces, context).continuation


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
            cost = add_cost(cost, item.cloud_cost if on_cloud else item.local_cost)
            all_cloud = add_cost(all_cloud, item.cloud_cost)
    return Shares(ShareCount(steps, cloud), ShareCount(continuation, continuation_cloud), cost, all_cloud)


def sweep(traces: Sequence[Trace], context: FusionContext) -> list[Shares]:
    """``shares_of`` at every ``cloud_share`` from 0 to 100 (list index), the rest of ``context`` kept."""
    return [shares_of(traces, dataclasses.replace(context, cloud_share=share)) for share in range(101)]
