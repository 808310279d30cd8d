"""Replaying a finished conversation routes every step exactly as the graph did."""

from __future__ import annotations

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

from fusion_graph import build_graph
from fusion_graph.context import FusionContext
from fusion_graph.replay import route_history
from tests.fakes import ai_calls, call, scripted, user_input


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
    assert [leg for _, leg, _, _ in recorded] == ["cloud", "local", "local", "local", "cloud"]

    history = [SystemMessage(context.system_prompt), *out["messages"]]
    replayed = [
        (r.step, r.leg, r.decision.score.score if r.decision.score else None, r.decision.threshold)
        for r in route_history(history, context)
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
