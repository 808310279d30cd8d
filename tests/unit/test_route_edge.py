"""The routing rule after a tool batch: the edge routes a one-call batch, route joins larger ones.

A one-call batch must not pay a superstep (and a checkpoint) of its own, a
batch of parallel calls must still join before anything decides, and the
decision reaches its executor in the step's ``Send``: a run resumed from its
checkpoint by another graph (another process) carries out the very order the
edge made, and decides nothing again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.constants import TASKS
from langgraph.types import Send

from fusion_graph import FusionContext, build_graph
from fusion_graph.errors import StateError
from fusion_graph.nodes import step as step_module
from fusion_graph.nodes.step import StepOrder, StepSizes
from fusion_graph.routing.rule import BudgetCheck
from fusion_graph.routing.score import TROUBLE_WEIGHTS, RouteDecision, TroubleSignals, score_step
from fusion_graph.sizing.turn import Estimate
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
    assert "route" not in state  # the decision travels with the step's Send, not in a state field
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
async def test_a_run_resumed_by_another_graph_carries_out_the_order_the_edge_made(
    calls_per_step: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = (await nodes_run(steps=3, calls_per_step=calls_per_step))[1]["route_log"]
    decided: list[int] = []
    decide = step_module.decide_step

    async def counted(*args: Any, **kwargs: Any) -> Any:
        order = await decide(*args, **kwargs)
        decided.append(order.step)
        return order

    monkeypatch.setattr(step_module, "decide_step", counted)
    answers = script(3, calls_per_step)
    saver = InMemorySaver()
    config: Any = {"configurable": {"thread_id": "t"}}
    context = FusionContext(sub_runners="off", loop_repeat_limit=100)
    first = build_graph(
        cloud_model=scripted("cloud", answers[:1]),
        local_model=scripted("local", []),
        tools=[echo],
        checkpointer=saver,
    )
    # Stop where the first step's executor would run, as a process that dies there would.
    await first.ainvoke(user_input("go"), config, context=context, interrupt_before=["local"])
    waiting = await first.aget_state(config)
    assert [task.name for task in waiting.tasks] == ["local"] and decided == [0, 1]
    saved = await saver.aget_tuple(config)
    assert saved is not None
    orders = [w[2].arg for w in saved.pending_writes or () if isinstance(w[2], Send)]
    orders += [s.arg for s in saved.checkpoint["channel_values"].get(TASKS, ()) if isinstance(s, Send)]
    assert len(orders) == 1 and plain(orders[0])  # the order, as plain data: no fusion class in a checkpoint
    again = build_graph(
        cloud_model=scripted("cloud", []),
        local_model=scripted("local", answers[1:]),
        tools=[echo],
        checkpointer=saver,
    )
    state = await again.ainvoke(None, config, context=context)
    assert decided == [0, 1, 2, 3]  # each step decided once: the resumed one is not decided again
    fields = ("turn", "step", "kind", "leg", "routed_leg", "score", "threshold", "reason", "breakdown")
    assert [{f: r[f] for f in fields} for r in state["route_log"]] == [
        {f: r[f] for f in fields} for r in whole
    ]


def plain(value: Any) -> bool:
    """Whether ``value`` is made only of dicts, lists, text, numbers, flags and ``None``."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(plain(v) for v in value)
    return value is None or isinstance(value, str | int | float | bool)


def test_an_order_comes_back_from_its_plain_form_whole_with_trouble_signals_and_scores() -> None:
    signals = TroubleSignals(
        prompt_tokens=900,
        conversation_max_tokens=4096,
        step=3,
        max_steps=10,
        transient_notice=True,
        tool_output_tokens=300,
        stable_prefix_tokens=200,
        error_severity=0.5,
        no_progress=0.25,
        progress=False,
        latched=2,
    )
    score = score_step(signals, TROUBLE_WEIGHTS)
    decision = RouteDecision(leg="cloud", score=score, threshold=70, reason="r", latch=2)
    sizes = StepSizes(
        windows={"cloud:x": 128000, "local:y": None},
        estimates={"cloud": Estimate(900, "anchored", 40), "local": Estimate(880, "server")},
        budget=4096,
        score_leg="local",
        key="k",
    )
    order = StepOrder("cloud", "step", 3, 1, decision, signals, sizes, BudgetCheck(True, 0.01, None, 512))
    plain = order.plain()
    back = StepOrder.of(plain)
    assert back == order
    assert type(back.signals) is TroubleSignals and type(back.decision.score) is type(score)
    assert back.decision.threshold == 70 and type(back.decision.threshold) is int  # nothing coerced
    assert back.sizes.estimates["cloud"].appended == 40  # a field equality leaves out still comes back
    with pytest.raises(StateError):
        StepOrder.of({"leg": "cloud"})


def test_an_order_part_is_plain_data_so_its_form_may_be_set_on_an_instance_directly() -> None:
    """``_built`` skips the constructor for a complete form: no part may check or derive anything."""
    for name, part in step_module.ORDER_PARTS.items():
        assert dataclasses.is_dataclass(part) and part.__dataclass_params__.frozen, name  # type: ignore[attr-defined]
        assert not hasattr(part, "__post_init__"), name
        assert all(f.init for f in dataclasses.fields(part)), name
        assert not hasattr(part, "__slots__"), name


def test_an_order_written_without_a_later_field_gets_its_default() -> None:
    """A pending ``Send`` stored before a field existed goes through the constructor: defaults filled."""
    plain = StepOrder(
        "local",
        "step",
        1,
        0,
        RouteDecision("local", None, None, "r"),
        None,
        StepSizes({}, {}, 4096, "local", "k"),
        BudgetCheck(),
    ).plain()
    del plain["shadow"], plain["prefer_provider"]
    back = StepOrder.of(plain)
    assert back.shadow is False and back.prefer_provider is None
    plain["unknown"] = 1
    with pytest.raises(TypeError):
        StepOrder.of(plain)
