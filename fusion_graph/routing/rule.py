"""The leg decision: threshold, hysteresis, the plan rule, the paced dial and the escalation latch.

Everything here is a pure function over plain data (the step's score comes from
``fusion_graph.routing.score``), so the graph, the replay benchmark and calibration all
call the exact same code and any decision can be reproduced without a model.
With ``FusionContext.trouble_signals`` the decision goes through the escalation
latch (``Latch``, ``latch_rule``); off, it is absent and every decision is the
four-term rule's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

from fusion_graph.routing.score import (
    DEFAULT_CLOUD_SHARE,
    DEFAULT_HYSTERESIS,
    TROUBLE_WEIGHTS,
    Leg,
    Mode,
    RouteDecision,
    StepScore,
    TroubleScore,
)
from fusion_graph.routing.score import Latch as Latch  # defined beside TroubleSignals, which reads it


def cloud_threshold(cloud_share: int) -> int:
    """The base threshold ``T = 100 - cloud_share``: a score at or above it wants cloud."""
    return 100 - cloud_share


#: Entries of a calibrated ``score_quantiles`` table: one per percentile, 0 to 100.
QUANTILE_TABLE_LENGTH = 101


def hysteresis_band(base: float, hysteresis: int) -> tuple[float, float]:
    """The two bars around a base threshold: ``(escalate at, stay on cloud down to)``.

    The half-width is ``h' = min(h, T // 2, (100 - T) // 2)``: the band never
    reaches more than halfway from ``T`` to either end of the scale, so for
    ``0 < cloud_share < 100`` the stay-on-cloud bar is at least ``ceil(T / 2) > 0``
    (a score-0 step leaves cloud) and the escalation bar stays below 100.
    Integer in, integers out; a calibrated (2-decimal) ``T`` gives bars to 2 decimals.
    """
    half = min(hysteresis, base // 2, (100 - base) // 2)
    return round(base + half, 2), round(base - half, 2)


def dial_base(cloud_share: int, score_quantiles: Sequence[float] | None = None) -> float:
    """The dial's base threshold ``T``: the calibrated table's entry ``100 - cloud_share``, else that number.

    With a table ``T`` is compared with a step's exact points, without one with its integer score.
    """
    if score_quantiles is not None:
        return check_score_quantiles(score_quantiles)[100 - cloud_share]
    return cloud_threshold(cloud_share)


def band_leg(value: float, base: float, hysteresis: int, *, on_cloud: bool) -> tuple[Leg, float]:
    """The band's leg for a continuation step, and the bar it was held to.

    From local a step escalates when ``value`` reaches ``T + h'``; on cloud it stays
    while ``value`` holds ``T - h'`` (``hysteresis_band``). ``decide_leg`` and the
    calibration fit (``replay.calibration.fraction_at``) both decide by it.
    """
    escalate_at, stay_down_to = hysteresis_band(base, hysteresis)
    bar = stay_down_to if on_cloud else escalate_at
    return ("cloud" if value >= bar else "local"), bar


def check_score_quantiles(table: Sequence[float]) -> tuple[float, ...]:
    """``table`` as a tuple if it is a valid calibrated dial, else a ``ValueError`` saying why.

    Valid: ``QUANTILE_TABLE_LENGTH`` (101) numbers, each between 0 and 100,
    non-decreasing. Entry ``k`` is the base threshold (in score points) for
    ``cloud_share = 100 - k``; ``fusion-graph calibrate`` learns it from traces.
    """
    values = tuple(float(value) for value in table)
    if len(values) != QUANTILE_TABLE_LENGTH:
        raise ValueError(
            f"score_quantiles must have {QUANTILE_TABLE_LENGTH} entries (percentiles 0-100), "
            f"got {len(values)}"
        )
    if any(not 0 <= value <= 100 for value in values):
        raise ValueError("score_quantiles entries must be between 0 and 100")
    if any(later < earlier for earlier, later in pairwise(values)):
        raise ValueError("score_quantiles must be non-decreasing")
    return values


@dataclass(frozen=True)
class Pace:
    """What the paced dial knows of a thread: its slack and the continuation steps routed so far.

    ``steps`` counts the continuation steps the router has sent (plans, repairs
    and memory jobs are not counted) and ``cloud`` those it sent to cloud.
    ``turn.pace_of`` reads both from the thread's route log, which replay
    rebuilds the same way, so the graph, replay and calibration count alike.
    """

    slack: float
    """How many steps the cloud count may drift from ``cloud_share`` percent (at least 0.5)."""
    steps: int = 0
    cloud: int = 0

    def __post_init__(self) -> None:
        """Refuse a slack below half a step and counts that cannot happen."""
        if not 0.5 <= self.slack <= 100:
            raise ValueError(f"the pace slack must be between 0.5 and 100 steps, got {self.slack}")
        if not 0 <= self.cloud <= self.steps:
            raise ValueError(f"pace counts need 0 <= cloud <= steps, got {self.cloud} of {self.steps}")

    def after(self, leg: Leg) -> Pace:
        """The pace once one more continuation step has been sent to ``leg``."""
        return Pace(self.slack, self.steps + 1, self.cloud + (leg == "cloud"))


def paced_leg(pace: Pace, cloud_share: int) -> Leg | None:
    """The leg the paced dial imposes on the next continuation step, or ``None`` to let the score pick.

    The thread's cloud count is kept within ``pace.slack`` steps of ``cloud_share``
    percent of its continuation steps: cloud when staying local would leave it
    more than the slack behind, local when going cloud would put it more than
    the slack ahead. A slack of 0.5 pins the count to the nearest whole step (the
    score picks only at exact ties); a wider slack leaves the score more steps to
    place, and the cloud fraction strays by up to ``slack / steps``.
    """
    behind = cloud_share * (pace.steps + 1) - 100 * pace.cloud  # hundredths of a step, if this step is local
    if behind > 100 * pace.slack:
        return "cloud"
    if 100 - behind > 100 * pace.slack:  # hundredths of a step ahead, if this step is cloud
        return "local"
    return None


def _paced(decision: RouteDecision, pace: Pace | None, cloud_share: int) -> RouteDecision:
    """``decision`` (the band's), overruled where ``paced_leg`` imposes the other leg; the reason says so."""
    forced = None if pace is None else paced_leg(pace, cloud_share)
    if pace is None or forced is None or forced == decision.leg:
        return decision
    if forced == "cloud":
        gap = (cloud_share * (pace.steps + 1) - 100 * pace.cloud) / 100
        why = f"staying local would leave the thread {gap:g} step{'' if gap == 1 else 's'} behind"
    else:
        gap = (100 * (pace.cloud + 1) - cloud_share * (pace.steps + 1)) / 100
        why = f"going cloud would put the thread {gap:g} step{'' if gap == 1 else 's'} ahead of"
    reason = (
        f"{decision.reason}; paced to {forced}: {pace.cloud} of {pace.steps} continuation steps on "
        f"cloud, {why} {cloud_share}% (slack {pace.slack:g})"
    )
    return replace(decision, leg=forced, reason=reason, paced=True)


def latch_rule(band: Leg, latch: Latch, *, step: int, for_trouble: bool) -> tuple[Leg, int | None]:
    """The leg and the latch after a continuation step, from the band's leg and the latch it found.

    A held latch with no progress event keeps the step on cloud whatever the
    band says. A progress event releases it, and the band decides as before
    (the hysteresis from the current leg, so a released turn stays on cloud
    while its score holds the stay-on-cloud bar). A step the band escalates
    from local to cloud *for trouble* (``for_trouble``: without the trouble
    terms its value would be below the escalation bar) sets the latch at
    ``step``. Staying on cloud never sets it, so the step a progress event
    releases cannot latch again. ``decide_leg`` and the calibration fit
    (``replay.calibration.fraction_at``) both apply this rule.
    """
    if latch.held:
        return "cloud", latch.since
    if band == "cloud" and for_trouble:
        return "cloud", step
    return band, None


def for_trouble_only(band: Leg, *, escalating: bool, trouble: float, base_value: float, bar: float) -> bool:
    """Whether the band escalated this step for its trouble terms alone: it latches the turn on cloud.

    From local to cloud, with trouble points, and below the escalation bar without them.
    """
    return escalating and band == "cloud" and trouble > 0 and base_value < bar


def _trouble_words(score: StepScore, weights: Mapping[str, int] | None = None) -> str:
    """The trouble terms in words: ``trouble 40 (error severity 0.5 × 50 = 25, no progress ...)``."""
    if not isinstance(score, TroubleScore):
        return "no trouble terms"
    parts = []
    for name, words in (("error_severity", "error severity"), ("no_progress", "no progress")):
        points = getattr(score, name)
        weight = (TROUBLE_WEIGHTS if weights is None else weights)[name]
        parts.append(f"{words} {points / weight:.3g} × {weight} = {points:g}" if weight else f"{words} off")
    return f"trouble {score.trouble:g} ({', '.join(parts)})"


def _latched(
    decision: RouteDecision,
    latch: Latch | None,
    *,
    step: int,
    escalated: bool,
    base_value: float,
    weights: Mapping[str, int] | None = None,
) -> RouteDecision:
    """``decision`` (the band's) under the escalation latch (``latch_rule``); the reason gives the numbers."""
    if latch is None or decision.score is None or decision.threshold is None:
        return decision
    words = [decision.reason, _trouble_words(decision.score, weights)]
    if latch.since is not None and latch.progress:
        words.append(f"progress event: latch from step {latch.since} released")
    for_trouble = for_trouble_only(
        decision.leg,
        escalating=escalated,
        trouble=decision.score.trouble,
        base_value=base_value,
        bar=decision.threshold,
    )
    leg, since = latch_rule(decision.leg, latch, step=step, for_trouble=for_trouble)
    if latch.held:
        words.append(f"latched on cloud since step {since}: no progress event yet")
    elif since == step:
        bars = f"{base_value:g} < {decision.threshold:g}"
        words.append(f"without trouble {bars}: latched on cloud until a progress event")
    return replace(decision, leg=leg, reason="; ".join(words), latch=since)


#: What the band's leg does, by (the step comes from cloud, the band's leg): the reason's last words.
_BAND_MOVES: dict[tuple[bool, Leg], str] = {
    (True, "cloud"): "stay on cloud",
    (True, "local"): "back to local",
    (False, "cloud"): "escalate to cloud",
    (False, "local"): "stay local",
}


def decide_leg(
    *,
    mode: Mode,
    step: int,
    current_leg: Leg | None,
    score: StepScore | None,
    cloud_share: int = DEFAULT_CLOUD_SHARE,
    hysteresis: int = DEFAULT_HYSTERESIS,
    score_quantiles: Sequence[float] | None = None,
    pace: Pace | None = None,
    latch: Latch | None = None,
    trouble_weights: Mapping[str, int] | None = None,
) -> RouteDecision:
    """Pick the leg of one step.

    ``cloud``/``local`` modes pin every step. In ``fusion``: ``cloud_share == 0``
    never goes cloud and ``100`` always does; step 0 (the plan) goes cloud whenever ``cloud_share > 0``;
    a continuation from a local leg goes cloud iff ``score >= T + h'``;
    a continuation from a cloud leg stays cloud iff ``score >= T - h'``, where
    ``h'`` is ``hysteresis`` narrowed near the ends of the scale (``hysteresis_band``).

    ``T`` is the design's ``100 - cloud_share``, compared with the integer score.
    With a calibrated ``score_quantiles`` table, ``T`` is its entry
    ``100 - cloud_share`` and is compared with the step's exact points
    (``StepScore.points``); the table was learned with the same band, so
    ``cloud_share`` is then the share of continuation steps that go to cloud.

    With a ``pace`` (the paced dial, ``FusionContext.pace_slack``), the band's
    choice stands unless it would take the thread's count of cloud continuation
    steps more than ``pace.slack`` steps away from ``cloud_share`` percent of its
    continuation steps (``paced_leg``); the plan and the ends of the dial are unchanged.

    With a ``latch`` (``FusionContext.trouble_signals``), the band's choice
    then goes through the escalation latch (``latch_rule``): a step escalated
    from local to cloud for trouble (its value without the trouble terms,
    ``StepScore.base_points``, is below the escalation bar) latches the turn on
    cloud, every later step stays there until a progress event releases it, and
    then the band decides again from the cloud leg. The decision's ``latch`` is the latch after the step;
    its reason gives the trouble terms. The pace, applied last, may still
    overrule it. Without a latch nothing here changes.

    The hysteresis keeps runs of local steps long: llama-server reuses its KV
    cache by longest common prefix, so flipping legs every step would make it
    reprocess the tail that grew while the other leg ran.

    Args:
        mode: ``cloud``, ``local`` or ``fusion``.
        step: Index of the step in the turn (0 is the plan).
        current_leg: Leg of the previous inference in the turn (``None`` at step 0).
        score: The step's score; required for fusion continuations.
        cloud_share: The dial, 0-100.
        hysteresis: Half-width of the dead band around the threshold.
        score_quantiles: A calibrated dial (``check_score_quantiles``); ``None``
            keeps the design's rule.
        pace: The thread's continuation steps so far and the slack; ``None``
            leaves every continuation step to the score.
        latch: The escalation latch as this step finds it; ``None``: no latch
            (the seed's rule).
        trouble_weights: The weights ``score`` was scored with (``score_step``), for the
            reason's words; ``None``: ``TROUBLE_WEIGHTS``.
    """
    if not 0 <= cloud_share <= 100:
        raise ValueError(f"cloud_share must be between 0 and 100, got {cloud_share}")
    if hysteresis < 0:
        raise ValueError(f"hysteresis must be >= 0, got {hysteresis}")
    if mode == "cloud":
        return RouteDecision("cloud", score, None, "mode=cloud: every step runs on cloud")
    if mode == "local":
        return RouteDecision("local", score, None, "mode=local: every step runs locally")
    if mode != "fusion":
        raise ValueError(f"mode must be one of 'cloud', 'local', 'fusion', got {mode!r}")
    if cloud_share == 0:
        return RouteDecision("local", score, None, "cloud_share=0: never cloud")
    if cloud_share == 100:
        return RouteDecision("cloud", score, None, "cloud_share=100: always cloud")
    if step == 0:
        return RouteDecision(
            "cloud", score, None, f"step 0 (plan) runs on cloud because cloud_share={cloud_share} > 0"
        )
    if score is None:
        raise ValueError("fusion continuation steps need a score")
    base = dial_base(cloud_share, score_quantiles)
    value: float = score.score
    base_value: float = int(score.base_points + 0.5)
    shown, label = str(score.score), f"T={base}"
    if score_quantiles is not None:
        value, base_value = score.points, score.base_points
        shown, label = f"{score.score} ({value:g} points)", f"calibrated T={base:g}"
    on_cloud = current_leg == "cloud"
    leg, threshold = band_leg(value, base, hysteresis, on_cloud=on_cloud)
    half, sign = round(abs(threshold - base), 2), "-" if on_cloud else "+"
    compared = ">=" if leg == "cloud" else "<"
    reason = (
        f"score {shown} {compared} {threshold:g} ({label} {sign} h={half:g}): {_BAND_MOVES[on_cloud, leg]}"
    )
    decision = _latched(
        RouteDecision(leg, score, threshold, reason),
        latch,
        step=step,
        escalated=not on_cloud,
        base_value=base_value,
        weights=trouble_weights,
    )
    return _paced(decision, pace, cloud_share)
