"""The fit rule in the graph, with scripted models and windows set by the operator (no server).

The real-server counterparts are in ``tests/integration/test_long_runs.py``; here each path is
pinned down exactly: escalation, compaction, the walk after an overflow, the
budget check and the tool-output cap with parallel calls.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionContext, build_graph
from fusion_graph.errors import ContextError
from fusion_graph.settings import FusionSettings
from fusion_graph.sizing.compaction import PLACEHOLDER
from fusion_graph.sizing.turn import CUT_KEY
from tests.plugins.errors import llama_overflow
from tests.plugins.fakes import ScriptedModel, ai_calls, call, scripted, user_input

NO_MEMORY = FusionContext(sub_runners="off")


@tool
def dump(lines: int) -> str:
    """Return ``lines`` lines of a log."""
    return "".join(f"{i:06d} GET /api/items?page={i % 97} 200 {i % 13}ms\n" for i in range(lines))


def steps(out: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in out["route_log"] if r["kind"] == "step"]


async def test_a_step_the_local_window_cannot_hold_runs_on_cloud_and_says_why() -> None:
    cloud = scripted("cloudfake", [ai_calls(call("dump", {"lines": 400}, "c1")), "done on cloud"])
    local = scripted("localfake", [])
    graph = build_graph(
        cloud_model=cloud, local_model=local, tools=[dump], settings=FusionSettings(local_window_tokens=2048)
    )
    out = await graph.ainvoke(
        user_input("read the log"), context=FusionContext(max_completion_tokens=512, sub_runners="off")
    )

    (step,) = steps(out)
    assert (step["routed_leg"], step["leg"], step["attempts"]) == ("local", "cloud", [])
    assert step["reason"].endswith("+ 512 > local window 2,048: escalated to cloud")
    assert step["sizing"]["fit"] in step["reason"] and step["sizing"]["window"] == 128_000
    assert local.prompts == [], "nothing was sent to the window that could not hold it"
    # Pressure is measured against the usable local window: this step fills it.
    assert step["signals"]["conversation_max_tokens"] == 2048 - 512
    assert step["breakdown"]["context_pressure"] == 40


async def test_when_no_window_holds_the_step_the_oldest_output_is_cleared_and_the_turn_goes_on() -> None:
    cloud = scripted("cloudfake", [ai_calls(call("dump", {"lines": 60}, "c1"))])
    local = scripted("localfake", [ai_calls(call("dump", {"lines": 60}, "l1")), "done"])
    graph = build_graph(
        cloud_model=cloud,
        local_model=local,
        tools=[dump],
        checkpointer=InMemorySaver(),
        settings=FusionSettings(local_window_tokens=3072, cloud_window_tokens=3072),
    )
    config: RunnableConfig = {"configurable": {"thread_id": "t"}}
    events = [
        e
        async for e in graph.astream(
            user_input("read twice"),
            config,
            context=FusionContext(max_completion_tokens=1024, sub_runners="off"),
            stream_mode="custom",
        )
    ]
    out = (await graph.aget_state(config)).values

    first, second = steps(out)
    assert "compaction" not in first["sizing"]
    assert second["sizing"]["compaction"]["cleared_tool_outputs"] == 1
    assert "(the largest window): compacted; fits after compaction" in second["reason"]
    assert [e["phase"] for e in events if e.get("event") == "fusion_route"].count("compaction") == 1
    outputs = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert outputs[0].content == PLACEHOLDER and "000059 GET" in str(outputs[1].content)
    sent = local.prompts[-1]
    assert [m.content == PLACEHOLDER for m in sent if isinstance(m, ToolMessage)] == [True, False]
    assert out["messages"][-1].content == "done"
    assert out["anchors"] == {}, "compaction voids every anchor (these fakes report no tokens)"


class Overflowing(ScriptedModel):
    """A local model whose server refuses every request as too large for its slot."""

    async def _agenerate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        self.prompts.append(list(messages))
        raise llama_overflow()


async def test_an_overflow_the_estimate_missed_walks_on_to_a_larger_window() -> None:
    cloud = scripted("cloudfake", [ai_calls(call("dump", {"lines": 1}, "c1")), "done on cloud"])
    local = Overflowing(messages=iter([]), model_name="localfake")
    graph = build_graph(
        cloud_model=cloud, local_model=local, tools=[dump], settings=FusionSettings(local_window_tokens=2048)
    )
    out = await graph.ainvoke(user_input("go"), context=NO_MEMORY)

    (step,) = steps(out)
    assert (step["routed_leg"], step["leg"]) == ("local", "cloud")
    [attempt] = step["attempts"]
    assert (attempt["kind"], attempt["health_failure"], attempt["prompt_tokens"]) == (
        "context_overflow",
        False,
        4019,
    )
    assert out["messages"][-1].content == "done on cloud"


async def test_when_every_window_overflows_the_history_is_compacted_and_the_step_retried() -> None:
    cloud = scripted("cloudfake", [ai_calls(call("dump", {"lines": 30}, "c1"))])
    local = Overflowing(messages=iter([]), model_name="localfake")
    answers = iter([AIMessage("done after compaction")])

    class Cloud(ScriptedModel):
        """Overflows once (its window is smaller than it says), then answers."""

        async def _agenerate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
            if not self.prompts:
                self.prompts.append(list(messages))
                return await cloud._agenerate(messages, *args, **kwargs)
            self.prompts.append(list(messages))
            if len(self.prompts) == 2:
                raise llama_overflow()
            return ChatResult(generations=[ChatGeneration(message=next(answers))])

    both = Cloud(messages=iter([]), model_name="cloudfake")
    graph = build_graph(
        cloud_model=both,
        local_model=local,
        tools=[dump],
        settings=FusionSettings(local_window_tokens=2048, cloud_window_tokens=4096),
    )
    out = await graph.ainvoke(user_input("go"), context=NO_MEMORY)

    (step,) = steps(out)
    assert step["leg"] == "cloud"
    assert step["sizing"]["compaction"]["times"] == 1
    assert "every window overflowed" in step["reason"]
    assert [m.content for m in both.prompts[-1] if isinstance(m, ToolMessage)] == [PLACEHOLDER]
    assert out["messages"][-1].content == "done after compaction"


async def test_an_explicit_budget_the_local_window_cannot_hold_is_refused_before_any_call() -> None:
    cloud, local = scripted("cloudfake", ["never"]), scripted("localfake", [])
    graph = build_graph(
        cloud_model=cloud, local_model=local, tools=[], settings=FusionSettings(local_window_tokens=2048)
    )
    with pytest.raises(
        ContextError, match=r"conversation_max_tokens 32,768 .* 2,048 - completion budget 1,024"
    ):
        await graph.ainvoke(
            user_input("go"), context=FusionContext(conversation_max_tokens=32768, sub_runners="off")
        )
    assert cloud.prompts == [] and local.prompts == []


async def test_every_inference_asks_for_at_most_the_completion_budget() -> None:
    cloud = scripted("cloudfake", [ai_calls(call("dump", {"lines": 1}, "c1"))])
    local = scripted("localfake", ["done"])
    graph = build_graph(
        cloud_model=cloud, local_model=local, tools=[dump], settings=FusionSettings(local_window_tokens=1024)
    )
    await graph.ainvoke(
        user_input("go"), context=FusionContext(max_completion_tokens=2000, sub_runners="off")
    )
    assert cloud.call_kwargs[0]["max_tokens"] == 2000
    assert local.call_kwargs[0]["max_tokens"] == 512, "at most half the local window"


async def test_parallel_long_results_are_each_cut_and_raise_the_notice_once() -> None:
    batch = ai_calls(call("dump", {"lines": 3000}, "c1"), call("dump", {"lines": 2000}, "c2"))
    cloud = scripted("cloudfake", [batch])
    local = scripted("localfake", ["done"])
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[dump])
    out = await graph.ainvoke(
        user_input("go"), context=FusionContext(max_tool_output_tokens=500, sub_runners="off")
    )

    outputs = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert [m.response_metadata[CUT_KEY]["limit"] for m in outputs] == [500, 500]
    assert all("tokens cut here" in str(m.content) for m in outputs)
    (step,) = steps(out)
    assert step["breakdown"]["transient_notice"] == 20
    assert out["notice"] is False, "the cut is marked on the results, not written by parallel tasks"
