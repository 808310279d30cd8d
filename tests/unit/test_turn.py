"""The turn's bookkeeping: the pace counted from the route log."""

from __future__ import annotations

from fusion_graph.context import FusionContext
from fusion_graph.records import RouteRecord, StepKind, make_record
from fusion_graph.routing import Leg, Pace, RouteDecision
from fusion_graph.state import State
from fusion_graph.turn import pace_of


def record(kind: StepKind, routed: Leg, answered: Leg | None = None) -> RouteRecord:
    decision = RouteDecision(routed, None, None, "test")
    return make_record(
        turn=0,
        step=1,
        kind=kind,
        leg=answered or routed,
        decision=decision,
        signals=None,
        provider=None,
        answer=None,
    )


def test_pace_of_counts_the_routers_continuation_steps_in_the_route_log() -> None:
    log = [
        record("plan", "cloud"),
        record("step", "local"),
        record("step", "cloud"),
        record("repair", "cloud"),  # kept on the leg that made the malformed call: not routed
        record("memory", "local"),
        record("step", "cloud", answered="local"),  # fell over: the router's choice is what counts
        record("plan", "cloud"),
        record("step", "local"),
    ]
    state: State = {"messages": [], "route_log": log}
    assert pace_of(state, FusionContext(pace_slack=0.5)) == Pace(0.5, steps=4, cloud=2)
    assert pace_of({"messages": []}, FusionContext(pace_slack=2)) == Pace(2, steps=0, cloud=0)
    assert pace_of(state, FusionContext()) is None  # the default context does not pace
