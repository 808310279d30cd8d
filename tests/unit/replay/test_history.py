"""Replaying a finished conversation routes every step exactly as the graph did."""

from __future__ import annotations

import dataclasses

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

from fusion_graph import build_graph
from fusion_graph.context import FusionContext
from fusion_graph.replay.history import route_history
from fusion_graph.run_queue import FusionGraph
from tests.plugins.fakes import ScriptedModel, ai_calls, call, scripted, user_input


@tool
def bulky(n: int) -> str:
    """Return ``n`` lines of output."""
    return "output line\n" * n


async def test_replay_matches_the_graphs_route_log() -> None:
    # Local keeps producing bulky output until the score escalates to cloud, which finishes.
    cloud = scripted("cloudfake", [ai_calls(call("bulky", {"n": 5}, "c1")), "done"])
    local = scripted("localfake", [ai_calls(call("bulky", {"n": 150}, f"l{i}")) for i in range(5)])
    context = FusionContext(cloud_share=60, conversation_max_tokens=2048, max_steps=6)
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[bulky])
    out = await graph.ainvoke(user_input("work"), context=context)
    recorded = [(r["step"], r["leg"], r["score"], r["threshold"]) for r in out["route_log"]]
    route = [leg for _, leg, _, _ in recorded]
    assert route[0] == route[-1] == "cloud" and route[1] == "local", route  # escalated after local steps

    history = [SystemMessage(context.system_prompt), *out["messages"]]
    replayed = [
        (r.step, r.leg, r.decision.score.score if r.decision.score else None, r.decision.threshold)
        for r in route_history(history, context, tools=[bulky])  # the graph counts bound tool schemas
    ]
    assert replayed == recorded


def test_replay_restarts_the_step_count_at_each_user_message() -> None:
    messages = [
        HumanMessage("first"),
        AIMessage("", tool_calls=[{"name": "t", "args": {}, "id": "a", "type": "tool_call"}]),
        ToolMessage("x", tool_call_id="a"),
        AIMessage("answer"),
        HumanMessage("second"),
        AIMessage("answer 2"),
    ]
    steps = route_history(messages, FusionContext(cloud_share=30))
    assert [(s.position, s.step, s.leg) for s in steps] == [(1, 0, "cloud"), (3, 1, "local"), (5, 0, "cloud")]


async def test_a_paced_replay_counts_the_route_log_as_the_graph_does() -> None:
    # Each leg answers three tool calls, then "done": the turn ends on the first leg to run out.
    def leg_model(leg: str) -> ScriptedModel:
        return scripted(leg, [*(ai_calls(call("bulky", {"n": 1}, f"{leg}{i}")) for i in range(3)), "done"])

    def make_graph() -> FusionGraph:
        return build_graph(cloud_model=leg_model("cloud"), local_model=leg_model("local"), tools=[bulky])

    paced = FusionContext(cloud_share=50, pace_slack=0.5, max_steps=12)
    out = await make_graph().ainvoke(user_input("work"), context=paced)
    log = out["route_log"]
    legs = [r["routed_leg"] for r in log if r["kind"] == "step"]
    for n in range(1, len(legs) + 1):  # the thread's count stays within half a step of 50 %
        assert abs(legs[:n].count("cloud") - n / 2) <= 0.5, legs
    assert any("paced to" in r["reason"] for r in log)
    plain = await make_graph().ainvoke(
        user_input("work"), context=dataclasses.replace(paced, pace_slack=None)
    )
    assert [r["routed_leg"] for r in plain["route_log"]] != [r["routed_leg"] for r in log]

    history = [SystemMessage(paced.system_prompt), *out["messages"]]
    replayed = route_history(history, paced, tools=[bulky])
    assert [(r.step, r.leg, r.decision.threshold, r.decision.reason) for r in replayed] == [
        (r["step"], r["routed_leg"], r["threshold"], r["reason"]) for r in log
    ]
