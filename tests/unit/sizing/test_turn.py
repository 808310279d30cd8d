"""The turn's bookkeeping: the pace counted from the route log, the trouble signals and the latch."""

from __future__ import annotations

from typing import cast

import pytest
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, ToolMessage

from fusion_graph.context import FusionContext
from fusion_graph.routing.records import RouteRecord, StepKind, make_record
from fusion_graph.routing.rule import Pace
from fusion_graph.routing.score import (
    Leg,
    RouteDecision,
    StepScore,
    StepSignals,
    TroubleScore,
    TroubleSignals,
)
from fusion_graph.sizing.turn import next_route, pace_of
from fusion_graph.state import State


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


# --------------------------------------------------------------------------- trouble signals


def failing_turn(*, latch: int | None = None, leg: Leg = "local") -> State:
    """A turn whose last batch failed twice (error severity 1), routed from ``leg``."""
    calls = [{"name": "lookup", "args": {"key": key}, "id": key, "type": "tool_call"} for key in ("a", "b")]
    messages = [
        HumanMessage("do it"),
        AIMessage("", tool_calls=calls),
        *(ToolMessage(f"Error: no {c['id']}", tool_call_id=c["id"], status="error") for c in calls),
    ]
    state: State = {"messages": cast(list[AnyMessage], messages), "step": 1, "leg": leg, "notice": False}
    if latch is not None:
        state["latch"] = latch
    return state


def test_with_trouble_signals_off_the_route_is_the_seed_rule() -> None:
    decision, signals = next_route(failing_turn(latch=1), FusionContext(cloud_share=60))
    assert type(signals) is StepSignals and type(decision.score) is StepScore
    assert decision.latch is None
    assert decision.leg == "local"  # the state's latch is not read
    assert "trouble" not in decision.reason


def test_with_trouble_signals_on_a_failing_batch_escalates_and_latches() -> None:
    context = FusionContext(cloud_share=60, trouble_signals=True)
    decision, signals = next_route(failing_turn(), context)
    assert isinstance(signals, TroubleSignals)
    assert (signals.error_severity, signals.no_progress, signals.progress, signals.latched) == (
        1.0,
        0.0,
        False,
        None,
    )
    assert isinstance(decision.score, TroubleScore)
    assert decision.score.error_severity == 50
    assert (decision.leg, decision.latch) == ("cloud", 2)


def test_the_latch_in_state_is_what_the_next_step_finds() -> None:
    context = FusionContext(cloud_share=60, trouble_signals=True)
    decision, signals = next_route(failing_turn(latch=2, leg="cloud"), context)
    assert isinstance(signals, TroubleSignals) and signals.latched == 2 and signals.held
    assert (decision.leg, decision.latch) == ("cloud", 2)


def test_plans_never_carry_trouble_signals() -> None:
    context = FusionContext(cloud_share=60, trouble_signals=True)
    decision, signals = next_route(failing_turn(latch=2), context, plan=True)
    assert type(signals) is StepSignals and decision.latch is None


@pytest.mark.parametrize(
    "result",
    [
        pytest.param("value of a", id="a-success-after-the-errors"),
        pytest.param("============ 4 passed in 0.12s ============", id="a-passing-test-run"),
    ],
)
def test_a_progress_event_in_the_turn_releases_the_latch(result: str) -> None:
    state = failing_turn(latch=2, leg="cloud")
    call = {"name": "bash", "args": {"command": "pytest"}, "id": "t", "type": "tool_call"}
    state["messages"] = [
        *state["messages"],
        AIMessage("", tool_calls=[call]),
        ToolMessage(result, tool_call_id="t"),
    ]
    state["step"] = 2
    context = FusionContext(cloud_share=60, trouble_signals=True)
    decision, signals = next_route(state, context)
    assert isinstance(signals, TroubleSignals) and signals.progress and not signals.held
    assert decision.latch is None
    assert "progress event: latch from step 2 released" in decision.reason
    # Without the event the same turn stays latched.
    held = failing_turn(latch=2, leg="cloud")
    failed = ToolMessage("Error: still failing", tool_call_id="t", status="error")
    held["messages"] = [*held["messages"], AIMessage("", tool_calls=[call]), failed]
    assert next_route(held, context)[0].latch == 2
