"""``FusionRoutingMiddleware`` under bad input: refused before a model call, or answered so the loop goes on.

Every fault runs against a strict model that refuses, as OpenAI does with a 400,
a history holding an assistant tool call without a matching tool result, then a
second turn on the same thread that must succeed: a fault may end a run, never
leave the thread unusable.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import ToolRetryMiddleware
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, InvalidToolCall, ToolMessage
from langchain_core.messages.tool import invalid_tool_call
from langchain_core.outputs import ChatResult
from langchain_core.tools import BaseTool, tool
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from pydantic import Field

from fusion_graph import FusionContext, FusionSettings, make_workspace_tools
from fusion_graph.errors import ContextError
from fusion_graph.middleware import FusionRoutingMiddleware
from fusion_graph.middleware.fusion_routing import unanswered_malformed_calls
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import ScriptedModel, ai_calls, call, turn_state

CONTEXT = FusionContext(sub_runners="off", loop_repeat_limit=100)
HOW = ["ainvoke", "messages"]
MALFORMED = '{"text": "a"'


def unanswered_ids(messages: list[BaseMessage]) -> list[str | None]:
    """The ids of assistant tool calls (valid or not) that no tool message right after answers."""
    missing: list[str | None] = []
    for index, message in enumerate(messages):
        if not isinstance(message, AIMessage):
            continue
        answered = set()
        for later in messages[index + 1 :]:
            if not isinstance(later, ToolMessage):
                break
            answered.add(later.tool_call_id)
        calls = [c.get("id") for c in message.tool_calls] + [c.get("id") for c in message.invalid_tool_calls]
        missing += [i for i in calls if i is None or i not in answered]
    return missing


class UnansweredToolCall(ValueError):
    """What OpenAI answers with a 400 when a tool call in the history has no result."""


class StrictModel(ScriptedModel):
    """A scripted model that refuses a history with an unanswered tool call, as OpenAI does."""

    refused: list[list[str | None]] = Field(default_factory=list)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> ChatResult:
        missing = unanswered_ids(messages)
        if missing:
            self.refused.append(missing)
            raise UnansweredToolCall(
                f"400: an assistant message with 'tool_calls' must be followed by tool messages "
                f"responding to each 'tool_call_id'; missing {missing}"
            )
        return super()._generate(messages, stop=stop, run_manager=run_manager, **kwargs)


def strict(*answers: AIMessage | str) -> StrictModel:
    """One strict model for both legs (not streamed: the fake streams no tool calls)."""
    script: Iterator[AIMessage | str] = iter(answers)
    return StrictModel(messages=script, model_name="strict", disable_streaming=True)


def agent_on(model: Any, tools: list[BaseTool], settings: FusionSettings | None = None, *others: Any) -> Any:
    """A ``create_agent`` agent whose every model call the middleware routes, on a checkpointer."""
    middleware = FusionRoutingMiddleware(cloud_model=model, local_model=model, settings=settings)
    return create_agent(
        model=model,
        tools=tools,
        system_prompt=CONTEXT.system_prompt,
        middleware=[middleware, *others],
        context_schema=FusionContext,
        checkpointer=InMemorySaver(),
    )


async def run(agent: Any, how: str, text: str, context: Any = CONTEXT) -> dict[str, Any]:
    """One turn on thread ``t``, by ``ainvoke`` or ``astream(stream_mode="messages")``; the state after."""
    return await turn_state(agent, how, text, context)


@tool
def echo(text: str) -> str:
    """Return the text."""
    return text


@tool
def broken(text: str) -> str:
    """Always fails, with an error that is no ``ToolException``."""
    raise RuntimeError(f"broken on {text}")


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize(
    ("context", "named"), [("go", "str: 'go'"), (42, "int: 42"), ([1, 2], "list: [1, 2]")]
)
async def test_a_context_that_is_no_context_is_refused_before_any_model_call(
    how: str, context: Any, named: str, tmp_path: Path
) -> None:
    (tmp_path / "a.txt").write_text("contents of a\n")
    model = strict(ai_calls(call("read_file", {"path": "a.txt"}, "r1")), "second answer")
    agent = agent_on(model, make_workspace_tools(tmp_path))  # the tools read the run's context too
    with pytest.raises(
        ContextError, match=f"the run context must be an object of run settings.*got {re.escape(named)}"
    ):
        await run(agent, how, "first", context=context)
    assert model.prompts == []  # refused before any (paid) model call, not by the tool after one
    state = await run(agent, how, "second")
    assert model.refused == []
    [read] = [m for m in state["messages"] if isinstance(m, ToolMessage)]
    assert read.status == "success" and "contents of a" in str(read.content)
    assert state["messages"][-1].content == "second answer"
    assert [r["turn"] for r in state["route_log"]] == [1, 1]  # only the second turn asked a model


@pytest.mark.parametrize("how", HOW)
async def test_a_workspace_root_through_a_symlink_out_of_the_workspace_is_refused_before_any_model_call(
    how: str, tmp_path: Path
) -> None:
    workspace, outside = tmp_path / "workspace", tmp_path / "outside"
    workspace.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text("not for the model\n")
    (workspace / "out").symlink_to(outside, target_is_directory=True)
    settings = FusionSettings(workspace_root=str(workspace))
    model = strict(ai_calls(call("list_dir", {"path": "."}, "l1")), "second answer")
    agent = agent_on(model, make_workspace_tools(settings=settings), settings)
    with pytest.raises(ContextError, match="'out' is a symlink"):
        await run(agent, how, "first", context={"sub_runners": "off", "workspace_root": "out"})
    assert model.prompts == []
    state = await run(agent, how, "second")
    assert model.refused == []
    [listing] = [m for m in state["messages"] if isinstance(m, ToolMessage)]
    assert listing.status == "success" and "out@" in str(listing.content)  # the operator's root, listed
    assert state["messages"][-1].content == "second answer"


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize(
    ("name", "args", "error"),
    [
        ("read_file", {"path": "missing.txt"}, "'missing.txt' is not a file in the workspace"),
        ("broken", {"text": "a"}, "RuntimeError('broken on a')"),
    ],
)
async def test_a_failing_tool_is_answered_with_an_error_and_the_loop_goes_on(
    how: str, name: str, args: dict[str, Any], error: str, tmp_path: Path
) -> None:
    model = strict(ai_calls(call(name, args, "c1")), "first answer", "second answer")
    agent = agent_on(model, [*make_workspace_tools(tmp_path), broken])
    first = await run(agent, how, "first")
    [reply] = [m for m in first["messages"] if isinstance(m, ToolMessage)]
    assert (reply.tool_call_id, reply.name, reply.status) == ("c1", name, "error")
    assert error in str(reply.content)
    assert first["messages"][-1].content == "first answer"  # the model read the error and answered
    second = await run(agent, how, "second")
    assert model.refused == []
    assert second["messages"][-1].content == "second answer"


@pytest.mark.parametrize("how", HOW)
async def test_tool_retries_listed_after_the_middleware_run_inside_it(how: str) -> None:
    attempts: list[str] = []

    @tool
    def flaky(text: str) -> str:
        """Fails on every try."""
        attempts.append(text)
        raise ValueError("still down")

    model = strict(ai_calls(call("flaky", {"text": "a"}, "f1")), "first answer")
    retries = ToolRetryMiddleware(max_retries=2, initial_delay=0.0, jitter=False, on_failure="error")
    state = await run(agent_on(model, [flaky], None, retries), how, "first")
    assert attempts == ["a", "a", "a"]  # retried inside; the last failure answered by the middleware
    [reply] = [m for m in state["messages"] if isinstance(m, ToolMessage)]
    assert reply.status == "error" and "still down" in str(reply.content)
    assert model.refused == [] and state["messages"][-1].content == "first answer"


def malformed(call_id: str | None) -> InvalidToolCall:
    """A call whose arguments are broken JSON, as langchain-core parses one."""
    return invalid_tool_call(name="echo", args=MALFORMED, id=call_id, error="Expecting ',' delimiter")


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize(
    ("answer", "ran"),
    [
        (AIMessage(content="", invalid_tool_calls=[malformed("bad1")]), []),
        (
            AIMessage(
                content="",
                tool_calls=[call("echo", {"text": "b"}, "ok1")],
                invalid_tool_calls=[malformed("bad1")],
            ),
            ["ok1"],
        ),
        (AIMessage(content="", invalid_tool_calls=[malformed(None)]), []),
    ],
    ids=["alone", "beside-a-valid-call", "without-an-id"],
)
async def test_a_call_with_broken_json_is_answered_and_the_loop_goes_on(
    how: str, answer: AIMessage, ran: list[str]
) -> None:
    answer = answer.model_copy(deep=True)  # the parameter is shared by both ways of running
    model = strict(answer, ai_calls(call("echo", {"text": "a"}, "fixed")), "first answer", "second answer")
    agent = agent_on(model, [echo])
    first = await run(agent, how, "first")
    [asked] = [m for m in first["messages"] if isinstance(m, AIMessage) and m.invalid_tool_calls]
    [bad_id] = [c["id"] for c in asked.invalid_tool_calls]
    assert bad_id  # a call without an id got one, so it can be answered
    replies = {m.tool_call_id: m for m in first["messages"] if isinstance(m, ToolMessage)}
    bad = replies[bad_id]
    assert bad.status == "error" and bad.name == "echo"
    assert "Malformed tool call 'echo'" in str(bad.content) and repr(MALFORMED) in str(bad.content)
    assert [i for i in ran if replies[i].status == "success"] == ran  # a valid call beside it ran
    assert replies["fixed"].content == "a"  # the model sent the call again, and it ran
    assert first["messages"][-1].content == "first answer"
    assert [r["step"] for r in first["route_log"]] == [0, 1, 2]  # every model call routed and recorded
    second = await run(agent, how, "second")
    assert model.refused == []
    assert second["messages"][-1].content == "second answer"


def test_only_the_last_answer_s_unanswered_malformed_calls_are_owed() -> None:
    bad = AIMessage(content="", invalid_tool_calls=[malformed("bad1")], id="a1")
    owed = unanswered_malformed_calls([HumanMessage("x"), bad])
    assert owed is not None and not owed.renamed and [m.tool_call_id for m in owed.replies] == ["bad1"]
    answered = ToolMessage(content="e", tool_call_id="bad1", status="error")
    assert unanswered_malformed_calls([HumanMessage("x"), bad, answered]) is None
    assert unanswered_malformed_calls([bad, HumanMessage("y")]) is None  # an older turn's answer
    assert unanswered_malformed_calls([HumanMessage("x"), AIMessage("fine")]) is None


def openai_strict(script: list[Reply], refused: list[list[str]]) -> Any:
    """A FakeOpenAI reply function: a 400 for a history with an unanswered tool call, else the script."""
    replies = iter(script)

    def reply(body: dict[str, Any]) -> Reply:
        messages = body["messages"]
        missing: list[str] = []
        for index, message in enumerate(messages):
            ids = [c["id"] for c in message.get("tool_calls") or []]
            following = set()
            for later in messages[index + 1 :]:
                if later["role"] != "tool":
                    break
                following.add(later["tool_call_id"])
            missing += [i for i in ids if i not in following]
        if missing:
            refused.append(missing)
            return Reply(status=400)
        return next(replies)

    return reply


@pytest.mark.parametrize("how", HOW)
async def test_a_missing_file_against_an_openai_endpoint_that_refuses_unanswered_calls(
    how: str, tmp_path: Path
) -> None:
    refused: list[list[str]] = []
    script = [
        Reply(content="", tool_calls=[("read_file", {"path": "missing.txt"})]),
        Reply(content="first answer"),
        Reply(content="second answer"),
    ]
    with FakeOpenAI(openai_strict(script, refused)) as server:
        model = ChatOpenAI(model="c", base_url=server.base_url, api_key="x", max_retries=0)
        agent = agent_on(model, make_workspace_tools(tmp_path))
        context = FusionContext(mode="cloud", sub_runners="off")
        first = await run(agent, how, "first", context=context)
        second = await run(agent, how, "second", context=context)
        sent = [json.dumps(body["messages"]) for body in server.requests]
    assert refused == []
    assert first["messages"][-1].content == "first answer"
    assert second["messages"][-1].content == "second answer"
    assert "is not a file in the workspace" in sent[1]  # the model was told what failed
