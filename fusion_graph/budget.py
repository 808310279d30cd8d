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

from fusion_graph.records import RouteRecord, money
from fusion_graph.routing import RouteDecision


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


@dataclass(frozen=True)
class BudgetCheck:
    """What the cloud budget says of one inference before it is made.

    Attributes:
        limited: Whether a budget applies at all (none set: nothing is priced).
        step_usd: The inference's estimated cost on cloud (``None``: unknown, or not priced).
        over: Why cloud may not make it (``None``: it may).
    """

    limited: bool = False
    step_usd: float | None = None
    over: str | None = None

    def guard(self, decision: RouteDecision) -> RouteDecision:
        """``decision`` moved local when it chose cloud and cloud is over (reason and ``budget`` say why)."""
        if decision.leg != "cloud" or self.over is None:
            return decision
        reason = f"{decision.reason}; {self.over}: local"
        return replace(decision, leg="local", reason=reason, budget=self.over)

    def extra(self) -> dict[str, Any]:
        """What a record keeps of the check: the step's cloud price and, when over, why."""
        if not self.limited:
            return {}
        return {"cloud_step_usd": self.step_usd} | ({"cloud_budget": self.over} if self.over else {})


#: No budget set: nothing priced, nothing refused.
UNLIMITED = BudgetCheck()


def check_budget(
    budget: CloudBudget, route_log: Sequence[RouteRecord], turn: int, step_usd: float | None
) -> BudgetCheck:
    """The one budget guard: may an inference of ``turn`` estimated at ``step_usd`` run on cloud?

    The route, plan, repair, re-synthesis, MCP sampling and replay all ask it;
    ``BudgetCheck.guard`` then moves a cloud decision local, and the executors
    keep the chain's fallover off cloud past it.
    """
    if not budget.limited:
        return UNLIMITED
    return BudgetCheck(True, step_usd, over_budget(budget, cloud_spend(route_log, turn), step_usd))
