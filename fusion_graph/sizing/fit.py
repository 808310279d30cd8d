"""The fit rule: never send a step to a link whose window cannot hold it.

Pure functions over plain data, like ``routing``: the executor gives each link
of the chain its window and the step's estimated prompt on that link's leg,
and gets back where the step may go and, when the rule changed the route, a
reason that carries the numbers (``prompt 2,411 + 512 > local window 2,048:
escalated to cloud``). When no link can hold the step, the plan says how many
tokens compaction must free on the link with the largest window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fusion_graph.errors import ContextError
from fusion_graph.routing.score import Leg

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
