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

from fusion_graph.routing import RouteDecision
from fusion_graph.state import RouteRecord


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


def _money(value: float) -> str:
    """USD with enough digits for sub-cent steps: ``$0.05``, ``$0.0041``."""
    text = f"{value:.4f}".rstrip("0")
    return "$" + (text + "0" if text.endswith(".") else text)


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
            return f"{name} budget {_money(limit)}: the cloud price is unknown (set price_overrides)"
        if spent + step_usd > limit:
            return f"{name} budget {_money(limit)}: {_money(spent)} spent, step ~{_money(step_usd)}"
    return None


def within_budget(decision: RouteDecision, why: str | None) -> RouteDecision:
    """``decision``, moved to local when it chose cloud and ``why`` says cloud is over budget."""
    if decision.leg != "cloud" or why is None:
        return decision
    return replace(decision, leg="local", reason=f"{decision.reason}; {why}: local")
