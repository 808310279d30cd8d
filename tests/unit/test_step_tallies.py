"""Running tallies a step reads instead of walking the whole thread.

The paced dial's count of the route log is kept in state (``State.step_tally``)
and carried on from the records it covers; the token sums, the turn's start
and the loop detector's call counts of a growing history are remembered, so a
step pays for its new messages only. Each must equal a count from scratch.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import build_graph
from fusion_graph.context import FusionContext
from fusion_graph.nodes.tools import call_key, prior_call_counts
from fusion_graph.prompts import MEMORY_MESSAGE_NAME
from fusion_graph.routing.records import RouteRecord, StepKind, make_record
from fusion_graph.routing.rule import Pace
from fusion_graph.routing.score import Leg, RouteDecision
from fusion_graph.sizing.turn import approximate_tokens, message_tokens, pace_of, step_tally, turn_start
from fusion_graph.state import State, StepTally
from tests.plugins.fakes import ScriptedModel, ai_calls, call, scripted, user_input


def record(kind: StepKind, routed: Leg, answered: Leg | None = None) -> RouteRecord:
    return make_record(
        turn=0,
        step=1,
        kind=kind,
        leg=answered or routed,
        decision=RouteDecision(routed, None, None, "test"),
        signals=None,
        provider=None,
        answer=None,
    )


LOG = [
    record("plan", "cloud"),
    record("step", "local"),
    record("step", "cloud"),
    record("repair", "cloud"),  # not routed: not counted
    record("memory", "local"),
    record("step", "cloud", answered="local"),  # fell over: the router's choice counts
    record("plan", "cloud"),
    record("step", "local"),
]


def test_step_tally_counts_the_routers_continuation_steps() -> None:
    assert step_tally(LOG) == StepTally(records=8, steps=4, cloud=2)
    assert step_tally([]) == StepTally(records=0, steps=0, cloud=0)


def test_a_kept_tally_is_carried_on_from_the_records_it_covers() -> None:
    # The records a tally covers are not counted again: only those appended since.
    assert step_tally(LOG, StepTally(records=3, steps=40, cloud=10)) == StepTally(
        records=8, steps=42, cloud=11
    )
    for n in range(len(LOG) + 1):
        assert step_tally(LOG, step_tally(LOG[:n])) == step_tally(LOG)


def test_a_tally_of_more_records_than_the_log_holds_is_ignored() -> None:
    assert step_tally(LOG[:2], StepTally(records=5, steps=3, cloud=3)) == step_tally(LOG[:2])


def test_pace_of_reads_the_kept_tally_as_a_count_from_scratch() -> None:
    for n in range(len(LOG) + 1):
        state: State = {"messages": [], "route_log": LOG, "step_tally": step_tally(LOG[:n])}
        assert pace_of(state, FusionContext(pace_slack=0.5)) == Pace(0.5, steps=4, cloud=2)
    assert pace_of({"messages": [], "route_log": LOG}, FusionContext()) is None


@tool
def bulky(n: int) -> str:
    """Return ``n`` lines of output."""
    return "output line\n" * n


def leg_model(leg: str, turns: int = 2) -> ScriptedModel:
    """Per turn: three tool calls, then "done" (the turn ends on the first leg to run out)."""
    answers: list[AIMessage | str] = []
    for turn in range(turns):
        answers += [*(ai_calls(call("bulky", {"n": 1}, f"{leg}{turn}-{i}")) for i in range(3)), "done"]
    return scripted(leg, answers)


async def test_the_route_node_keeps_the_tally_of_a_paced_thread_only() -> None:
    paced = FusionContext(cloud_share=50, pace_slack=0.5, max_steps=12)
    graph = build_graph(
        cloud_model=leg_model("cloud"),
        local_model=leg_model("local"),
        tools=[bulky],
        checkpointer=InMemorySaver(),
    )
    config: RunnableConfig = {"configurable": {"thread_id": "paced"}}
    for turn in ("first", "second"):  # the second turn carries on the first turn's tally
        out = await graph.ainvoke(user_input(turn), config, context=paced)
        log, tally = out["route_log"], out["step_tally"]
        assert 0 < tally["records"] <= len(log)
        assert tally == step_tally(log[: tally["records"]])
        assert step_tally(log, tally) == step_tally(log)
    assert {r["turn"] for r in log} == {0, 1}

    plain = build_graph(cloud_model=leg_model("cloud"), local_model=leg_model("local"), tools=[bulky])
    out = await plain.ainvoke(user_input("work"), context=dataclasses.replace(paced, pace_slack=None))
    assert "step_tally" not in out


def history(steps: int) -> list[BaseMessage]:
    """Two turns, the second with recalled memories and repeated calls; ids unique to this history."""
    run = uuid.uuid4().hex  # message ids key the per-message estimates: never reuse another test's
    messages: list[BaseMessage] = [HumanMessage("earlier", id=f"{run}h0"), AIMessage("answer", id=f"{run}a0")]
    messages += [
        HumanMessage("go", id=f"{run}h1"),
        HumanMessage("recalled", name=MEMORY_MESSAGE_NAME, id=f"{run}m1"),
    ]
    for i in range(steps):
        same = i % 3 == 0  # repeated calls, for the loop detector's counts
        args = {"path": "a.txt"} if same else {"path": f"f{i}.txt", "n": i}
        messages.append(AIMessage("", tool_calls=[call("read", args, f"c{i}")], id=f"{run}a{i + 1}"))
        messages.append(ToolMessage(f"contents {i} ñ\n  indented", tool_call_id=f"c{i}", id=f"{run}t{i}"))
    return [*messages, AIMessage("done", id=f"{run}end"), HumanMessage("next", id=f"{run}h2")]


def scratch_start(messages: list[BaseMessage]) -> int:
    starts = [
        i for i, m in enumerate(messages) if isinstance(m, HumanMessage) and m.name != MEMORY_MESSAGE_NAME
    ]
    return starts[-1] if starts else 0


def scratch_counts(messages: list[BaseMessage]) -> Counter[str]:
    return Counter(
        call_key(c["name"], c["args"]) for m in messages if isinstance(m, AIMessage) for c in m.tool_calls
    )


def prefixes(messages: list[BaseMessage]) -> list[list[BaseMessage]]:
    """Every prefix growing, then shrinking, then one with a message replaced (a compaction)."""
    grown = [messages[:n] for n in range(len(messages) + 1)]
    changed = list(messages)
    changed[5] = ToolMessage("[cleared]", tool_call_id="c0", id=f"{uuid.uuid4().hex}t0")
    return [*grown, *reversed(grown), changed, messages]


def test_a_growing_history_is_summed_as_a_count_from_scratch() -> None:
    for messages in prefixes(history(12)):
        assert approximate_tokens(messages) == sum(message_tokens(m) for m in messages)
        tools = [m for m in messages if isinstance(m, ToolMessage)]
        assert approximate_tokens(tools) == sum(message_tokens(m) for m in tools)
    assert approximate_tokens(tuple(history(3))) == sum(message_tokens(m) for m in history(3))


def test_the_turn_start_of_a_growing_history_is_found_as_from_scratch() -> None:
    for messages in prefixes(history(12)):
        assert turn_start(messages) == scratch_start(messages), len(messages)


def test_the_call_counts_of_a_growing_turn_are_counted_as_from_scratch() -> None:
    turn = history(12)[3:-2]
    for messages in prefixes(turn):
        counts = prior_call_counts(messages)
        assert counts == scratch_counts(messages)
        counts["read:changed"] += 5  # the caller's copy: what is remembered does not change
    assert prior_call_counts(turn) == scratch_counts(turn)
