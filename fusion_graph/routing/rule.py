"""When a step goes to cloud: the leg decision, the cloud budget guard and the fit bounds.

Three rules answer that question, and a step's order applies them together
(``fusion_graph.nodes.step.order_step``), so they live in one module:

- **The leg decision** (``decide_leg``): threshold, hysteresis (the band), the
  plan rule, the paced dial (``Pace``) and the escalation latch. The step's
  score comes from ``fusion_graph.routing.score``. With
  ``FusionContext.trouble_signals`` the decision goes through the latch
  (``Latch``, ``latch_rule``); off, it is absent and every decision is the
  four-term rule's.
- **The budget guard** (``check_budget``): what a turn and a thread may still
  spend on cloud. The spend so far is read from the thread's ``route_log`` (the
  cost of every inference the cloud leg answered, priced at the provider that
  answered); the step's cost is estimated before the call (its prompt and
  expected completion at the cloud provider's prices). A step whose cost would
  take either spend past its budget runs local instead
  (``BudgetCheck.guard``), and the reason carries the numbers.
- **The fit bounds** (``plan_fit``): never send a step to a provider whose
  window cannot hold it. Each provider of the chain comes with its window and
  the step's estimated prompt on its leg (``LinkRoom``); back come where the
  step may go and, when the rule changed the route, a reason with the numbers
  (``prompt 2,411 + 512 > local window 2,048: escalated to cloud``). When no
  window can hold the step, the plan says how many tokens compaction must free
  on the largest one.

Everything here is a pure function over plain data, so the graph, the replay
benchmark and calibration all call the exact same code and any decision can be
reproduced without a model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

from fusion_graph.errors import ContextError
from fusion_graph.routing.records import BudgetRecord, RecordParts, RouteRecord, money
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


#: A link's completion budget is at most this share of its window, so a small window still
#: holds a prompt (a 2,048-token slot with the default 4,096 budget reserves 1,024).
MAX_BUDGET_SHARE = 0.5


#: Context budget of the score when the local window is unknown (not llama-server, no setting).
FALLBACK_CONVERSATION_TOKENS = 32_768


#: Compaction frees this share of the target window's usable part beyond what the step needs, so
#: the steps after it fit without compacting again (each compaction breaks every cached prefix).
COMPACTION_HEADROOM = 0.25


@dataclass(frozen=True)
class LinkRoom:
    """One link as the fit rule sees it.

    Attributes:
        id: The provider id.
        leg: The link's leg.
        window: Tokens the link holds per request (prompt + completion); ``None``: unknown,
            assumed to fit.
        prompt_tokens: The step's estimated prompt on this link (its leg's estimate).
    """

    id: str
    leg: Leg
    window: int | None
    prompt_tokens: int


def completion_budget(max_completion_tokens: int, window: int | None) -> int:
    """Tokens reserved for the answer on a link: ``max_completion_tokens``, at most half the window."""
    if window is None:
        return max_completion_tokens
    return max(1, min(max_completion_tokens, int(window * MAX_BUDGET_SHARE)))


def fits(room: LinkRoom, max_completion_tokens: int) -> bool:
    """Whether the step's prompt plus the link's completion budget fits its window."""
    if room.window is None:
        return True
    return room.prompt_tokens + completion_budget(max_completion_tokens, room.window) <= room.window


def usable_window(window: int, max_completion_tokens: int) -> int:
    """What a window leaves for the prompt once the completion budget is reserved."""
    return window - completion_budget(max_completion_tokens, window)


def conversation_budget(
    conversation_max_tokens: int | None, local_window: int | None, max_completion_tokens: int
) -> int:
    """The score's context budget: an explicit value, else the local window's usable part.

    Context pressure then means "how full the local window is": it reaches 1
    exactly when the step no longer fits llama-server's slot.

    Raises:
        ValueError: An explicit value larger than the usable local window (pressure
            could never reach 1 before llama-server overflows); the message names the fix.
    """
    if local_window is None:
        return conversation_max_tokens or FALLBACK_CONVERSATION_TOKENS
    usable = usable_window(local_window, max_completion_tokens)
    if conversation_max_tokens is None:
        return max(usable, 1)
    if conversation_max_tokens > usable:
        budget = completion_budget(max_completion_tokens, local_window)
        raise ContextError(
            f"conversation_max_tokens {conversation_max_tokens:,} is more than the local window holds "
            f"for a prompt: {local_window:,} - completion budget {budget:,} = {usable:,} tokens; lower "
            "it, leave it empty to use the window, or give llama-server a larger slot (-c / -np)"
        )
    return conversation_max_tokens


@dataclass(frozen=True)
class FitPlan:
    """Where a step may go.

    Attributes:
        leg: The leg to start on: the routed leg, or the leg of the first link that fits.
        allowed: Ids of the links that can hold the step, in chain order.
        reason: Why the rule moved the step (``None`` when the routed leg fits).
        compact: Tokens compaction must free for the largest window to hold the step, plus
            ``COMPACTION_HEADROOM`` of its usable part for the steps after it (0 when some link fits).
        target: The link compaction aims at (the largest known window), or ``None``.
    """

    leg: Leg
    allowed: tuple[str, ...]
    reason: str | None
    compact: int = 0
    target: str | None = None


def _overflow(room: LinkRoom, max_completion_tokens: int) -> str:
    budget = completion_budget(max_completion_tokens, room.window)
    return f"prompt {room.prompt_tokens:,} + {budget:,} > {room.leg} window {room.window or 0:,}"


def plan_fit(routed: Leg, rooms: Sequence[LinkRoom], max_completion_tokens: int) -> FitPlan:
    """Apply the fit rule to a step routed to ``routed`` over the chain's links (in chain order).

    The step keeps its leg when that leg's first link fits. Otherwise it starts
    on the first link (chain order) that fits, and the reason says why; when
    none fits, ``compact`` is what must be freed for the largest window.
    """
    allowed = tuple(room.id for room in rooms if fits(room, max_completion_tokens))
    known = [room for room in rooms if room.window is not None]
    if not known:
        return FitPlan(routed, allowed, None)
    own = [room for room in rooms if room.leg == routed]
    if own and own[0].id in allowed:
        return FitPlan(routed, allowed, None)
    if allowed:
        chosen = next(room for room in rooms if room.id == allowed[0])
        if not own:
            return FitPlan(chosen.leg, allowed, None)
        verb = "escalated to" if chosen.leg == "cloud" else "moved to"
        return FitPlan(
            chosen.leg, allowed, f"{_overflow(own[0], max_completion_tokens)}: {verb} {chosen.leg}"
        )
    largest = max(known, key=lambda room: room.window or 0)
    window = largest.window or 0
    need = largest.prompt_tokens + completion_budget(max_completion_tokens, window) - window
    need += int(COMPACTION_HEADROOM * usable_window(window, max_completion_tokens))
    reason = f"{_overflow(largest, max_completion_tokens)} (the largest window): compacted"
    return FitPlan(largest.leg, (), reason, compact=need, target=largest.id)


@dataclass(frozen=True)
class CloudBudget:
    """USD a turn and a thread may spend on cloud (``None``: no limit)."""

    turn_usd: float | None = None
    thread_usd: float | None = None

    @property
    def limited(self) -> bool:
        """Whether either budget is set (the router only then prices a step)."""
        return self.turn_usd is not None or self.thread_usd is not None


def _lower(ceiling: float | None, asked: float | None) -> float | None:
    if ceiling is None:
        return asked
    return ceiling if asked is None else min(ceiling, asked)


def cloud_budget(
    *,
    operator_turn: float | None,
    operator_thread: float | None,
    run_turn: float | None,
    run_thread: float | None,
) -> CloudBudget:
    """The budget a run gets: its own, never above the operator's ceiling (a run may only lower it)."""
    return CloudBudget(_lower(operator_turn, run_turn), _lower(operator_thread, run_thread))


@dataclass(frozen=True)
class CloudSpend:
    """USD spent on cloud so far: in the turn in progress and in the whole thread."""

    turn_usd: float = 0.0
    thread_usd: float = 0.0


def cloud_spend(route_log: Sequence[RouteRecord], turn: int) -> CloudSpend:
    """What the cloud leg answered so far, by the records' own prices (unpriced records count 0).

    ``leg`` is the leg that answered, so a local step that fell over to cloud
    counts, and a cloud step that fell over to local does not.
    """
    thread = turn_total = 0.0
    for record in route_log:
        if record["leg"] != "cloud" or not record["cost_usd"]:
            continue
        thread += record["cost_usd"]
        if record["turn"] == turn:
            turn_total += record["cost_usd"]
    return CloudSpend(turn_total, thread)


def over_budget(budget: CloudBudget, spend: CloudSpend, step_usd: float | None) -> str | None:
    """Why a cloud step costing ``step_usd`` is not affordable, or ``None`` when it is.

    An unknown price (``None``) is never assumed to fit a set budget: the router
    cannot keep a budget it cannot price.
    """
    if not budget.limited:
        return None
    for name, limit, spent in (
        ("turn", budget.turn_usd, spend.turn_usd),
        ("thread", budget.thread_usd, spend.thread_usd),
    ):
        if limit is None:
            continue
        if step_usd is None:
            return f"{name} budget {money(limit)}: the cloud price is unknown (set price_overrides)"
        if spent + step_usd > limit:
            return f"{name} budget {money(limit)}: {money(spent)} spent, step ~{money(step_usd)}"
    return None


#: Fewest completion tokens a cloud inference is priced at, whatever the thread's steps spent.
COMPLETION_FLOOR = 256


#: How many of the thread's latest answered inferences the expected completion is the mean of.
RECENT_COMPLETIONS = 8


def expected_completion(route_log: Sequence[RouteRecord], *, ceiling: int) -> int:
    """What the next inference will likely write: the mean of the thread's recent completions.

    At least ``COMPLETION_FLOOR``, at most ``ceiling`` (the completion budget):
    pricing every step at its whole budget made a budget bite several times
    harder than its face value; the call itself is capped at what the budget
    can still pay (``BudgetCheck.max_tokens``), so nothing is spent past it.
    """
    done = [
        int(record["completion_tokens"])
        for record in route_log[-4 * RECENT_COMPLETIONS :]
        if record["completion_tokens"]
    ][-RECENT_COMPLETIONS:]
    typical = -(-sum(done) // len(done)) if done else COMPLETION_FLOOR
    return max(1, min(ceiling, max(COMPLETION_FLOOR, typical)))


@dataclass(frozen=True)
class StepPrice:
    """What a cloud inference would cost: its prompt (cached input at its rate), and each output token."""

    prompt_usd: float | None
    token_usd: float | None

    def cost(self, completion: int) -> float | None:
        """The inference's cost with ``completion`` output tokens (``None``: a price is unknown)."""
        if self.prompt_usd is None or self.token_usd is None:
            return None
        return self.prompt_usd + completion * self.token_usd


@dataclass(frozen=True)
class BudgetCheck:
    """What the cloud budget says of one inference before it is made.

    Attributes:
        limited: Whether a budget applies at all (none set: nothing is priced).
        step_usd: The inference's estimated cost on cloud (``None``: unknown, or not priced).
        over: Why cloud may not make it (``None``: it may).
        max_tokens: The completion cap that keeps the call within what the budget can still pay
            (``None``: no cap from the budget).
    """

    limited: bool = False
    step_usd: float | None = None
    over: str | None = None
    max_tokens: int | None = None

    def guard(self, decision: RouteDecision) -> RouteDecision:
        """``decision`` moved local when it chose cloud and cloud is over (reason and ``budget`` say why)."""
        if decision.leg != "cloud" or self.over is None:
            return decision
        reason = f"{decision.reason}; {self.over}: local"
        return replace(decision, leg="local", reason=reason, budget=self.over)

    def parts(self) -> RecordParts:
        """The record's ``budget``: the step's cloud price, the cap and, when over, why."""
        if not self.limited:
            return {}
        kept = BudgetRecord(step_usd=self.step_usd)
        if self.max_tokens is not None:
            kept["max_tokens"] = self.max_tokens
        if self.over:
            kept["over"] = self.over
        return {"budget": kept}


#: No budget set: nothing priced, nothing refused.
UNLIMITED = BudgetCheck()


def check_budget(
    budget: CloudBudget,
    route_log: Sequence[RouteRecord],
    turn: int,
    price: StepPrice,
    *,
    expected: int,
    ceiling: int,
) -> BudgetCheck:
    """The one budget guard: may an inference of ``turn`` run on cloud, and how long may it write?

    It is priced at its prompt plus ``expected`` completion tokens
    (``expected_completion``) against both spends; when that fits, the call's
    completion is capped at what the tighter budget still pays (at most
    ``ceiling``), so a budget spends up to its face value and never past it.
    The route, plan, repair, re-synthesis, MCP sampling and replay all ask it;
    ``BudgetCheck.guard`` then moves a cloud decision local, and the executors
    keep the chain's fallover off cloud past it.
    """
    if not budget.limited:
        return UNLIMITED
    spend = cloud_spend(route_log, turn)
    step_usd = price.cost(expected)
    over = over_budget(budget, spend, step_usd)
    if over is not None or price.prompt_usd is None or not price.token_usd:
        return BudgetCheck(True, step_usd, over)
    left = min(
        limit - spent
        for limit, spent in ((budget.turn_usd, spend.turn_usd), (budget.thread_usd, spend.thread_usd))
        if limit is not None
    )
    affordable = int((left - price.prompt_usd) / price.token_usd)
    return BudgetCheck(True, step_usd, None, max(expected, min(ceiling, affordable)))
