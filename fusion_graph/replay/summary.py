"""What replays add up to: both cloud shares, switches, costs, budget and re-synthesis, per step and in total.

``summarize`` builds the ``replay --json`` object; the CLI's tables, the
notebooks and the benchmarks read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

from fusion_graph.replay.replayed import ReplayedTrajectory, add_cost, cost_at, replay_budget
from fusion_graph.replay.resynthesis import RESYNTHESIS_PROMPT_TOKENS, ResynthesisCount, resynthesis_count
from fusion_graph.replay.traces import StepPrices
from fusion_graph.routing.rule import CloudBudget
from fusion_graph.routing.score import RouteDecision, StepSignals, TroubleSignals


def is_paced(decision: RouteDecision) -> bool:
    """Whether the paced dial (``routing.rule.paced_leg``) forced this leg against the score's band.

    Read from the decision's own field, never from its reason (words are for people).
    """
    return decision.paced


def is_latched(signals: StepSignals) -> bool:
    """Whether the escalation latch (``trouble_signals``) held this step on cloud: ``TroubleSignals.held``."""
    return isinstance(signals, TroubleSignals) and signals.held


def plan_note(steps: int, plans: int, plans_on_cloud: int) -> str:
    """The line that explains the gap between the share of all steps and of continuation steps."""
    note = (
        f"plans (step 0 of each turn) run on cloud whenever cloud_share > 0: {plans} of {steps} "
        f"steps are plans, {plans_on_cloud} of them on cloud here"
    )
    if plans and plans_on_cloud == plans:
        note += f", so at least {plans / steps:.2f} of all steps go to cloud"
    return note


def _fraction(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 0.0


def _ratio(part: float | None, whole: float | None) -> float | None:
    return round(part / whole, 4) if part is not None and whole else None


def budget_dict(budget: CloudBudget) -> dict[str, float | None]:
    """A budget for JSON: ``{"turn_usd", "thread_usd"}`` (``None``: no limit)."""
    return {"turn_usd": budget.turn_usd, "thread_usd": budget.thread_usd}


def resynthesis_summary(
    count: ResynthesisCount, cloud_cost: float | None, all_cloud: float | None
) -> dict[str, Any]:
    """The ``resynthesis`` object of ``summarize``: counts, added cost and its fractions."""
    return {
        "turns": count.turns,
        "turns_ending_local": count.local_endings,
        "resynthesized": count.done,
        "skipped_by_budget": count.skipped,
        "instruction_tokens": RESYNTHESIS_PROMPT_TOKENS,
        "added_cost_usd": count.cost_usd,
        "fraction_of_cloud_cost": _ratio(count.cost_usd, cloud_cost),
        "fraction_of_all_cloud_cost": _ratio(count.cost_usd, all_cloud),
    }


def summarize(replays: Sequence[ReplayedTrajectory], prices: StepPrices) -> dict[str, Any]:
    """The ``replay --json`` object: counts, fractions, switches, costs, budget, re-synthesis and every step.

    ``cloud_fraction`` is the share of all steps on cloud, ``continuation_cloud_fraction``
    the share of continuation steps (after each turn's plan); plans run on cloud
    whenever ``cloud_share > 0``, which ``note`` says with the counts (``plan_steps``,
    ``plan_cloud_steps``). ``paced_steps`` counts the steps the paced dial forced onto
    the other leg. ``switches`` counts leg changes between consecutive steps of a
    trajectory (plan steps included). Costs price the estimated tokens with no cached
    input; ``None`` when the cloud model's price is unknown; ``cost_fraction`` is
    ``cost_usd / all_cloud_cost_usd``; ``cloud_cost_usd`` is the cloud steps' part.

    With ``trouble_signals`` each step row also has ``progress`` (its progress
    event), ``latched`` (the latch held it on cloud, ``is_latched``) and ``latch``
    (the step that holds the latch after it, ``None`` when released), and the
    object counts ``latched_steps``; without, neither appears.

    ``budget`` is the cloud budget the replays ran under (``"per_trajectory"`` when
    they differ; each trajectory has its own), ``budget_local_steps`` the steps it
    moved local (``budget_local_plan_steps`` of them plans). ``resynthesis`` is what
    ``resynthesize="local_replies"`` would add (``resynthesis_count``), whatever the
    context's own setting.
    """
    steps = cloud_steps = continuation = continuation_cloud = switches = paced = latched = 0
    troubled = False
    moved = moved_plans = 0
    cost: float | None = 0.0
    cloud_cost: float | None = 0.0
    all_cloud: float | None = 0.0
    again = ResynthesisCount()
    budgets: set[CloudBudget] = set()
    trajectories = []
    for replay in replays:
        legs = [s.leg for s in replay.steps]
        switches += sum(a != b for a, b in pairwise(legs))
        budget = replay_budget(replay)
        budgets.add(budget)
        rows = []
        own_cost: float | None = 0.0
        own_cloud: float | None = 0.0
        own_all_cloud: float | None = 0.0
        own_moved = 0
        for item, completion in zip(replay.steps, replay.completion_tokens, strict=True):
            decision = item.decision
            prompt = item.signals.prompt_tokens
            step_cost = cost_at(prices.cloud if item.leg == "cloud" else prices.local, prompt, completion)
            own_cost = add_cost(own_cost, step_cost)
            if item.leg == "cloud":
                own_cloud = add_cost(own_cloud, step_cost)
            own_all_cloud = add_cost(own_all_cloud, cost_at(prices.cloud, prompt, completion))
            steps += 1
            cloud_steps += item.leg == "cloud"
            paced += is_paced(decision)
            budget_local = decision.budget is not None
            own_moved += budget_local
            moved_plans += budget_local and item.step == 0
            if item.step > 0:
                continuation += 1
                continuation_cloud += item.leg == "cloud"
            score = decision.score
            row: dict[str, Any] = {}
            if isinstance(item.signals, TroubleSignals):
                troubled = True
                latched += is_latched(item.signals)
                row = {
                    "progress": item.signals.progress,
                    "latched": is_latched(item.signals),
                    "latch": decision.latch,
                }
            rows.append(
                {
                    "position": item.position,
                    "step": item.step,
                    "leg": item.leg,
                    "paced": is_paced(decision),
                    "budget_local": budget_local,
                    "score": score.score if score is not None else None,
                    "points": score.points if score is not None else None,
                    "breakdown": score.breakdown() if score is not None else None,
                    "threshold": decision.threshold,
                    "reason": decision.reason,
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "cost_usd": step_cost,
                    **row,
                }
            )
        moved += own_moved
        cost, cloud_cost, all_cloud = (
            add_cost(cost, own_cost),
            add_cost(cloud_cost, own_cloud),
            add_cost(all_cloud, own_all_cloud),
        )
        own_again = resynthesis_count(replay, prices)
        again += own_again
        trajectory = replay.trajectory
        trajectories.append(
            {
                "id": trajectory.id,
                "file": trajectory.file,
                "reward": trajectory.reward,
                "budget": budget_dict(budget),
                "cost_usd": own_cost,
                "cloud_cost_usd": own_cloud,
                "all_cloud_cost_usd": own_all_cloud,
                "budget_local_steps": own_moved,
                "turns_ending_local": own_again.local_endings,
                "resynthesis_cost_usd": own_again.cost_usd,
                "steps": rows,
            }
        )
    plans, plans_cloud = steps - continuation, cloud_steps - continuation_cloud
    (only,) = budgets if len(budgets) == 1 else (None,)
    latch_count = {"latched_steps": latched} if troubled else {}
    return {
        "steps": steps,
        "cloud_steps": cloud_steps,
        "cloud_fraction": _fraction(cloud_steps, steps),
        "continuation_steps": continuation,
        "continuation_cloud_steps": continuation_cloud,
        "continuation_cloud_fraction": _fraction(continuation_cloud, continuation),
        "plan_steps": plans,
        "plan_cloud_steps": plans_cloud,
        "paced_steps": paced,
        **latch_count,
        "note": plan_note(steps, plans, plans_cloud),
        "switches": switches,
        "cost_usd": cost,
        "cloud_cost_usd": cloud_cost,
        "all_cloud_cost_usd": all_cloud,
        "cost_fraction": _ratio(cost, all_cloud),
        "budget": budget_dict(only) if only is not None else ("per_trajectory" if budgets else None),
        "budget_local_steps": moved,
        "budget_local_plan_steps": moved_plans,
        "resynthesis": resynthesis_summary(again, cloud_cost, all_cloud),
        "trajectories": trajectories,
    }
