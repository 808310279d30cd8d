"""Scripted chat models and graph inputs for unit tests (no network)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.outputs import ChatResult
from pydantic import Field

from fusion_graph.settings import OPERATOR_FIELDS, FusionSettings
from fusion_graph.state import InputState


class ScriptedModel(GenericFakeChatModel):
    """Replays scripted answers and remembers every prompt it was sent.

    ``bind_tools`` returns the model itself so the graph can bind tools to it.
    """

    name: str | None = "scripted"
    model_name: str = "scripted"
    prompts: list[list[BaseMessage]] = Field(default_factory=list)
    call_kwargs: list[dict[str, Any]] = Field(default_factory=list)

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> BaseChatModel:
        """Tools are accepted and ignored: the script decides the calls."""
        return self

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> ChatResult:
        self.prompts.append(list(messages))
        self.call_kwargs.append(dict(kwargs))
        return super()._generate(messages, stop=stop, run_manager=run_manager, **kwargs)


def scripted(name: str, answers: Sequence[AIMessage | str]) -> ScriptedModel:
    """A scripted model called ``name`` answering ``answers`` in order."""
    iterator: Iterator[AIMessage | str] = iter(list(answers))
    return ScriptedModel(messages=iterator, model_name=name)


def call(name: str, args: dict[str, Any], call_id: str) -> dict[str, Any]:
    """A tool call dict for an ``AIMessage``."""
    return {"name": name, "args": args, "id": call_id, "type": "tool_call"}


def ai_calls(*calls: dict[str, Any], content: str = "") -> AIMessage:
    """An answer carrying the given tool calls."""
    return AIMessage(content=content, tool_calls=list(calls))


def user_input(text: str) -> InputState:
    """Graph input of one user message (what ``("user", text)`` would become)."""
    return {"messages": [HumanMessage(text)]}


def check_two_turns(out: dict[str, Any]) -> None:
    """A two-turn thread: plan and one local step per turn, turn index 0 then 1."""
    assert [(r["turn"], r["step"], r["kind"]) for r in out["route_log"]] == [
        (0, 0, "plan"),
        (0, 1, "step"),
        (1, 0, "plan"),
        (1, 1, "step"),
    ]
    assert out["turn"] == 1
    assert [m.content for m in out["messages"] if isinstance(m, AIMessage)][-1] == "second answer"
    # The same call in the previous turn does not count towards this turn's loop detector.
    assert all(r["breakdown"]["transient_notice"] == 0 for r in out["route_log"])


def split_config(**values: Any) -> tuple[FusionSettings, dict[str, Any]]:
    """Operator settings and a run context from one flat mapping of field values.

    ``cloud_model`` and ``workspace_root`` go to the operator settings (a run may only narrow them).
    """
    operator = {k: v for k, v in values.items() if k in OPERATOR_FIELDS}
    run = {k: v for k, v in values.items() if k not in OPERATOR_FIELDS}
    return FusionSettings(**operator), run


async def turn_state(agent: Any, how: str, text: str, context: Any) -> dict[str, Any]:
    """One turn on thread ``t``, by ``ainvoke`` or ``astream(stream_mode="messages")``; the state after."""
    config: Any = {"configurable": {"thread_id": "t"}}
    if how == "ainvoke":
        await agent.ainvoke({"messages": [HumanMessage(text)]}, config, context=context)
    else:
        async for _ in agent.astream(
            {"messages": [HumanMessage(text)]}, config, context=context, stream_mode="messages"
        ):
            pass
    return dict((await agent.aget_state(config)).values)
