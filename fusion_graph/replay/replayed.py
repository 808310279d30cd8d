"""Recorded trajectories routed with the graph's own routing, and what each step costs.

Replays run ``history.route_history`` (no model calls). Token counts are
estimates (``sizing.turn.approximate_tokens``): a step's prompt is what it
would send, its completion the recorded assistant message; costs price those
estimates with no cached tokens. ``None`` stands for a cost whose cloud price is
unknown, and stays ``None`` through every sum (``add_cost``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fusion_graph.context import FusionContext
from fusion_graph.providers.pricing import TokenPrices
from fusion_graph.replay.history import ReplayedStep, route_history
from fusion_graph.replay.traces import RecordedTrajectory, StepPrices
from fusion_graph.routing.rule import CloudBudget, cloud_budget
from fusion_graph.sizing.turn import approximate_tokens


@dataclass(frozen=True)
class ReplayedTrajectory:
    """A trajectory routed step by step, with each step's estimated completion tokens."""

    trajectory: RecordedTrajectory
    steps: tuple[ReplayedStep, ...]
    completion_tokens: tuple[int, ...]
    context: FusionContext | None = None
    """The run context it was replayed under (``None``: unknown, as in hand-built replays)."""
    priced: bool = False
    """Whether cloud steps were priced while routing, so the context's cloud budgets applied."""


def cloud_cost_of(prices: StepPrices) -> Callable[[int, int], float | None]:
    """``route_history``'s ``cloud_cost``: a step's cloud price, ``None`` when the cloud price is unknown."""
    cloud = prices.cloud

    def cost(prompt: int, completion: int) -> float | None:
        return cost_at(cloud, prompt, completion)

    return cost


def replay_trajectory(
    trajectory: RecordedTrajectory, context: FusionContext, prices: StepPrices | None = None
) -> ReplayedTrajectory:
    """Route every assistant message of ``trajectory`` under ``context`` (no model calls).

    With ``prices``, cloud steps are priced as they are routed, so the context's
    cloud budgets (``turn_cloud_budget_usd``, ``thread_cloud_budget_usd``) apply
    by the graph's rule (``route_history``); without, no budget applies.
    """
    cloud_cost = cloud_cost_of(prices) if prices is not None else None
    steps = route_history(trajectory.messages, context, cloud_cost=cloud_cost)
    completions = tuple(approximate_tokens([trajectory.messages[s.position]]) for s in steps)
    return ReplayedTrajectory(trajectory, tuple(steps), completions, context, prices is not None)


def replay_all(
    trajectories: Sequence[RecordedTrajectory],
    context: FusionContext,
    *,
    advance: Callable[[], None] | None = None,
    prices: StepPrices | None = None,
) -> list[ReplayedTrajectory]:
    """``replay_trajectory`` for each, calling ``advance`` after each one (a progress bar)."""
    replays = []
    for trajectory in trajectories:
        replays.append(replay_trajectory(trajectory, context, prices))
        if advance is not None:
            advance()
    return replays


def cost_at(prices: TokenPrices | None, prompt: int, completion: int) -> float | None:
    """USD of ``prompt`` and ``completion`` tokens (no cached input) at ``prices``; ``None``: no price."""
    return None if prices is None else prices.cost(prompt, 0, completion)


def add_cost(total: float | None, value: float | None) -> float | None:
    """``total + value``, or ``None`` when either is unknown."""
    return None if total is None or value is None else total + value


def step_costs(replay: ReplayedTrajectory, prices: StepPrices) -> list[tuple[float | None, float]]:
    """Each step's ``(cloud, local)`` cost in USD, as ``summarize`` prices it (for cost targets).

    The cloud cost is ``None`` when the cloud model's price is unknown.
    """
    costs = []
    for item, completion in zip(replay.steps, replay.completion_tokens, strict=True):
        prompt = item.signals.prompt_tokens
        costs.append((cost_at(prices.cloud, prompt, completion), prices.local.cost(prompt, 0, completion)))
    return costs


def replay_budget(replay: ReplayedTrajectory) -> CloudBudget:
    """The cloud budget that applied to a replay (none unless it was priced while routing)."""
    context = replay.context
    if context is None or not replay.priced:
        return CloudBudget()
    return cloud_budget(
        operator_turn=None,
        operator_thread=None,
        run_turn=context.turn_cloud_budget_usd,
        run_thread=context.thread_cloud_budget_usd,
    )
