"""The routing rule after a tool batch: the edge routes a one-call batch, route joins larger ones.

A one-call batch must not pay a superstep (and a checkpoint) of its own, a
batch of parallel calls must still join before anything decides, and an
executor that finds no order kept for it (a run resumed in another process) must decide
exactly what the edge would have.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionContext, build_graph
from fusion_graph.nodes.step import StepOrders
from tests.plugins.fakes import ai_calls, call, scripted, user_input


@tool
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


def script(steps: int, calls_per_step: int = 1) -> list[Any]:
    """``steps`` answers of ``calls_per_step`` echo calls each, then a reply."""
    answers: list[Any] = [
        ai_calls(*(call("echo", {"text": f"{i}.{j}"}, f"c{i}-{j}") for j in range(calls_per_step)))
        for i in range(steps)
    ]
    return [*answers, "done"]


async def nodes_run(steps: int, calls_per_step: int) -> tuple[list[str], dict[str, Any], int]:
    """The nodes a turn ran (in order), its final state, and how many checkpoints it wrote."""
    answers = script(steps, calls_per_step)
    saver = InMemorySaver()
    graph = build_graph(
        cloud_model=scripted("cloud", answers[:1]),
        local_model=scripted("local", answers[1:]),
        tools=[echo],
        checkpointer=saver,
    )
    config: Any = {"configurable": {"thread_id": "t"}}
    context = FusionContext(sub_runners="off", loop_repeat_limit=100)
    ran: list[str] = []
    async for chunk in graph.astream(user_input("go"), config, context=context, stream_mode="updates"):
        ran.extend(chunk)
    state = await graph.aget_state(config)
    checkpoints = [c async for c in graph.aget_state_history(config)]
    return ran, dict(state.values), len(checkpoints)


async def test_a_one_call_batch_is_routed_by_the_edge_without_a_superstep_of_its_own() -> None:
    ran, state, checkpoints = await nodes_run(steps=4, calls_per_step=1)
    assert "route" not in ran
    assert ran == ["plan", "tools", "local", "tools", "local", "tools", "local", "tools", "local"]
    log = state["route_log"]
    assert [r["leg"] for r in log] == ["cloud", "local", "local", "local", "local"]
    assert all(r["score"] is not None and r["reason"] for r in log)  # each step decided and recorded
    assert "route" not in state  # the decision travels in process, never through the checkpoint
    # input, plan, then tools and an executor per step: two checkpoints a step, not three
    assert checkpoints == 2 + 2 * 4 + 1


async def test_the_tasks_of_a_larger_batch_join_at_route_before_anything_decides() -> None:
    ran, state, _ = await nodes_run(steps=2, calls_per_step=3)
    assert ran.count("route") == 2  # once per batch, after all three of its tasks
    assert ran.count("tools") == 6
    results = [m for m in state["messages"] if m.type == "tool"]
    assert len(results) == 6
    assert [r["kind"] for r in state["route_log"]] == ["plan", "step", "step"]


@pytest.mark.parametrize("calls_per_step", [1, 3])
async def test_an_executor_without_a_kept_order_decides_what_the_edge_decided(
    calls_per_step: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    handed = (await nodes_run(steps=5, calls_per_step=calls_per_step))[1]["route_log"]
    monkeypatch.setattr(StepOrders, "take", lambda self, key: None)  # a resume in another process
    again = (await nodes_run(steps=5, calls_per_step=calls_per_step))[1]["route_log"]
    fields = ("turn", "step", "kind", "leg", "routed_leg", "score", "threshold", "reason", "breakdown")
    assert [{f: r[f] for f in fields} for r in again] == [{f: r[f] for f in fields} for r in handed]
