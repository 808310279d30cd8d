"""What ``resynthesize="local_replies"`` would add to a replay: the turns re-written on cloud, their cost.

The graph re-writes a turn's closing reply on cloud when the local leg wrote it
(``nodes.synthesis``); a replay has no such call, so this counts what there
would be, by the graph's budget rule (``routing.rule.over_budget``).
"""

from __future__ import annotations

from dataclasses import dataclass

from langchain_core.messages import AIMessage

from fusion_graph.context import FusionContext
from fusion_graph.replay.replayed import ReplayedTrajectory, add_cost, cost_at, replay_budget
from fusion_graph.replay.traces import StepPrices
from fusion_graph.routing.rule import CloudSpend, over_budget

#: Tokens of the re-synthesis instruction (``prompts.RESYNTHESIZE``) added to the reply's prompt, roughly.
RESYNTHESIS_PROMPT_TOKENS = 30


@dataclass(frozen=True)
class ResynthesisCount:
    """What ``resynthesize="local_replies"`` would add to one replay.

    A turn ends at its last assistant message (before the next user message or
    the end of the trajectory). A turn ending on a reply (no tool calls) the
    local leg wrote gets one cloud call: its prompt is that step's prompt plus
    the instruction, its completion the reply's tokens. With a budget, the call
    is priced before it (prompt plus ``max_completion_tokens``) against the
    spend so far (cloud steps and earlier re-syntheses) and skipped when over.
    """

    turns: int = 0
    local_endings: int = 0
    """Turns ending on a local reply (what the graph would re-write)."""
    done: int = 0
    skipped: int = 0
    """Re-syntheses the budget would skip (the local reply stands)."""
    cost_usd: float | None = 0.0
    """Cloud cost the done ones add (``None``: the cloud price is unknown)."""

    def __add__(self, other: ResynthesisCount) -> ResynthesisCount:
        return ResynthesisCount(
            self.turns + other.turns,
            self.local_endings + other.local_endings,
            self.done + other.done,
            self.skipped + other.skipped,
            add_cost(self.cost_usd, other.cost_usd),
        )


def _resynthesizes(context: FusionContext | None) -> bool:
    """Whether the graph would re-write local replies in a run of ``context`` if asked (any cloud at all)."""
    if context is None:
        return True
    return context.mode != "local" and not (context.mode == "fusion" and context.cloud_share == 0)


def resynthesis_count(replay: ReplayedTrajectory, prices: StepPrices) -> ResynthesisCount:
    """What re-synthesis of local replies would add to ``replay`` (see ``ResynthesisCount``)."""
    budget = replay_budget(replay)
    context = replay.context
    max_completion = (context or FusionContext()).max_completion_tokens
    applies = _resynthesizes(context)
    turns = endings = done = skipped = 0
    added: float | None = 0.0
    thread_spend = turn_spend = 0.0
    steps = replay.steps
    for index, (item, completion) in enumerate(zip(steps, replay.completion_tokens, strict=True)):
        if item.step == 0:
            turn_spend = 0.0
        prompt = item.signals.prompt_tokens
        if item.leg == "cloud":
            spent = cost_at(prices.cloud, prompt, completion) or 0.0
            thread_spend, turn_spend = thread_spend + spent, turn_spend + spent
        if index + 1 < len(steps) and steps[index + 1].step > 0:
            continue  # not the turn's last step
        turns += 1
        message = replay.trajectory.messages[item.position]
        if item.leg != "local" or (isinstance(message, AIMessage) and message.tool_calls):
            continue
        endings += 1
        if not applies:
            continue
        asked = prompt + RESYNTHESIS_PROMPT_TOKENS
        estimate = cost_at(prices.cloud, asked, max_completion)
        if over_budget(budget, CloudSpend(turn_spend, thread_spend), estimate) is not None:
            skipped += 1
            continue
        done += 1
        cost = cost_at(prices.cloud, asked, completion)
        added = add_cost(added, cost)
        thread_spend, turn_spend = thread_spend + (cost or 0.0), turn_spend + (cost or 0.0)
    return ResynthesisCount(turns, endings, done, skipped, added)
