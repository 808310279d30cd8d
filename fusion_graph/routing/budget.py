"""The cloud budget: what a turn and a thread may still spend on cloud, and what that does to a route.

Pure functions over plain data, like ``routing``: the graph, replay and
calibration apply the same rule. The spend so far is read from the thread's
``route_log`` (the cost of every inference the cloud leg answered, priced at
the provider that answered); the step's cost is the graph's estimate before the
call (its estimated prompt and completion budget at the cloud link's prices).
A step whose estimated cost would take either spend past its budget runs
local instead, and the reason carries the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from fusion_graph.routing.records import RouteRecord, money
from fusion_graph.routing.score import RouteDecision


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

    def extra(self) -> dict[str, Any]:
        """What a record keeps of the check: the step's cloud price, the cap and, when over, why."""
        if not self.limited:
            return {}
        kept: dict[str, Any] = {"cloud_step_usd": self.step_usd}
        if self.max_tokens is not None:
            kept["cloud_max_tokens"] = self.max_tokens
        return kept | ({"cloud_budget": self.over} if self.over else {})


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
