"""The trouble signals and the escalation latch in the compiled graph, under ``ainvoke`` and streaming."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, SystemMessage
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGenerationChunk
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph.agent import build_graph
from fusion_graph.context import FusionContext
from fusion_graph.replay.history import route_history
from fusion_graph.routing.score import TROUBLE_WEIGHTS, WEIGHTS
from tests.plugins.fakes import ScriptedModel, ai_calls, call
from tests.plugins.served import turn_state

#: cloud_share 60: T = 40, h = 10, so a local step escalates at 50 and a cloud one stays down to 30.
CONTEXT = FusionContext(cloud_share=60, trouble_signals=True, system_prompt="Be brief.")


class StreamedScript(ScriptedModel):
    """A ``ScriptedModel`` that also streams its answers, tool calls included (one chunk per answer).

    LangGraph's ``messages`` stream mode makes the chat model stream; the generic
    fake streams only text, which would drop the scripted tool calls.
    """

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        answer = self._generate(messages, stop=stop, **kwargs).generations[0].message
        assert isinstance(answer, AIMessage)
        chunks = [
            tool_call_chunk(name=c["name"], args=json.dumps(c["args"]), id=c["id"], index=i)
            for i, c in enumerate(answer.tool_calls)
        ]
        chunk = AIMessageChunk(content=answer.content, tool_call_chunks=chunks, chunk_position="last")
        if run_manager is not None:
            run_manager.on_llm_new_token(str(answer.content), chunk=ChatGenerationChunk(message=chunk))
        yield ChatGenerationChunk(message=chunk)


def scripted(name: str, answers: Sequence[AIMessage | str]) -> StreamedScript:
    """A streaming scripted model called ``name`` answering ``answers`` in order."""
    return StreamedScript(messages=iter(list(answers)), model_name=name)


@tool
def lookup(key: str) -> str:
    """Look a key up; keys starting with ``bad`` do not exist."""
    if key.startswith("bad"):
        raise ValueError(f"no such key {key}")
    return f"value of {key}"


def models() -> tuple[StreamedScript, StreamedScript]:
    """Local fails twice in one batch; cloud fails once more, then succeeds until it hands back."""
    cloud = scripted(
        "cloudfake",
        [
            ai_calls(call("lookup", {"key": "a"}, "p1")),  # the plan
            ai_calls(call("lookup", {"key": "bad3"}, "c1")),  # still failing: the latch holds
            ai_calls(call("lookup", {"key": "b"}, "c2")),  # a success: progress, released
            ai_calls(call("lookup", {"key": "c"}, "c3")),
            ai_calls(call("lookup", {"key": "d"}, "c4")),
        ],
    )
    local = scripted(
        "localfake",
        [
            ai_calls(call("lookup", {"key": "bad1"}, "l1"), call("lookup", {"key": "bad2"}, "l2")),
            "done",
        ],
    )
    return cloud, local


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_failing_tools_latch_the_turn_on_cloud_until_a_success_then_hysteresis_brings_it_back(
    how: str,
) -> None:
    cloud, local = models()
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[lookup], checkpointer=InMemorySaver())
    config: RunnableConfig = {"configurable": {"thread_id": f"trouble-{how}"}}
    out = await turn_state(graph, "look things up", how, CONTEXT, config)
    log = out["route_log"]

    assert [(r["step"], r["kind"], r["leg"]) for r in log] == [
        (0, "plan", "cloud"),
        (1, "step", "local"),
        (2, "step", "cloud"),  # two errors: severity 1, +50 points: escalated for trouble, latched
        (3, "step", "cloud"),  # another error, no progress event: held by the latch
        (4, "step", "cloud"),  # a success after the errors releases it; the band keeps it on cloud
        (5, "step", "cloud"),
        (6, "step", "local"),  # the errors have faded below the stay-on-cloud bar: back to local
    ]
    assert out["messages"][-1].content == "done"
    steps = log[1:]
    # Every continuation record carries the trouble terms, the signals and the latch it found.
    assert all(set(r["breakdown"]) == set(WEIGHTS) | set(TROUBLE_WEIGHTS) for r in steps)
    assert [r["breakdown"]["error_severity"] for r in steps] == [0.0, 50.0, 50.0, 25.0, 12.5, 6.25]
    assert [r["signals"]["latched"] for r in steps] == [None, None, 2, 2, None, None]
    assert [r["signals"]["progress"] for r in steps] == [False, False, False, True, False, False]
    assert "latched on cloud until a progress event" in log[2]["reason"]
    assert "trouble 50 (error severity 1 × 50 = 50, no progress 0 × 30 = 0)" in log[2]["reason"]
    assert "latched on cloud since step 2: no progress event yet" in log[3]["reason"]
    assert "progress event: latch from step 2 released" in log[4]["reason"]
    assert "stay on cloud" in log[4]["reason"] and "back to local" in log[6]["reason"]
    # The latch is state the graph checkpoints between steps.
    latches = [snapshot.values.get("latch") async for snapshot in graph.aget_state_history(config)]
    assert 2 in latches and out["latch"] is None

    # Replay rebuilds the latch from the messages alone and routes every step as the graph did.
    history = [SystemMessage(CONTEXT.system_prompt), *out["messages"]]
    replayed = route_history(history, CONTEXT, tools=[lookup])
    assert [(s.step, s.leg, s.decision.reason, vars(s.signals)) for s in replayed] == [
        (r["step"], r["routed_leg"], r["reason"], r["signals"]) for r in log
    ]


async def test_a_new_turn_starts_unlatched() -> None:
    cloud = scripted(
        "cloudfake",
        [
            ai_calls(call("lookup", {"key": "a"}, "p1")),
            ai_calls(call("lookup", {"key": "bad3"}, "c1")),  # held on cloud: the turn ends latched
            "given up",
            "second plan answer",
        ],
    )
    local = scripted(
        "localfake",
        [ai_calls(call("lookup", {"key": "bad1"}, "l1"), call("lookup", {"key": "bad2"}, "l2"))],
    )
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[lookup], checkpointer=InMemorySaver())
    config: RunnableConfig = {"configurable": {"thread_id": "two-turns"}}
    first = await turn_state(graph, "look things up", "ainvoke", CONTEXT, config)
    assert first["latch"] == 2
    second = await turn_state(graph, "look things up", "ainvoke", CONTEXT, config)
    assert second["latch"] is None
    assert [r["kind"] for r in second["route_log"]][-1] == "plan"


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_with_trouble_signals_off_records_and_state_are_the_seed_rules(how: str) -> None:
    cloud, local = models()
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[lookup], checkpointer=InMemorySaver())
    config: RunnableConfig = {"configurable": {"thread_id": f"plain-{how}"}}
    out = await turn_state(
        graph, "look things up", how, FusionContext(cloud_share=60, system_prompt="Be brief."), config
    )

    assert [(r["kind"], r["leg"]) for r in out["route_log"]] == [
        ("plan", "cloud"),
        ("step", "local"),
        ("step", "local"),  # the failures do not move it: the four terms alone stay low
    ]
    assert all(set(r["breakdown"]) == set(WEIGHTS) for r in out["route_log"])
    assert all("latched" not in r["signals"] and "trouble" not in r["reason"] for r in out["route_log"])
    assert "latch" not in out
