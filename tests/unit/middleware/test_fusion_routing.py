"""``FusionRoutingMiddleware`` through ``create_agent`` itself: the graph's decisions, records, fallover."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import (
    AgentMiddleware,
    ModelCallLimitMiddleware,
    SummarizationMiddleware,
    ToolRetryMiddleware,
)
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionContext, FusionSettings, build_graph
from fusion_graph.middleware import FusionRoutingMiddleware
from fusion_graph.middleware.fusion_routing import turn_and_step
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import ScriptedModel, ai_calls, call, turn_state, user_input

FIELDS = ("turn", "step", "kind", "routed_leg", "leg", "score", "threshold", "reason")
CONTEXT = FusionContext(
    cloud_share=85, sub_runners="off", loop_repeat_limit=100, conversation_max_tokens=6000
)


@tool
def echo(text: str, times: int = 1) -> str:
    """Return the text ``times`` times."""
    return " ".join([text] * times)


def script() -> list[AIMessage | str]:
    """A plan, four steps whose tool output grows, and a reply."""
    return [
        ai_calls(call("echo", {"text": "plan", "times": 1}, "p")),
        *(ai_calls(call("echo", {"text": f"w{i}", "times": 60 * i}, f"s{i}")) for i in range(1, 5)),
        "done",
    ]


def shared() -> tuple[ScriptedModel, ScriptedModel]:
    """A cloud and a local model answering from one script, whichever leg a step goes to."""
    answers: Iterator[AIMessage | str] = iter(script())
    return scripted_on(answers, "cloud"), scripted_on(answers, "local")


def scripted_on(answers: Iterator[AIMessage | str], name: str) -> ScriptedModel:
    """A scripted model on a shared script; not streamed (the fake streams no tool calls)."""
    return ScriptedModel(messages=answers, model_name=name, disable_streaming=True)


def agent_with(middleware: FusionRoutingMiddleware, model: Any, *others: Any) -> Any:
    return create_agent(
        model=model,
        tools=[echo],
        system_prompt=CONTEXT.system_prompt,
        middleware=[*others, middleware],
        context_schema=FusionContext,
        checkpointer=InMemorySaver(),
    )


async def run(agent: Any, how: str, text: str = "go", context: Any = CONTEXT) -> dict[str, Any]:
    return await turn_state(agent, how, text, context)


def test_turn_and_step_count_the_turn_s_model_calls() -> None:
    messages = [
        HumanMessage("a"),
        AIMessage("x"),
        HumanMessage("b"),
        AIMessage("", tool_calls=[]),
        AIMessage("y"),
    ]
    assert turn_and_step(messages[:1]) == (0, 0)
    assert turn_and_step(messages[:3]) == (1, 0)
    assert turn_and_step(messages) == (1, 2)


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_the_route_log_equals_the_graph_s_on_the_same_script(how: str) -> None:
    cloud, local = shared()
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[echo], checkpointer=InMemorySaver())
    config: Any = {"configurable": {"thread_id": "g"}}
    graph_state = await graph.ainvoke(user_input("go"), config, context=CONTEXT)
    cloud, local = shared()
    agent = agent_with(FusionRoutingMiddleware(cloud_model=cloud, local_model=local), cloud)
    state = await run(agent, how)
    expected = [{f: r[f] for f in FIELDS} for r in graph_state["route_log"]]
    assert {r["routed_leg"] for r in graph_state["route_log"]} == {
        "cloud",
        "local",
    }  # the script crosses legs
    assert [{f: r[f] for f in FIELDS} for r in state["route_log"]] == expected
    assert state["messages"][-1].content == "done"
    assert state["leg"] == graph_state["leg"]


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_a_cloud_503_falls_over_to_the_local_leg_and_is_priced_where_it_answered(how: str) -> None:
    down = Reply(status=503, content="overloaded")
    with (
        FakeOpenAI([down, down, down]) as cloud,
        FakeOpenAI(
            [Reply(content="", tool_calls=[("echo", {"text": "a"})]), Reply(content="local done")]
        ) as local,
    ):
        options: Any = {"api_key": "x", "max_retries": 0, "stream_usage": True}
        cloud_model = ChatOpenAI(model="c", base_url=cloud.base_url, **options)
        local_model = ChatLlamaServer(model="l", base_url=local.base_url, **options)
        middleware = FusionRoutingMiddleware(
            cloud_model=cloud_model,
            local_model=local_model,
            settings=FusionSettings(price_overrides={"c": (10.0, 10.0, 1.0)}, local_slots=2),
        )
        state = await run(agent_with(middleware, cloud_model), how)
        bodies = local.requests
    plan = state["route_log"][0]
    assert (plan["routed_leg"], plan["leg"], plan["provider"]) == ("cloud", "local", "local:l")
    assert [a["kind"] for a in plan["attempts"]] and plan["attempts"][0]["provider"] == "cloud:c"
    assert state["messages"][-1].content == "local done"
    # The thread's slot rides on every local request, as the graph's local steps carry it.
    slots = {body.get("id_slot") for body in bodies}
    assert len(slots) == 1 and None not in slots and all(body.get("cache_prompt") for body in bodies)
    assert (
        state["totals"]["inferences"] == len(state["route_log"]) if "inferences" in state["totals"] else True
    )


async def test_it_composes_with_summarization_call_limits_and_tool_retries() -> None:
    attempts: list[str] = []

    @tool
    def flaky(text: str) -> str:
        """Fails once, then echoes."""
        attempts.append(text)
        if len(attempts) == 1:
            raise ValueError("transient")
        return text

    answers: Iterator[AIMessage | str] = iter(
        [ai_calls(call("flaky", {"text": "a"}, "f1")), ai_calls(call("flaky", {"text": "b"}, "f2")), "never"]
    )
    cloud, local = scripted_on(answers, "cloud"), scripted_on(answers, "local")
    summarizer = scripted_on(iter(["a summary"] * 5), "summarizer")
    # One agent, LangChain's middleware and ours (their state types differ: typed loosely here).
    # Tool retries after ours: they run inside its tool hook, which answers only the last failure.
    middleware: Sequence[AgentMiddleware[Any, Any]] = (
        SummarizationMiddleware(model=summarizer, trigger=("messages", 50)),
        ModelCallLimitMiddleware(run_limit=2, exit_behavior="end"),
        FusionRoutingMiddleware(cloud_model=cloud, local_model=local),
        ToolRetryMiddleware(max_retries=2, initial_delay=0.0, jitter=False),
    )
    agent = create_agent(
        model=cloud,
        tools=[flaky],
        system_prompt=CONTEXT.system_prompt,
        middleware=middleware,
        context_schema=FusionContext,
        checkpointer=InMemorySaver(),
    )
    state = await run(agent, "ainvoke")
    assert attempts == ["a", "a", "b"]  # the first call retried by ToolRetryMiddleware
    assert [r["kind"] for r in state["route_log"]] == ["plan", "step"]  # the limit ended the run at two calls
    assert [r["step"] for r in state["route_log"]] == [0, 1]


async def test_route_events_reach_the_custom_stream() -> None:
    cloud, local = shared()
    agent = agent_with(FusionRoutingMiddleware(cloud_model=cloud, local_model=local), cloud)
    events = [
        chunk
        async for mode, chunk in agent.astream(
            {"messages": [HumanMessage("go")]},
            {"configurable": {"thread_id": "e"}},
            context=CONTEXT,
            stream_mode=["custom", "values"],
        )
        if mode == "custom"
    ]
    phases = [(e["phase"], e["kind"]) for e in events if e.get("event") == "fusion_route"]
    assert phases[:2] == [("decision", "plan"), ("outcome", "plan")]
    assert sum(1 for phase, _ in phases if phase == "outcome") == 6


@pytest.mark.parametrize(
    ("context", "message"),
    [
        ({"cloud_model": "a-model-the-operator-never-allowed"}, "is not allowed for this deployment"),
        ({"cloud_share": 150}, "must be between 0 and 100"),
        ({"workspace_root": "/etc"}, "outside the operator's workspace"),
    ],
)
async def test_a_run_context_may_narrow_the_operator_s_settings_never_widen_them(
    context: dict[str, Any], message: str
) -> None:
    from fusion_graph.errors import ContextError

    cloud, local = shared()
    agent = create_agent(
        model=cloud,
        tools=[echo],
        middleware=[FusionRoutingMiddleware(cloud_model=cloud, local_model=local)],
        checkpointer=InMemorySaver(),
    )
    with pytest.raises(ContextError, match=message):
        await agent.ainvoke(
            {"messages": [HumanMessage("go")]}, {"configurable": {"thread_id": "h"}}, context=context
        )


async def test_a_call_only_cloud_could_make_over_the_budget_ends_with_the_graph_s_reply() -> None:
    from fusion_graph import prompts

    with FakeOpenAI([Reply(content="never")]) as cloud:
        options: Any = {"api_key": "x", "max_retries": 0}
        cloud_model = ChatOpenAI(model="c", base_url=cloud.base_url, **options)
        middleware = FusionRoutingMiddleware(
            cloud_model=cloud_model,
            settings=FusionSettings(price_overrides={"c": (10.0, 10.0, 1.0)}),
            context={"mode": "cloud", "thread_cloud_budget_usd": 0.0},
        )
        state = await run(agent_with(middleware, cloud_model), "ainvoke", context=None)
        asked = cloud.requests
    [record] = state["route_log"]
    assert record["outcome"]["status"] == "over_budget" and record["provider"] is None
    assert asked == []  # no inference was made
    assert state["messages"][-1].content.startswith(prompts.OVER_BUDGET.split("{")[0])
