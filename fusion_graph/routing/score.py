"""The step score: the signals of a step, their points, and the decision a route hands on.

Pure functions and plain types, so the graph, replay and calibration score a
step with the same code. The score deliberately has **no prompt-cache input**:
how many prompt tokens a step reused from llama-server's KV cache
(``cached_tokens``) is only known *after* that step's call returns, so feeding it
into the step's own route would be circular. It belongs in the route log, not here.

With ``FusionContext.trouble_signals`` the same score gains two terms measured
by ``fusion_graph.routing.trouble`` (``TroubleSignals`` in, ``TroubleScore`` out); off,
every score is the four-term rule's. The leg decision over the score is
``fusion_graph.routing.rule``. ``call_key`` is a tool call's identity (its name
and canonical arguments): the loop detector and the no-progress signal count
calls by it, so both agree on what "the same call" is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Leg = Literal["local", "cloud"]
Mode = Literal["cloud", "local", "fusion"]

#: Points each normalised signal contributes. They sum to 100 so the score is
#: directly comparable with the ``cloud_share`` dial (threshold ``100 - cloud_share``).
WEIGHTS: dict[str, int] = {
    "context_pressure": 40,
    "turn_depth": 25,
    "transient_notice": 20,
    "tail_growth": 15,
}
assert sum(WEIGHTS.values()) == 100, "routing weights must sum to 100"

#: Points of the trouble terms (``FusionContext.trouble_signals``, measured by ``routing.trouble``),
#: added to the four above; the total is clipped to 100. A step with no trouble scores exactly what the
#: four give, so the design's figures hold unchanged. One fresh tool error (severity 0.5) adds 25 points:
#: a warning, not an escalation of a light step (real continuation steps score 4-55 on the shared
#: traces); errors on consecutive steps (0.75-1.0: 37-50 points) or an error inside a loop (no
#: progress 0.5: 15 more) lift a mid-turn step past ``T + h`` at ``cloud_share`` 40-50 by
#: themselves, and to the top of any calibrated table. No progress weighs less than errors because
#: repeats are also how an agent re-reads state it needs, and the loop detector's notice (20) already
#: answers the worst repeats.
TROUBLE_WEIGHTS: dict[str, int] = {
    "error_severity": 50,
    "no_progress": 30,
}


def check_trouble_weights(weights: Mapping[str, float]) -> dict[str, int]:
    """``weights`` as whole points per trouble term, the missing terms at ``TROUBLE_WEIGHTS``.

    ``FusionContext.trouble_weights`` holds them (``fusion-graph calibrate --labels
    --trouble-signals`` picks them); 0 turns a term off.

    Raises:
        ValueError: An unknown term, or a weight that is not a whole number 0-100.
    """
    unknown = sorted(set(weights) - set(TROUBLE_WEIGHTS))
    if unknown:
        raise ValueError(
            f"trouble_weights has no term {unknown[0]!r}; the terms are {sorted(TROUBLE_WEIGHTS)}"
        )
    checked = dict(TROUBLE_WEIGHTS)
    for name, value in weights.items():
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not float(value).is_integer() or not 0 <= value <= 100:
            raise ValueError(f"trouble_weights[{name!r}] must be a whole number 0-100, got {value!r}")
        checked[name] = int(value)
    return checked


DEFAULT_CLOUD_SHARE = 30
DEFAULT_HYSTERESIS = 10


@dataclass(frozen=True)
class StepSignals:
    """Raw signals for one step, all known after the prompt is built and before the call.

    Attributes:
        prompt_tokens: Estimated tokens of the prompt about to be sent.
        conversation_max_tokens: Context budget of the conversation (by default the
            local window less the completion budget: pressure 1 means the step no
            longer fits llama-server's slot).
        step: Index of the step within the turn (the plan is step 0).
        max_steps: Step limit of the turn.
        transient_notice: The loop detector fired or a batch was trimmed since
            the previous step.
        tool_output_tokens: Tokens of tool output accumulated in this turn.
        stable_prefix_tokens: Tokens of the stable prefix (system prompt,
            earlier turns, this turn's user message).
    """

    prompt_tokens: int
    conversation_max_tokens: int
    step: int
    max_steps: int
    transient_notice: bool
    tool_output_tokens: int
    stable_prefix_tokens: int


@dataclass(frozen=True)
class Latch:
    """The escalation latch as a continuation step finds it (``FusionContext.trouble_signals``).

    ``since`` is the step of the turn whose trouble escalated it to cloud
    (``None``: not held); ``progress`` says the results since the previous step
    are a progress event (``trouble.progress_event``), which releases it.
    The graph keeps ``since`` in ``State.latch``; replay rebuilds it the same way.
    ``routing.rule.latch_rule`` applies it; it lives here so ``TroubleSignals`` can read it.
    """

    since: int | None = None
    progress: bool = False

    @property
    def held(self) -> bool:
        """Whether it holds the step on cloud: set, and no progress event released it."""
        return self.since is not None and not self.progress


@dataclass(frozen=True)
class TroubleSignals(StepSignals):
    """``StepSignals`` with the trouble signals (``FusionContext.trouble_signals``; ``routing.trouble``).

    A subclass, so a step routed without them records exactly the seed's signals.

    Attributes:
        error_severity: 0-1, the turn's error results, recent ones weighing most.
        no_progress: 0-1, the share of recent calls already requested earlier in the turn.
        progress: The results since the previous step are a progress event (it releases the latch).
        latched: The escalation latch coming into the step: the step of the turn that set it
            (``None``: not held).
    """

    error_severity: float
    no_progress: float
    progress: bool
    latched: int | None

    @property
    def latch(self) -> Latch:
        """The escalation latch the step finds."""
        return Latch(self.latched, self.progress)

    @property
    def held(self) -> bool:
        """Whether the latch holds the step on cloud (``Latch.held``)."""
        return self.latch.held


@dataclass(frozen=True)
class StepScore:
    """A score with its four terms, in points (each term is ``weight × ratio``)."""

    score: int
    context_pressure: float
    turn_depth: float
    transient_notice: float
    tail_growth: float

    def breakdown(self) -> dict[str, float]:
        """Points per term, keyed by term name (every term is a float: no deep copy needed)."""
        return {name: value for name, value in vars(self).items() if name != "score"}

    @property
    def base_points(self) -> float:
        """The points of the seed's four terms alone, to 2 decimals: what the step scores without trouble."""
        return round(self.context_pressure + self.turn_depth + self.transient_notice + self.tail_growth, 2)

    @property
    def points(self) -> float:
        """The total before rounding to ``score``: the sum of the terms, to 2 decimals (``base_points`` here).

        The calibrated dial compares this, so steps that share an integer score
        can still be told apart.
        """
        return self.base_points

    @property
    def trouble(self) -> float:
        """Points of the trouble terms (0: scored without them)."""
        return 0.0


@dataclass(frozen=True)
class TroubleScore(StepScore):
    """A score with the trouble terms beside the seed's four (each ``weight × ratio``, in points).

    ``score`` and ``points`` add all six, clipped to 100; clipping never changes a
    decision, since every bar of the dial is below 100 where it reads the score.
    """

    error_severity: float
    no_progress: float

    @property
    def points(self) -> float:
        """The six terms summed (2 decimals), clipped to 100."""
        return min(100.0, round(self.base_points + self.error_severity + self.no_progress, 2))

    @property
    def trouble(self) -> float:
        """Points of the two trouble terms."""
        return round(self.error_severity + self.no_progress, 2)


@dataclass(frozen=True)
class RouteDecision:
    """The leg a step runs on, and why.

    ``score``/``threshold`` are ``None`` where no score applies (fixed modes,
    step 0, repairs).
    """

    leg: Leg
    score: StepScore | None
    threshold: float | None
    """An integer under the design's rule; points (2 decimals) under a calibrated table."""
    reason: str
    budget: str | None = None
    """Why a cloud budget moved this decision from cloud to local (``None``: it did not)."""
    latch: int | None = None
    """The escalation latch after this decision: the step that set it (``None``: not held, or no latch)."""
    paced: bool = False
    """Whether the paced dial forced this leg against the score's band (``routing.rule.paced_leg``)."""


def _ratio(numerator: float, denominator: float) -> float:
    if denominator <= 0:
        return 1.0 if numerator > 0 else 0.0
    return min(max(numerator / denominator, 0.0), 1.0)


def score_step(signals: StepSignals, trouble_weights: Mapping[str, int] | None = None) -> StepScore:
    """Score one step from 0 (mechanical) to 100 (needs the strongest model).

    ``40 × context pressure + 25 × turn depth + 20 × transient notice + 15 × tail growth``,
    each ratio clipped to [0, 1]. Turn depth is ``step / (max_steps - 1)``: the
    last step a turn may run (index ``max_steps - 1``) has depth 1, so a step
    that fills the context budget with tool output at the end of a turn scores
    ``40 + 25 + 15 = 80`` without a notice, which reaches ``T + h`` at the
    defaults. See the module docstring for why cached tokens are not an input.

    ``TroubleSignals`` (``FusionContext.trouble_signals``) add two terms, ``50 ×
    error severity + 30 × no progress`` (``TROUBLE_WEIGHTS``), to the same sum,
    clipped to 100, and give a ``TroubleScore``: trouble lifts a step on top of
    how heavy it is, and a step with no trouble scores exactly what the four
    give. Plain ``StepSignals`` score exactly as the seed's rule.

    ``trouble_weights`` (``FusionContext.trouble_weights``, ``check_trouble_weights``)
    replaces ``TROUBLE_WEIGHTS`` for the two trouble terms; ``None`` keeps them.
    """
    ratios = {
        "context_pressure": _ratio(signals.prompt_tokens, signals.conversation_max_tokens),
        "turn_depth": _ratio(signals.step, signals.max_steps - 1),
        "transient_notice": 1.0 if signals.transient_notice else 0.0,
        "tail_growth": _ratio(signals.tool_output_tokens, signals.stable_prefix_tokens),
    }
    weights = WEIGHTS
    if isinstance(signals, TroubleSignals):
        ratios["error_severity"] = _ratio(signals.error_severity, 1)
        ratios["no_progress"] = _ratio(signals.no_progress, 1)
        weights = WEIGHTS | dict(TROUBLE_WEIGHTS if trouble_weights is None else trouble_weights)
    points = {name: round(weights[name] * ratio, 2) for name, ratio in ratios.items()}
    total = sum(weights[name] * ratio for name, ratio in ratios.items())
    score = min(100, max(0, int(total + 0.5)))
    if isinstance(signals, TroubleSignals):
        return TroubleScore(score=score, **points)
    return StepScore(score=score, **points)


#: Points per score band (reports and metrics group shadow checks by it).
BAND_POINTS = 20


def score_band(score: float | None) -> str:
    """The band a step's score falls in (``"0-19"`` ... ``"80-100"``; ``"-"``: the step had no score)."""
    if score is None:
        return "-"
    low = min(int(score) // BAND_POINTS * BAND_POINTS, 100 - BAND_POINTS)
    return f"{low}-{low + BAND_POINTS - 1 if low + BAND_POINTS < 100 else 100}"


def call_key(name: str, args: Mapping[str, Any] | Any) -> str:
    """Identity of a call: name plus canonical JSON arguments (the loop detector's and no-progress's)."""
    return f"{name}:{json.dumps(args, sort_keys=True, default=str)}"
