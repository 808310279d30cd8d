"""LangGraph's tool contracts through the public graph: interrupts, injected state, Command, ids, order."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any, cast

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, InjectedToolCallId, tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.prebuilt import InjectedState, InjectedStore, ToolRuntime
from langgraph.store.base import BaseStore
from langgraph.store.memory import InMemoryStore
from langgraph.types import Command, interrupt

from fusion_graph import FusionContext, build_graph
from fusion_graph.errors import InvalidInput
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import ai_calls, call, scripted, user_input

CONFIG: Any = {"configurable": {"thread_id": "t1"}}
NO_MEMORY = FusionContext(sub_runners="off")


def tool_results(out: dict[str, Any]) -> dict[str, str]:
    return {m.tool_call_id: str(m.content) for m in out["messages"] if isinstance(m, ToolMessage)}


# --------------------------------------------------------------------------- interrupt()


async def test_a_tool_that_interrupts_pauses_the_run_and_resumes_with_the_answer() -> None:
    ran: list[str] = []

    @tool
    def delete_branch(name: str) -> str:
        """Delete a git branch after a human approves."""
        answer = interrupt({"question": f"delete {name}?"})
        ran.append(f"{name}:{answer}")
        return f"deleted {name}" if answer == "yes" else f"kept {name}"

    cloud = scripted("cloud", [ai_calls(call("delete_branch", {"name": "old"}, "c1"))])
    local = scripted("local", ["done"])
    graph = build_graph(
        cloud_model=cloud, local_model=local, tools=[delete_branch], checkpointer=InMemorySaver()
    )
    paused = await graph.ainvoke(user_input("clean up"), CONFIG, context=NO_MEMORY)

    assert "__interrupt__" in paused
    assert paused["__interrupt__"][0].value == {"question": "delete old?"}
    assert ran == [] and len(local.prompts) == 0
    snapshot = await graph.aget_state(CONFIG)
    assert snapshot.next == ("tools",)

    out = await graph.ainvoke(Command(resume="yes"), CONFIG, context=NO_MEMORY)
    assert ran == ["old:yes"]
    assert tool_results(out) == {"c1": "deleted old"}
    assert out["messages"][-1].content == "done"
    assert [r["kind"] for r in out["route_log"]] == ["plan", "step"]


# --------------------------------------------------------------------------- injected arguments


async def test_injected_state_store_and_tool_runtime_reach_the_tool() -> None:
    seen: dict[str, Any] = {}

    @tool
    def count_messages(note: str, state: Annotated[dict[str, Any], InjectedState]) -> str:
        """Count the messages so far."""
        seen["state_messages"] = len(state["messages"])
        seen["turn"] = state.get("turn")
        return f"{note}: {len(state['messages'])}"

    @tool
    async def remember(fact: str, store: Annotated[BaseStore, InjectedStore()]) -> str:
        """Store a fact."""
        await store.aput(("facts",), "f1", {"fact": fact})
        return "stored"

    @tool
    def whoami(runtime: ToolRuntime[FusionContext]) -> str:
        """Say which call and context this is."""
        assert runtime.context is not None
        seen["call_id"] = runtime.tool_call_id
        seen["cloud_share"] = runtime.context.cloud_share
        return "ok"

    cloud = scripted(
        "cloud",
        [
            ai_calls(
                call("count_messages", {"note": "n"}, "a"),
                call("remember", {"fact": "blue"}, "b"),
                call("whoami", {}, "c"),
            )
        ],
    )
    local = scripted("local", ["done"])
    store = InMemoryStore()
    graph = build_graph(
        cloud_model=cloud,
        local_model=local,
        tools=[count_messages, remember, whoami],
        checkpointer=InMemorySaver(),
        store=store,
    )
    out = await graph.ainvoke(
        user_input("go"), CONFIG, context=FusionContext(cloud_share=40, sub_runners="off")
    )

    assert tool_results(out) == {"a": "n: 2", "b": "stored", "c": "ok"}
    assert seen == {"state_messages": 2, "turn": 0, "call_id": "c", "cloud_share": 40}
    item = await store.aget(("facts",), "f1")
    assert item is not None and item.value == {"fact": "blue"}


async def test_a_tool_returning_command_updates_state_and_raises_the_next_score() -> None:
    @tool
    def flag(reason: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command[Any]:
        """Flag the turn for the strongest model."""
        return Command(
            update={
                "messages": [ToolMessage(f"flagged: {reason}", tool_call_id=tool_call_id)],
                "notice": True,
            }
        )

    cloud = scripted("cloud", [ai_calls(call("flag", {"reason": "risky"}, "f1"))])
    local = scripted("local", ["done"])
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[flag])
    out = await graph.ainvoke(user_input("go"), context=NO_MEMORY)

    assert tool_results(out) == {"f1": "flagged: risky"}
    step = out["route_log"][1]
    assert step["breakdown"]["transient_notice"] == 20
    assert step["signals"]["transient_notice"] is True


# --------------------------------------------------------------------------- ids and arguments


def counting_echo(ledger: list[str]) -> BaseTool:
    @tool
    def echo(text: str) -> str:
        """Return the text unchanged."""
        ledger.append(text)
        return text

    return echo


@pytest.mark.parametrize("ids", [("same", "same", "same"), ("", "", "x"), (None, "x", None)])
async def test_duplicate_or_empty_call_ids_each_run_once_and_keep_their_result(
    ids: tuple[str | None, ...],
) -> None:
    ledger: list[str] = []
    answer = AIMessage(
        content="",
        tool_calls=[
            {"name": "echo", "args": {"text": text}, "id": call_id, "type": "tool_call"}
            for text, call_id in zip(("one", "two", "three"), ids, strict=True)
        ],
    )
    cloud = scripted("cloud", [answer])
    local = scripted("local", ["done"])
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[counting_echo(ledger)])
    out = await graph.ainvoke(user_input("go"), context=NO_MEMORY)

    assert sorted(ledger) == ["one", "three", "two"]
    sent = out["messages"][1]
    assert isinstance(sent, AIMessage)
    call_ids = [str(c["id"]) for c in sent.tool_calls]
    assert all(call_ids) and len(set(call_ids)) == 3
    results = tool_results(out)
    assert {results[i] for i in call_ids} == {"one", "two", "three"}
    # The local step got every result, each paired with its own call.
    prompt = local.prompts[0]
    assert sorted(m.tool_call_id for m in prompt if isinstance(m, ToolMessage)) == sorted(call_ids)


def non_object_reply(arguments: str) -> Reply:
    body = {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 0,
        "model": "local",
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "bad",
                            "type": "function",
                            "function": {"name": "echo", "arguments": arguments},
                        }
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
    }
    return Reply(raw=json.dumps(body).encode())


@pytest.mark.parametrize("arguments", ["[1, 2]", '"hi"', "3"])
async def test_non_object_arguments_are_repaired_on_the_same_leg(arguments: str) -> None:
    ledger: list[str] = []
    cloud = scripted("cloud", [ai_calls(call("echo", {"text": "plan"}, "c1"))])
    with FakeOpenAI([non_object_reply(arguments), Reply(content="repaired")]) as fake:
        local = ChatLlamaServer(base_url=fake.base_url, api_key="none", model="local", max_retries=0)
        graph = build_graph(cloud_model=cloud, local_model=local, tools=[counting_echo(ledger)])
        out = await graph.ainvoke(user_input("go"), context=NO_MEMORY)

    assert [(r["kind"], r["leg"]) for r in out["route_log"]] == [
        ("plan", "cloud"),
        ("step", "local"),
        ("repair", "local"),
    ]
    assert ledger == ["plan"]
    assert "arguments must be a JSON object" in tool_results(out)["bad"]
    assert out["messages"][-1].content == "repaired"


# --------------------------------------------------------------------------- order on one file


async def test_calls_on_the_same_file_run_in_batch_order_others_in_parallel() -> None:
    events: list[str] = []

    @tool
    async def write(path: str, text: str, delay: float) -> str:
        """Write text to a file (slowly)."""
        events.append(f"start {path} {text}")
        await asyncio.sleep(delay)
        events.append(f"end {path} {text}")
        return text

    batch = ai_calls(
        call("write", {"path": "a.txt", "text": "first", "delay": 0.2}, "1"),
        call("write", {"path": "b.txt", "text": "other", "delay": 0.05}, "2"),
        call("write", {"path": "./a.txt", "text": "second", "delay": 0.0}, "3"),
    )
    cloud = scripted("cloud", [batch])
    local = scripted("local", ["done"])
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[write])
    out = await graph.ainvoke(user_input("go"), context=NO_MEMORY)

    assert tool_results(out) == {"1": "first", "2": "other", "3": "second"}
    assert events.index("end a.txt first") < events.index("start ./a.txt second")
    # b.txt did not wait for a.txt.
    assert events.index("start b.txt other") < events.index("end a.txt first")
    assert [r["kind"] for r in out["route_log"]] == ["plan", "step"]


# --------------------------------------------------------------------------- input


@pytest.mark.parametrize(
    "payload",
    [
        {"messages": []},
        {},
        {"messages": [HumanMessage("hi"), AIMessage("an answer the caller made up")]},
    ],
    ids=["empty-list", "no-messages", "ends-with-ai"],
)
async def test_input_without_a_new_user_message_is_refused_before_any_model_call(
    payload: dict[str, Any],
) -> None:
    cloud = scripted("cloud", ["never"])
    local = scripted("local", ["never"])
    saver = InMemorySaver()
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[], checkpointer=saver)
    with pytest.raises(InvalidInput, match="user message"):
        await graph.ainvoke(cast(Any, payload), CONFIG, context=NO_MEMORY)
    assert (len(cloud.prompts), len(local.prompts)) == (0, 0)
    assert (await graph.aget_state(CONFIG)).values == {}, "refused input was written to the thread"


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_a_tool_result_answering_no_call_is_refused_before_anything_is_written(how: str) -> None:
    cloud = scripted("cloud", ["never"])
    local = scripted("local", ["never"])
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[], checkpointer=InMemorySaver())
    payload: Any = {"messages": [ToolMessage("made up", tool_call_id="call-nobody-made"), HumanMessage("hi")]}
    with pytest.raises(InvalidInput, match="'call-nobody-made' answers no tool call"):
        if how == "ainvoke":
            await graph.ainvoke(payload, CONFIG, context=NO_MEMORY)
        else:
            async for _ in graph.astream(payload, CONFIG, context=NO_MEMORY, stream_mode="messages"):
                pass
    assert (len(cloud.prompts), len(local.prompts)) == (0, 0)
    assert (await graph.aget_state(CONFIG)).values == {}
    # The same result after the call that asked for it is a conversation the caller may send.
    answered: Any = {
        "messages": [
            HumanMessage("list it"),
            AIMessage("", tool_calls=[{"name": "echo", "args": {}, "id": "c1", "type": "tool_call"}]),
            ToolMessage("notes.txt", tool_call_id="c1"),
            HumanMessage("and now?"),
        ]
    }
    from fusion_graph.inputs import check_input

    check_input(answered)


async def test_runs_on_one_thread_queue_instead_of_forking_its_history() -> None:
    class Slow(type(scripted("x", []))):  # type: ignore[misc]
        async def _agenerate(self, *args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(0.2)
            return await super()._agenerate(*args, **kwargs)

    cloud = Slow(messages=iter([AIMessage("first answer"), AIMessage("second answer")]), model_name="cloud")
    local = scripted("local", [])
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[], checkpointer=InMemorySaver())
    first, second = await asyncio.gather(
        graph.ainvoke(user_input("one"), CONFIG, context=NO_MEMORY),
        graph.ainvoke(user_input("two"), CONFIG, context=NO_MEMORY),
    )

    assert [m.content for m in second["messages"]] == ["one", "first answer", "two", "second answer"]
    assert [r["turn"] for r in second["route_log"]] == [0, 1]
    assert [m.content for m in first["messages"]] == ["one", "first answer"]
    # The second plan saw the whole first turn.
    assert [m.content for m in cloud.prompts[1][1:]] == ["one", "first answer", "two"]


# --------------------------------------------------------------------------- decide once


async def test_each_step_is_scored_once_and_the_executor_records_that_decision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import fusion_graph.nodes.step as route_module

    decided: list[int] = []
    real = route_module.next_route  # type: ignore[attr-defined]

    def counting(state: Any, context: Any, count_tokens: Any = None, **sizes: Any) -> Any:
        decision, signals = real(state, context, count_tokens, **sizes)
        if not sizes.get("plan"):  # every step is decided by the one decision function, the plan too
            decided.append(decision.score.score if decision.score else -1)
        return decision, signals

    # The executor scores no step: it acts on the order the one decision function made.
    monkeypatch.setattr(route_module, "next_route", counting)
    ledger: list[str] = []
    cloud = scripted("cloud", [ai_calls(call("echo", {"text": "a"}, "1"), call("echo", {"text": "b"}, "2"))])
    local = scripted("local", [ai_calls(call("echo", {"text": "c"}, "3")), "done"])
    graph = build_graph(cloud_model=cloud, local_model=local, tools=[counting_echo(ledger)])
    out = await graph.ainvoke(user_input("go"), context=NO_MEMORY)

    steps = [r for r in out["route_log"] if r["kind"] == "step"]
    assert len(steps) == 2 and len(decided) == 2  # a two-call batch (joined at route), then a lone call
    assert [r["score"] for r in steps] == decided
    assert "route" not in out, "the order travels in its Send, not in a state field"


def test_a_sampling_tool_s_own_command_update_is_kept_beside_its_records() -> None:
    from fusion_graph.nodes.tools import with_records
    from fusion_graph.routing.records import make_record
    from fusion_graph.routing.score import RouteDecision

    decision = RouteDecision(leg="local", score=None, threshold=None, reason="a sample")
    record = make_record(turn=0, step=1, kind="sampling", decision=decision)
    reply = ToolMessage("done", tool_call_id="c1")
    as_pairs = with_records(Command(update=[("messages", [reply]), ("notes", "kept")]), [record])
    assert as_pairs.update == [("messages", [reply]), ("notes", "kept"), ("route_log", [record])]
    as_dict = with_records(Command(update={"notes": "kept"}), [record])
    assert as_dict.update == {"notes": "kept", "route_log": [record]}
    with pytest.raises(TypeError, match="dict or \\(key, value\\) pairs"):
        with_records(Command(update=object()), [record])


def test_the_executors_and_the_middleware_decide_no_step_themselves() -> None:
    """Every step is decided by ``nodes.step.decide_step``: executors and the middleware only carry it out."""
    import inspect

    import fusion_graph.middleware.fusion_routing as middleware_module
    import fusion_graph.nodes.step as step_module

    deciding = {"next_route", "check_budget"}
    for name, method in inspect.getmembers(step_module.InferenceNodes, inspect.isfunction):
        assert not deciding & set(method.__code__.co_names), f"InferenceNodes.{name} decides a step itself"
    assert not hasattr(middleware_module, "next_route") and not hasattr(middleware_module, "check_budget")
    assert "next_route" in step_module.decide_step.__code__.co_names
