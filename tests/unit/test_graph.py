"""The compiled graph end to end, with scripted models on both legs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
from langchain_core.callbacks import AsyncCallbackHandler
from langchain_core.messages import AIMessage, BaseMessage, SystemMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, tool
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import prompts
from fusion_graph.agent import build_graph
from fusion_graph.context import FusionContext
from fusion_graph.routing.score import Leg, Mode
from fusion_graph.sizing.turn import next_route
from fusion_graph.state import State
from tests.plugins.fakes import ScriptedModel, ai_calls, call, check_two_turns, scripted, user_input

TASK = "please do the task"
BRIEF = "Be brief."


def make_echo(seen: list[str] | None = None) -> BaseTool:
    @tool
    def echo(text: str) -> str:
        """Return the text unchanged."""
        if seen is not None:
            seen.append(text)
        return text

    return echo


def legs(out: dict[str, Any]) -> list[tuple[str, str]]:
    return [(r["kind"], r["leg"]) for r in out["route_log"]]


def system_text(prompt: Sequence[BaseMessage]) -> str:
    assert isinstance(prompt[0], SystemMessage)
    return str(prompt[0].content)


def state_before_last_inference(out: dict[str, Any], *, step: int, leg: Leg) -> State:
    """The state the routing edge saw before the final answer (for checking a premise)."""
    return {"messages": out["messages"][:-1], "step": step, "leg": leg, "notice": False}


# --------------------------------------------------------------------------- a full turn


async def test_plan_on_cloud_then_mechanical_steps_locally() -> None:
    cloud = scripted("cloudfake", [ai_calls(call("echo", {"text": "plan-output"}, "c1"), content="1. echo")])
    local = scripted("localfake", [ai_calls(call("echo", {"text": "step-output"}, "l1")), "all done"])
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[make_echo()])
    out = await graph.ainvoke(user_input(TASK))

    assert legs(out) == [("plan", "cloud"), ("step", "local"), ("step", "local")]
    assert [(r["turn"], r["step"]) for r in out["route_log"]] == [(0, 0), (0, 1), (0, 2)]
    assert [r["provider"] for r in out["route_log"]] == [
        "cloud:cloudfake",
        "local:localfake",
        "local:localfake",
    ]
    assert out["messages"][-1].content == "all done"
    assert (len(cloud.prompts), len(local.prompts)) == (1, 2)
    # The local step sees the cloud plan's tool result.
    assert isinstance(local.prompts[0][-1], ToolMessage)
    assert local.prompts[0][-1].content == "plan-output"
    step = out["route_log"][1]
    assert step["threshold"] == 60 and step["score"] is not None and step["score"] < 60
    assert "back to local" in step["reason"]


class ModelRuns(AsyncCallbackHandler):
    """The tags, metadata and name of every chat model run, as a tracer (Studio, LangSmith) sees them."""

    def __init__(self) -> None:
        self.runs: list[tuple[str | None, list[str], dict[str, Any]]] = []

    async def on_chat_model_start(
        self, serialized: dict[str, Any], messages: list[list[BaseMessage]], **kwargs: Any
    ) -> None:
        self.runs.append((kwargs.get("name"), kwargs.get("tags") or [], kwargs.get("metadata") or {}))


async def test_each_model_run_is_tagged_with_its_leg_kind_and_score_beside_the_runs_own() -> None:
    cloud = scripted("cloudfake", [ai_calls(call("echo", {"text": "a"}, "c1"))])
    local = scripted("localfake", ["done"])
    graph = build_graph(
        cloud_model=cloud, local_model=local, tools=[make_echo()], checkpointer=InMemorySaver()
    )
    seen = ModelRuns()
    config: RunnableConfig = {
        "configurable": {"thread_id": "tags"},
        "callbacks": [seen],
        "tags": ["caller-tag"],
        "metadata": {"caller": "app"},
    }
    out = await graph.ainvoke(user_input(TASK), config)
    assert [name for name, _, _ in seen.runs] == ["plan:cloud", "step:local"]
    (_, plan_tags, plan_meta), (_, step_tags, step_meta) = seen.runs
    assert {"fusion:leg=cloud", "fusion:kind=plan", "caller-tag"} <= set(plan_tags)
    assert {"fusion:leg=local", "fusion:kind=step", "caller-tag"} <= set(step_tags)
    record = out["route_log"][1]
    assert (
        step_meta["fusion_score"] == record["score"] and step_meta["fusion_threshold"] == record["threshold"]
    )
    assert (step_meta["fusion_leg"], step_meta["fusion_routed_leg"], step_meta["fusion_step"]) == (
        "local",
        "local",
        1,
    )
    assert step_meta["fusion_provider"] == "local:localfake" and plan_meta["fusion_kind"] == "plan"
    # The run's own metadata stays: the caller's, and LangGraph's node (the messages stream reads it).
    assert (step_meta["caller"], step_meta["langgraph_node"], plan_meta["langgraph_node"]) == (
        "app",
        "local",
        "plan",
    )


async def test_plan_prompt_carries_the_plan_instructions_and_a_stable_prefix() -> None:
    cloud = scripted("cloudfake", [ai_calls(call("echo", {"text": "a"}, "c1"))])
    local = scripted("localfake", [ai_calls(call("echo", {"text": "b"}, "l1")), "done"])
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[make_echo()])
    await graph.ainvoke(user_input(TASK))

    plan_prompt = cloud.prompts[0]
    assert system_text(plan_prompt) == prompts.SYSTEM_PROMPT
    assert "first state a short numbered plan" in system_text(plan_prompt)
    assert [m.type for m in plan_prompt] == ["system", "human"]
    # Every later step starts with exactly what the previous one sent (llama-server prefix cache).
    assert local.prompts[0][: len(plan_prompt)] == plan_prompt
    assert local.prompts[1][: len(local.prompts[0])] == local.prompts[0]


@pytest.mark.parametrize(("system_prompt", "types"), [(BRIEF, ["system", "human"]), ("", ["human"])])
async def test_the_context_system_prompt_is_sent(system_prompt: str, types: list[str]) -> None:
    cloud = scripted("cloudfake", ["hello"])
    graph = build_graph(cloud_model=cloud, local_model=scripted("localfake", []), tools=[])
    await graph.ainvoke(user_input(TASK), context=FusionContext(system_prompt=system_prompt))
    assert [m.type for m in cloud.prompts[0]] == types
    if system_prompt:
        assert system_text(cloud.prompts[0]) == system_prompt


# --------------------------------------------------------------------------- repairs


async def test_malformed_call_from_local_is_repaired_locally_even_when_score_says_cloud() -> None:
    cloud = scripted("cloudfake", [ai_calls(call("echo", {"text": "hi"}, "c1"))])
    local = scripted(
        "localfake",
        [ai_calls(call("echo", {"text": "x" * 4000}, "l1"), call("nope", {}, "l2")), "repaired"],
    )
    context = FusionContext(cloud_share=60, conversation_max_tokens=1024, system_prompt=BRIEF)
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[make_echo()])
    out = await graph.ainvoke(user_input(TASK), context=context)

    assert legs(out) == [("plan", "cloud"), ("step", "local"), ("repair", "local")]
    # Premise: scored normally, this step would have escalated to cloud.
    premise, _ = next_route(state_before_last_inference(out, step=1, leg="local"), context)
    assert premise.leg == "cloud"
    repair = out["route_log"][2]
    assert (repair["score"], repair["threshold"], repair["breakdown"]) == (None, None, None)
    assert "kept on the local leg" in repair["reason"]
    assert (len(cloud.prompts), len(local.prompts)) == (1, 2)
    rejected = [m for m in local.prompts[1] if isinstance(m, ToolMessage) and m.tool_call_id == "l2"]
    assert len(rejected) == 1 and "Unknown tool 'nope'" in str(rejected[0].content)


async def test_malformed_call_from_cloud_is_repaired_on_cloud_even_when_score_says_local() -> None:
    cloud = scripted("cloudfake", [ai_calls(call("nope", {}, "c1")), "repaired"])
    local = scripted("localfake", [])
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[make_echo()])
    out = await graph.ainvoke(user_input(TASK), context=FusionContext(system_prompt=BRIEF))

    assert legs(out) == [("plan", "cloud"), ("repair", "cloud")]
    premise, _ = next_route(state_before_last_inference(out, step=0, leg="cloud"), FusionContext())
    assert premise.leg == "local"
    assert "kept on the cloud leg" in out["route_log"][1]["reason"]
    assert local.prompts == []
    assert out["messages"][-1].content == "repaired"


@pytest.mark.parametrize("attempts", [0, 1])
async def test_repair_exhaustion_ends_the_turn_with_a_message(attempts: int) -> None:
    answers = [ai_calls(call("nope", {}, f"c{i}")) for i in range(attempts + 1)]
    cloud = scripted("cloudfake", [*answers, "never reached"])
    graph = build_graph(cloud_model=cloud, local_model=scripted("localfake", []), tools=[make_echo()])
    out = await graph.ainvoke(user_input(TASK), context=FusionContext(max_repair_attempts=attempts))

    assert [r["kind"] for r in out["route_log"]] == ["plan"] + ["repair"] * attempts
    assert len(cloud.prompts) == attempts + 1
    final = out["messages"][-1]
    assert isinstance(final, AIMessage) and not final.tool_calls
    assert isinstance(final.content, str)
    assert final.content.startswith(f"I could not produce a valid tool call after {attempts} repair attempts")
    assert "Unknown tool 'nope'" in final.content
    assert out["repair_error"] is None


async def test_repair_attempts_count_consecutive_failures_only() -> None:
    model = scripted(
        "any",
        [
            ai_calls(call("nope", {}, "a")),
            ai_calls(call("echo", {"text": "fixed"}, "b")),
            ai_calls(call("nope", {}, "c")),
            "done",
        ],
    )
    graph = build_graph(cloud_model=model, local_model=model, tools=[make_echo()])
    out = await graph.ainvoke(user_input(TASK), context=FusionContext(max_repair_attempts=1))
    assert [r["kind"] for r in out["route_log"]] == ["plan", "repair", "step", "repair"]
    assert out["messages"][-1].content == "done"


# --------------------------------------------------------------------------- transient notices


async def test_trimmed_batch_raises_the_notice_term_of_the_next_step_only() -> None:
    seen: list[str] = []
    model = scripted(
        "any",
        [
            ai_calls(call("echo", {"text": "a"}, "1"), call("echo", {"text": "b"}, "2")),
            ai_calls(call("echo", {"text": "c"}, "3")),
            "done",
        ],
    )
    graph = build_graph(cloud_model=model, local_model=model, tools=[make_echo(seen)])
    out = await graph.ainvoke(user_input(TASK), context=FusionContext(max_tool_calls_per_step=1))

    assert seen == ["a", "c"]
    trimmed = next(m for m in out["messages"] if isinstance(m, ToolMessage) and m.tool_call_id == "2")
    assert trimmed.content == prompts.TRIMMED.format(requested=2, limit=1)
    notices = [r["breakdown"]["transient_notice"] for r in out["route_log"]]
    assert notices == [0.0, 20.0, 0.0]
    assert [r["signals"]["transient_notice"] for r in out["route_log"]] == [False, True, False]


async def test_loop_detector_raises_the_notice_term_and_corrects_the_model() -> None:
    seen: list[str] = []
    model = scripted(
        "any",
        [
            ai_calls(call("echo", {"text": "same"}, "1")),
            ai_calls(call("echo", {"text": "same"}, "2")),
            "done",
        ],
    )
    graph = build_graph(cloud_model=model, local_model=model, tools=[make_echo(seen)])
    out = await graph.ainvoke(user_input(TASK), context=FusionContext(loop_repeat_limit=2))

    assert seen == ["same"]
    correction = next(m for m in out["messages"] if isinstance(m, ToolMessage) and m.tool_call_id == "2")
    assert isinstance(correction.content, str)
    assert correction.content.startswith("Loop detected: the call echo(")
    assert [r["breakdown"]["transient_notice"] for r in out["route_log"]] == [0.0, 0.0, 20.0]
    assert str(model.prompts[2][-1].content) == correction.content


# --------------------------------------------------------------------------- limits and modes


@pytest.mark.parametrize("max_steps", [1, 2, 3])
async def test_step_limit_ends_the_turn(max_steps: int) -> None:
    model = scripted("any", [ai_calls(call("echo", {"text": str(i)}, f"id{i}")) for i in range(10)])
    graph = build_graph(cloud_model=model, local_model=model, tools=[make_echo()])
    out = await graph.ainvoke(user_input(TASK), context=FusionContext(max_steps=max_steps))

    assert len(out["route_log"]) == max_steps
    assert len(model.prompts) == max_steps
    assert out["messages"][-1].content == prompts.STEP_LIMIT.format(max_steps=max_steps)
    assert isinstance(out["messages"][-2], ToolMessage)


@pytest.mark.parametrize(
    ("mode", "used", "unused"), [("cloud", "cloud", "local"), ("local", "local", "cloud")]
)
async def test_fixed_modes_route_every_step_to_one_model(mode: Mode, used: str, unused: str) -> None:
    fakes = {
        used: scripted(
            used, [ai_calls(call("echo", {"text": "a"}, "1")), ai_calls(call("nope", {}, "2")), "ok"]
        ),
        unused: scripted(unused, []),
    }
    graph = build_graph(cloud_model=fakes["cloud"], local_model=fakes["local"], tools=[make_echo()])
    out = await graph.ainvoke(user_input(TASK), context=FusionContext(mode=mode, conversation_max_tokens=256))

    assert legs(out) == [("plan", used), ("step", used), ("repair", used)]
    assert len(fakes[used].prompts) == 3
    assert fakes[unused].prompts == []


async def test_cloud_share_0_never_touches_cloud() -> None:
    cloud = scripted("cloudfake", [])
    local = scripted("localfake", [ai_calls(call("echo", {"text": "y" * 4000}, "1")), "done"])
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[make_echo()])
    out = await graph.ainvoke(
        user_input(TASK), context=FusionContext(cloud_share=0, conversation_max_tokens=256)
    )

    assert legs(out) == [("plan", "local"), ("step", "local")]
    # At cloud_share=60 this score would escalate (from local: T + h = 40 + 10 = 50).
    assert out["route_log"][1]["score"] >= 50
    assert cloud.prompts == []


# --------------------------------------------------------------------------- observability


async def test_custom_stream_events_carry_leg_and_score_per_inference() -> None:
    cloud = scripted("cloudfake", [ai_calls(call("echo", {"text": "a"}, "1"))])
    local = scripted("localfake", [ai_calls(call("nope", {}, "2")), "done"])
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[make_echo()])
    events: list[dict[str, Any]] = []
    final: dict[str, Any] = {}
    # With a list of modes, (v1) astream yields (mode, chunk) pairs; its signature says only Any.
    stream = cast(
        AsyncIterator[tuple[str, dict[str, Any]]],
        graph.astream(user_input(TASK), stream_mode=["custom", "values"]),
    )
    async for mode, chunk in stream:
        if mode == "custom":
            events.append(chunk)
        else:
            final = chunk

    assert [e["event"] for e in events] == ["fusion_route"] * 6
    # Each inference announces its decision before the call and its outcome after it.
    assert [e["phase"] for e in events] == ["decision", "outcome"] * 3
    decisions, outcomes = events[0::2], events[1::2]
    assert [(e["kind"], e["routed_leg"]) for e in decisions] == [
        ("plan", "cloud"),
        ("step", "local"),
        ("repair", "local"),
    ]
    assert [(e["kind"], e["leg"]) for e in outcomes] == [
        ("plan", "cloud"),
        ("step", "local"),
        ("repair", "local"),
    ]
    assert isinstance(outcomes[0]["score"], int) and isinstance(outcomes[1]["score"], int)
    assert outcomes[2]["score"] is None
    for decision, outcome in zip(decisions, outcomes, strict=True):
        assert {k: decision[k] for k in ("turn", "step", "score", "threshold", "reason")} == {
            k: outcome[k] for k in ("turn", "step", "score", "threshold", "reason")
        }
    assert [{k: v for k, v in e.items() if k not in ("event", "phase")} for e in outcomes] == final[
        "route_log"
    ]


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (
            {
                "input_tokens": 120,
                "output_tokens": 7,
                "total_tokens": 127,
                "input_token_details": {"cache_read": 96},
            },
            (120, 96, 7),
        ),
        ({"input_tokens": 50, "output_tokens": 5, "total_tokens": 55}, (50, None, 5)),
        (None, (None, None, None)),
    ],
)
async def test_token_usage_lands_in_the_route_record(
    usage: dict[str, Any] | None, expected: tuple[int | None, ...]
) -> None:
    answer = AIMessage(content="done", usage_metadata=usage)
    model = scripted("any", [answer])
    graph = build_graph(cloud_model=model, local_model=model, tools=[])
    out = await graph.ainvoke(user_input(TASK))
    (record,) = out["route_log"]
    assert (record["prompt_tokens"], record["cached_tokens"], record["completion_tokens"]) == expected
    assert record["cost_usd"] is None


# --------------------------------------------------------------------------- threads and persistence


def two_turn_models() -> tuple[ScriptedModel, ScriptedModel]:
    cloud = scripted(
        "cloudfake",
        [ai_calls(call("echo", {"text": "a"}, "t0")), ai_calls(call("echo", {"text": "a"}, "t1"))],
    )
    local = scripted("localfake", ["first answer", "second answer"])
    return cloud, local


async def test_route_log_accumulates_across_turns() -> None:
    cloud, local = two_turn_models()
    graph = build_graph(
        cloud_model=cloud, local_model=local, tools=[make_echo()], checkpointer=InMemorySaver()
    )
    config: RunnableConfig = {"configurable": {"thread_id": "t"}}
    context = FusionContext(loop_repeat_limit=2)
    first = await graph.ainvoke(user_input(TASK), config, context=context)
    assert [(r["turn"], r["step"]) for r in first["route_log"]] == [(0, 0), (0, 1)]
    second = await graph.ainvoke(user_input("again"), config, context=context)
    check_two_turns(second)
    # The second plan saw the whole first turn.
    assert any(m.content == "first answer" for m in cloud.prompts[1])


def test_default_graph_compiles_without_a_checkpointer() -> None:
    from fusion_graph.agent import graph

    assert graph.checkpointer is None
    assert graph.name == "fusion"
    assert {"plan", "local", "cloud", "tools", "repair", "step_limit", "give_up"} <= set(graph.nodes)


async def test_sqlite_checkpointer_resumes_a_thread_across_graph_instances(tmp_path: Path) -> None:
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    db = str(tmp_path / "threads.sqlite")
    config: RunnableConfig = {"configurable": {"thread_id": "persisted"}}
    context = FusionContext(loop_repeat_limit=2)
    cloud, local = two_turn_models()
    async with AsyncSqliteSaver.from_conn_string(db) as saver:
        first = build_graph(cloud_model=cloud, local_model=local, tools=[make_echo()], checkpointer=saver)
        await first.ainvoke(user_input(TASK), config, context=context)
    async with AsyncSqliteSaver.from_conn_string(db) as saver:
        second = build_graph(cloud_model=cloud, local_model=local, tools=[make_echo()], checkpointer=saver)
        out = await second.ainvoke(user_input("again"), config, context=context)
        check_two_turns(out)
        other = await second.aget_state({"configurable": {"thread_id": "someone-else"}})
        assert other.values == {}
