"""The compiled graph runs from sync code too (``invoke``, ``stream``, ``batch``), like ``create_agent``."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionContext, build_graph
from tests.plugins.fakes import ai_calls, call, scripted, user_input

CONTEXT = FusionContext(sub_runners="off")


@tool
async def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


def test_invoke_stream_and_batch_from_sync_code() -> None:
    cloud = scripted("cloud", [ai_calls(call("echo", {"text": "a"}, "1")), "plan done", "b done", "b done"])
    local = scripted("local", ["local done", "second"])
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[echo], checkpointer=InMemorySaver())
    config: Any = {"configurable": {"thread_id": "sync"}}
    out = graph.invoke(user_input("go"), config, context=CONTEXT)
    assert out["messages"][-1].content == "local done"
    updates = list(graph.stream(user_input("again"), config, context=CONTEXT, stream_mode="updates"))
    assert updates and "plan" in updates[0]
    both = graph.batch(
        [user_input("x"), user_input("y")],
        [{"configurable": {"thread_id": "b1"}}, {"configurable": {"thread_id": "b2"}}],
        context=CONTEXT,
    )
    assert len(both) == 2 and all(result["messages"][-1].content for result in both)


async def test_sync_calls_inside_an_event_loop_say_to_await_instead() -> None:
    graph = build_graph(cloud_model=scripted("c", ["x"]), local_model=scripted("l", ["x"]), tools=[])
    with pytest.raises(RuntimeError, match=r"use await graph.ainvoke"):
        graph.invoke(user_input("go"), context=CONTEXT)
