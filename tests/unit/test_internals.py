"""Pins the LangGraph internals ``fusion_graph.internals`` relies on, against the installed langgraph."""

from __future__ import annotations

import operator
from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any

import pytest
from langchain_core.callbacks import AsyncCallbackHandler
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.config import get_config
from langgraph.graph import END, START, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.runtime import Runtime
from langgraph.types import Send
from typing_extensions import TypedDict

from fusion_graph import build_graph, internals
from fusion_graph.errors import StateError
from fusion_graph.run_queue import FusionGraph


class _State(TypedDict):
    seen: Annotated[list[bool], operator.add]


def test_the_resuming_key_is_langgraphs_own() -> None:
    from langgraph._internal import _constants

    assert internals.RESUMING_KEY == _constants.CONFIG_KEY_RESUMING


async def test_is_resuming_tells_a_fresh_run_from_a_resume() -> None:
    calls: list[bool] = []

    async def flaky(state: _State) -> dict[str, Any]:
        calls.append(internals.is_resuming(get_config()))
        if len(calls) == 1:
            raise RuntimeError("first run fails")
        return {"seen": [calls[-1]]}

    builder = StateGraph(_State)
    builder.add_node("flaky", flaky)
    builder.add_edge(START, "flaky")
    builder.add_edge("flaky", END)
    graph = builder.compile(checkpointer=InMemorySaver())
    config: Any = {"configurable": {"thread_id": "t"}}
    with pytest.raises(RuntimeError, match="first run fails"):
        await graph.ainvoke({"seen": []}, config)
    out = await graph.ainvoke(None, config)
    assert calls == [False, True]
    assert out["seen"] == [True]


def test_compile_builds_exactly_a_compiled_state_graph() -> None:
    builder = StateGraph(_State)
    builder.add_node("n", lambda state: {"seen": [True]})
    builder.add_edge(START, "n")
    assert type(builder.compile()) is CompiledStateGraph


async def test_a_reclassed_graph_runs_ainvoke_through_its_own_astream() -> None:
    streamed: list[Any] = []

    class Counting(CompiledStateGraph[Any, Any, Any, Any]):
        async def astream(self, input: Any, config: Any = None, **kwargs: Any) -> AsyncIterator[Any]:
            streamed.append(input)
            async for chunk in super().astream(input, config, **kwargs):
                yield chunk

    builder = StateGraph(_State)
    builder.add_node("n", lambda state: {"seen": [True]})
    builder.add_edge(START, "n")
    graph = internals.reclass(builder.compile(), Counting)
    out = await graph.ainvoke({"seen": []})
    assert out == {"seen": [True]} and len(streamed) == 1


def test_reclass_refuses_anything_but_a_compiled_state_graph() -> None:
    graph = build_graph(cloud_model=None, local_model=None)
    with pytest.raises(TypeError, match="expected a CompiledStateGraph"):
        internals.reclass(graph, FusionGraph)  # already re-classed
    assert isinstance(graph, FusionGraph) and graph.memory_runs is not None


def test_a_copy_of_the_graph_keeps_its_class_and_memory_runs() -> None:
    graph = build_graph(cloud_model=None, local_model=None)
    copied = graph.copy({"name": "served"})  # what the LangGraph server does with a served graph
    assert type(copied) is FusionGraph and copied.memory_runs is graph.memory_runs
    assert graph.with_config({"tags": ["x"]}).memory_runs is graph.memory_runs


async def test_an_untraced_edge_gets_the_runtime_and_config_and_opens_no_run() -> None:
    seen: list[Any] = []

    async def edge(state: _State, runtime: Runtime[Any], config: RunnableConfig) -> str:
        seen.append((runtime.context, config["configurable"]["thread_id"]))
        return END

    class Runs(AsyncCallbackHandler):
        def __init__(self) -> None:
            self.names: list[str] = []

        async def on_chain_start(self, serialized: Any, inputs: Any, **kwargs: Any) -> None:
            self.names.append(str(kwargs.get("name")))

    async def node(state: _State) -> dict[str, Any]:
        return {"seen": [True]}

    builder: Any = StateGraph(_State, context_schema=dict)  # any context: the edge reads it back
    builder.add_node("n", node)
    builder.add_edge(START, "n")
    builder.add_conditional_edges("n", internals.untraced_edge(edge), [END])
    runs = Runs()
    config: Any = {"configurable": {"thread_id": "t"}, "callbacks": [runs]}
    await builder.compile().ainvoke({"seen": []}, config, context={"k": 1})
    assert seen == [({"k": 1}, "t")]
    assert "edge" not in runs.names and "n" in runs.names  # the node's run is there, the edge's is not


async def test_a_node_reached_by_send_reads_the_state_an_edge_would_give_it() -> None:
    read: list[Any] = []

    async def first(state: _State) -> dict[str, Any]:
        return {"seen": [True]}

    async def sent(state: Mapping[str, Any]) -> dict[str, Any]:
        read.append((state, internals.node_state(get_config())))
        return {"seen": [False]}

    async def send(state: _State) -> Send:
        return Send("sent", {"payload": 1})

    builder = StateGraph(_State)
    builder.add_node("first", first)
    builder.add_node("sent", sent, input_schema=_State)
    builder.add_edge(START, "first")
    builder.add_conditional_edges("first", send, ["sent"])
    builder.add_edge("sent", END)
    out = await builder.compile().ainvoke({"seen": []})
    assert read == [({"payload": 1}, {"seen": [True]})]  # the payload as input, the state as of its step
    assert out["seen"] == [True, False]
    with pytest.raises(StateError, match="inside a graph run"):
        internals.node_state({"configurable": {}})
