"""Cloud re-synthesis of a turn's final reply when the local leg wrote it (``resynthesize``)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage

from fusion_graph import FusionContext
from fusion_graph.nodes.synthesis import SYNTHESIS_MESSAGE_NAME
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input
from tests.plugins.served import graph_over


def plan_then(*after: Reply) -> list[Reply]:
    """Cloud plans with one tool call (the reply then comes from local), then answers ``after``."""
    return [Reply(content="plan", tool_calls=[("lookup", {"key": "a"})], prompt_tokens=250), *after]


async def run(
    cloud: FakeOpenAI, local: FakeOpenAI, how: str, **context: Any
) -> tuple[dict[str, Any], list[Any]]:
    graph = graph_over(cloud, local)
    config: Any = {"configurable": {"thread_id": "t"}}
    ctx = FusionContext(resynthesize="local_replies", max_completion_tokens=16, **context)
    streamed: list[Any] = []
    if how == "ainvoke":
        await graph.ainvoke(user_input("look up a"), config, context=ctx)
    else:
        async for chunk, meta in graph.astream(
            user_input("look up a"), config, context=ctx, stream_mode="messages"
        ):
            streamed.append((chunk, meta))
    return dict((await graph.aget_state(config)).values), streamed


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_a_local_reply_is_rewritten_by_cloud_and_the_draft_is_kept_in_the_record(how: str) -> None:
    with (
        FakeOpenAI(plan_then(Reply(content="cloud final"))) as cloud,
        FakeOpenAI([Reply(content="local draft")]) as local,
    ):
        state, streamed = await run(cloud, local, how)
    final = state["messages"][-1]
    assert isinstance(final, AIMessage) and final.content == "cloud final"
    assert [m.content for m in state["messages"] if isinstance(m, AIMessage)] == ["plan", "cloud final"]
    step, synthesis = state["route_log"][-2:]
    assert (step["kind"], step["leg"]) == ("step", "local")
    assert (synthesis["kind"], synthesis["leg"], synthesis["routed_leg"]) == ("synthesis", "cloud", "cloud")
    assert synthesis["synthesis"]["draft"] == "local draft" and synthesis["synthesis"]["draft_id"] == final.id
    assert synthesis["cost_usd"] is not None and synthesis["cost_usd"] > 0
    assert state["totals"]["cost_usd"] == pytest.approx(sum(r["cost_usd"] or 0 for r in state["route_log"]))
    assert state["leg"] == "local"  # the turn's leg (hysteresis) is left as the local step set it
    sent = cloud.requests[-1]["messages"]
    assert sent[-1]["role"] == "user" and sent[-1].get("name") == SYNTHESIS_MESSAGE_NAME
    assert all(m.get("content") != "local draft" for m in sent)  # the draft is not shown to cloud
    assert all(getattr(m, "name", None) != SYNTHESIS_MESSAGE_NAME for m in state["messages"])
    if how == "messages":  # the re-write streams from its own node
        assert any(meta["langgraph_node"] == "synthesis" and chunk.content for chunk, meta in streamed)


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_with_cloud_down_the_local_reply_stands_and_the_record_says_why(how: str) -> None:
    with (
        FakeOpenAI(plan_then(Reply(status=503))) as cloud,
        FakeOpenAI([Reply(content="local draft")]) as local,
    ):
        state, _ = await run(cloud, local, how)
    assert state["messages"][-1].content == "local draft"
    synthesis = state["route_log"][-1]
    assert synthesis["kind"] == "synthesis" and synthesis["provider"] is None
    assert synthesis["synthesis"]["skipped"].startswith("cloud is down, the local reply stands")
    assert [a["kind"] for a in synthesis["attempts"]] == ["server_error"]
    assert len(local.requests) == 1  # never re-written on local


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_over_budget_the_rewrite_is_skipped_with_the_numbers(how: str) -> None:
    with (
        FakeOpenAI(plan_then(Reply(content="cloud final"))) as cloud,
        FakeOpenAI([Reply(content="local draft")]) as local,
    ):
        state, _ = await run(cloud, local, how, turn_cloud_budget_usd=0.0026)
    assert state["messages"][-1].content == "local draft"
    assert len(cloud.requests) == 1  # the plan only
    synthesis = state["route_log"][-1]
    assert synthesis["kind"] == "synthesis" and synthesis["cost_usd"] is None
    assert synthesis["synthesis"]["skipped"].startswith("turn budget $0.0026: $0.0025 spent, step ~$")


async def test_a_turn_that_ends_on_a_cloud_reply_is_not_rewritten() -> None:
    with FakeOpenAI([Reply(content="cloud reply")]) as cloud, FakeOpenAI([Reply(content="local")]) as local:
        state, _ = await run(cloud, local, "ainvoke")
    assert [r["kind"] for r in state["route_log"]] == ["plan"]
    assert state["messages"][-1].content == "cloud reply"


async def test_mode_local_never_rewrites_on_cloud() -> None:
    with FakeOpenAI([Reply(content="cloud")]) as cloud, FakeOpenAI([Reply(content="local reply")]) as local:
        state, _ = await run(cloud, local, "ainvoke", mode="local")
    assert cloud.requests == [] and [r["kind"] for r in state["route_log"]] == ["plan"]
