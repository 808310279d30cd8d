"""What each thread sends and the least it must cost.

Every step is routed the way the graph routes it; a local request's physical
minimum is what is new since the same thread's previous local request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import convert_to_messages

from bench.traces import Trajectory
from fusion_graph.context import FusionContext
from fusion_graph.replay.history import route_history
from fusion_graph.routing.score import DEFAULT_CLOUD_SHARE, Leg

#: The routing dial the targets are stated for.
CLOUD_SHARE = DEFAULT_CLOUD_SHARE


# -- routing (the project's own core, driven like the graph drives it) -------


@dataclass(frozen=True)
class RoutedStep:
    """The route of one assistant step of a trajectory."""

    position: int
    step: int
    leg: Leg
    score: int | None
    estimate_tokens: int


def route_trajectory(
    messages: Sequence[Mapping[str, Any]],
    *,
    hysteresis: int,
    cloud_share: int = CLOUD_SHARE,
) -> list[RoutedStep]:
    """Route every assistant step of a trajectory with the graph's own replay (``route_history``)."""
    context = FusionContext(mode="fusion", cloud_share=cloud_share, hysteresis=hysteresis)
    replayed = route_history(convert_to_messages([dict(m) for m in messages]), context)
    return [
        RoutedStep(
            r.position,
            r.step,
            r.leg,
            r.decision.score.score if r.decision.score is not None else None,
            r.signals.prompt_tokens,
        )
        for r in replayed
    ]


# -- the physical minimum ---------------------------------------------------


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def new_token_counts(requests: Iterable[Sequence[int]]) -> list[int]:
    """Tokens of each request that are new since the previous one (the first: all of them).

    Give it one thread's local requests in order; the result is the least any
    prefix cache could process for each.
    """
    counts = []
    previous: Sequence[int] = ()
    for tokens in requests:
        counts.append(len(tokens) - common_prefix_len(previous, tokens))
        previous = tokens
    return counts


@dataclass(frozen=True)
class PlannedStep:
    """A routed step with its token counts."""

    position: int
    step: int
    leg: Leg
    n_tokens: int
    minimum: int
    estimate_tokens: int


@dataclass(frozen=True)
class ThreadPlan:
    """What one thread sends, step by step."""

    trajectory: Trajectory
    steps: tuple[PlannedStep, ...]


def plan_thread(
    trajectory: Trajectory, routed: Sequence[RoutedStep], tokens: Sequence[Sequence[int]]
) -> ThreadPlan:
    """Attach token counts and minima (local steps only; cloud steps get 0) to routed steps.

    ``tokens[i]`` is the rendered prompt of ``routed[i]``.
    """
    local = [i for i, r in enumerate(routed) if r.leg == "local"]
    minima = dict(zip(local, new_token_counts(tokens[i] for i in local), strict=True))
    steps = tuple(
        PlannedStep(r.position, r.step, r.leg, len(tokens[i]), minima.get(i, 0), r.estimate_tokens)
        for i, r in enumerate(routed)
    )
    return ThreadPlan(trajectory, steps)
