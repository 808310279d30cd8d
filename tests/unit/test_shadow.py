"""Shadow checks: the cloud asked beside a share of local steps, and records of whether it acted alike."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionContext, FusionSettings, build_graph
from fusion_graph.cli.agreement import agreement
from fusion_graph.nodes.shadow import picked
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph.routing.records import same_action
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input
from tests.plugins.served import PRICES, graph_over, lookup, turn_state

#: Every continuation step local (the plan on cloud), each local step checked by the cloud.
SHADOWED = FusionContext(cloud_share=10, shadow_share=1.0, sub_runners="off")


def call(name: str, **args: Any) -> dict[str, Any]:
    return {"name": name, "args": args, "id": f"{name}-{sorted(args.items())}", "type": "tool_call"}


def test_a_share_of_steps_is_picked_the_same_way_in_every_process() -> None:
    chosen = [picked("t", 0, step, 0.25) for step in range(400)]
    assert chosen == [picked("t", 0, step, 0.25) for step in range(400)]
    assert 60 < sum(chosen) < 140
    assert not any(picked("t", 0, step, 0.0) for step in range(50))
    assert all(picked("t", 0, step, 1.0) for step in range(50))


def test_the_same_action_is_the_same_calls_with_equal_arguments_or_both_a_reply() -> None:
    reply, other_reply = AIMessage("yes"), AIMessage("a different text")
    a = AIMessage("", tool_calls=[call("lookup", key="x"), call("lookup", key="y")])
    b = AIMessage("", tool_calls=[call("lookup", key="y"), call("lookup", key="x")])
    c = AIMessage("", tool_calls=[call("lookup", key="z")])
    assert same_action(reply, other_reply) and same_action(a, b)
    assert not same_action(a, c) and not same_action(reply, a)


async def turn(graph: Any, text: str, how: str, context: FusionContext = SHADOWED) -> dict[str, Any]:
    """``turn_state`` with shadow checks on by default."""
    return await turn_state(graph, text, how, context)


def tool_results(body: dict[str, Any]) -> int:
    return sum(1 for m in body["messages"] if m.get("role") == "tool")


def shadows(state: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in state["route_log"] if r["kind"] == "shadow"]


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_the_records_say_exactly_where_the_cloud_would_have_acted_otherwise(how: str) -> None:
    def cloud_reply(body: dict[str, Any]) -> Reply:
        done = tool_results(body)
        if done == 0:  # a plan: one lookup
            return Reply(content="", tool_calls=[("lookup", {"key": "a"})])
        if done == 1:  # the shadow of local step 1: the same lookup the local leg makes
            return Reply(content="", tool_calls=[("lookup", {"key": "b"})])
        return Reply(content="", tool_calls=[("lookup", {"key": "c"})])  # step 2: cloud would look again

    def local_reply(body: dict[str, Any]) -> Reply:
        if tool_results(body) == 1:
            return Reply(content="", tool_calls=[("lookup", {"key": "b"})])
        return Reply(content="the answer")

    with FakeOpenAI(cloud_reply) as cloud, FakeOpenAI(local_reply) as local:
        graph = graph_over(cloud, local)
        first = await turn(graph, "look it up", how)
        await turn(graph, "thanks", how)  # its plan folds what was still in flight
        state = await turn(graph, "bye", how)
    steps = [
        (r["kind"], r["step"], r["leg"]) for r in first["route_log"] if r["turn"] == 0 and r["kind"] == "step"
    ]
    assert steps == [("step", 1, "local"), ("step", 2, "local")]
    checked = {r["shadow"]["of_step"]: r for r in shadows(state) if r["turn"] == 0}
    assert set(checked) == {1, 2}
    assert checked[1]["shadow"]["agrees"] is True
    assert checked[2]["shadow"]["agrees"] is False
    assert checked[2]["shadow"]["local_action"] == {"reply": True}
    assert checked[2]["shadow"]["cloud_action"] == {"tools": [["lookup", '{"key": "c"}']]}
    for record in checked.values():
        assert (record["leg"], record["provider"]) == ("cloud", "cloud:c")
        assert record["cost_usd"] is not None and record["shadow"]["cost_usd"] == record["cost_usd"]
    assert state["totals"]["cost_usd"] >= sum(r["cost_usd"] for r in shadows(state))  # counted in spend
    summary = agreement(state["route_log"])
    assert summary["checked"] >= 2 and summary["agree"] < summary["checked"]


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_a_slow_shadow_never_holds_its_step_up(how: str) -> None:
    held = threading.Event()

    def cloud_reply(body: dict[str, Any]) -> Reply:
        if tool_results(body) == 0:
            return Reply(content="", tool_calls=[("lookup", {"key": "a"})])
        return Reply(content="cloud's answer", hold=held)  # the shadow waits as long as the test likes

    with FakeOpenAI(cloud_reply) as cloud, FakeOpenAI([Reply(content="local answer")]) as local:
        graph = graph_over(cloud, local)
        try:
            first = await turn(graph, "look it up", how)
            assert first["messages"][-1].content == "local answer"  # the turn ended, the shadow still held
            assert len(cloud.requests) == 2 and not shadows(first)
        finally:
            held.set()
        for _ in range(50):  # the shadow's answer arrives
            state = await turn(graph, "again", how, FusionContext(cloud_share=10, sub_runners="off"))
            if shadows(state):
                break
    [shadow] = [r for r in shadows(state) if r["turn"] == 0]
    assert shadow["shadow"]["agrees"] is True


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_over_the_cloud_budget_no_shadow_call_is_made(how: str) -> None:
    with FakeOpenAI([Reply(content="cloud")]) as cloud, FakeOpenAI([Reply(content="local answer")]) as local:
        graph = graph_over(cloud, local, thread_cloud_budget_usd=0.0)
        state = await turn(graph, "hello", how)
    assert cloud.requests == [] and not shadows(state)
    assert [r["leg"] for r in state["route_log"]] == ["local"]


async def test_report_shows_agreement_by_score_band(tmp_path: Any) -> None:
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    from fusion_graph.cli.app import app
    from tests.unit.cli.test_traces import runner

    def cloud_reply(body: dict[str, Any]) -> Reply:
        if tool_results(body) == 0:
            return Reply(content="", tool_calls=[("lookup", {"key": "a"})])
        return Reply(content="cloud's different answer", tool_calls=[("lookup", {"key": "z"})])

    db = tmp_path / "threads.sqlite"
    with FakeOpenAI(cloud_reply) as cloud, FakeOpenAI([Reply(content="local answer")]) as local:
        async with AsyncSqliteSaver.from_conn_string(str(db)) as saver:
            graph = build_graph(
                cloud_model=ChatOpenAI(model="c", base_url=cloud.base_url, api_key="x", max_retries=0),
                local_model=ChatLlamaServer(model="l", base_url=local.base_url, api_key="x", max_retries=0),
                tools=[lookup],
                checkpointer=saver,
                settings=FusionSettings(price_overrides=PRICES, local_slots=2),
            )
            config: Any = {"configurable": {"thread_id": "t"}}
            for text in ("look it up", "and again", "bye"):
                await graph.ainvoke(user_input(text), config, context=SHADOWED)
    as_json = runner.invoke(app, ["report", "--db", str(db), "--json"])
    assert as_json.exit_code == 0, as_json.output
    shadow = json.loads(as_json.stdout)["shadow"]
    assert shadow["checked"] >= 1 and shadow["agree"] == 0  # the cloud never did what the local leg did
    assert all(band["agree_fraction"] == 0 for band in shadow["bands"].values())
    table = runner.invoke(app, ["report", "--db", str(db)], env={"COLUMNS": "80"})
    assert "shadow checks" in table.stdout and f" {shadow['checked']} " in table.stdout


async def test_a_finished_shadow_of_a_step_that_did_not_answer_locally_is_forgotten() -> None:
    from fusion_graph.nodes.shadow import ShadowChecks
    from fusion_graph.providers.chain import ProviderChain
    from fusion_graph.providers.models import Provider
    from fusion_graph.providers.placement import FixedPlacement
    from fusion_graph.providers.pricing import FREE, Pricing
    from fusion_graph.routing.rule import UNLIMITED
    from tests.plugins.fakes import ScriptedModel

    cloud = Provider(
        "cloud:c", "cloud", ScriptedModel(messages=iter([AIMessage("cloud")])), Pricing.flat(FREE)
    )
    checks = ShadowChecks()
    started = checks.start(
        thread_id="t",
        turn=0,
        step=1,
        score=None,
        prompt=[HumanMessage("hi")],
        tools=[],
        chain=ProviderChain([cloud]),
        placer=FixedPlacement(),
        check=UNLIMITED,
        timeout_s=None,
        max_tokens=16,
    )
    assert started
    [pending] = checks.pending["t"]
    await pending.task  # the cloud answered before the step's own outcome was known
    checks.answered("t", 0, 1, None)  # the step fell over: nothing to compare it with
    assert checks.fold("t") == [] and not checks.pending.get("t")


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_a_shadow_that_finishes_after_its_turn_is_recorded_once_by_the_next_turn_in_another_worker(
    how: str,
) -> None:
    """Two graphs share the checkpointer and the store, as two workers of a deployment do."""
    from langgraph.store.memory import InMemoryStore

    from fusion_graph.nodes.shadow import written

    held = threading.Event()

    def cloud_reply(body: dict[str, Any]) -> Reply:
        if tool_results(body) == 0:
            return Reply(content="", tool_calls=[("lookup", {"key": "a"})], prompt_tokens=200)
        return Reply(content="cloud's answer", hold=held, prompt_tokens=300)  # the shadow of step 1

    saver, store = InMemorySaver(), InMemoryStore()
    context = FusionContext(cloud_share=10, shadow_share=1.0, sub_runners="off")
    quiet = FusionContext(cloud_share=10, sub_runners="off")
    with FakeOpenAI(cloud_reply) as cloud, FakeOpenAI(lambda body: Reply(content="local answer")) as local:
        first_worker = graph_over(cloud, local, saver=saver, store=store)
        second_worker = graph_over(cloud, local, saver=saver, store=store)
        first = await turn(first_worker, "look it up", how, context)
        assert not shadows(first)  # the turn ended with its shadow still waiting for the cloud
        held.set()
        for _ in range(100):  # the shadow's answer arrives in the first worker and is written
            await asyncio.sleep(0.05)
            await written()
            if await store.asearch(("fusion_shadows",), limit=10):
                break
        second = await turn(second_worker, "and now?", how, quiet)  # the next turn, in the other worker
        third = await turn(first_worker, "bye", how, quiet)  # back in the first: nothing twice
    recorded = [r for r in shadows(third) if r["turn"] == 0]
    assert len(recorded) == 1 and recorded[0]["turn"] == 0
    assert [r["shadow"]["key"] for r in shadows(second)] == [recorded[0]["shadow"]["key"]]
    assert recorded[0]["cost_usd"] is not None and recorded[0]["cost_usd"] > 0
    spent = sum(r["cost_usd"] or 0.0 for r in third["route_log"])
    assert third["totals"]["cost_usd"] == pytest.approx(spent)  # its cost in the thread's spend, once
    assert await store.asearch(("fusion_shadows",), limit=10) == []  # recorded: gone from the store
