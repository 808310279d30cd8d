"""Scripted chat models for unit tests (no network)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatResult
from pydantic import Field


class ScriptedModel(GenericFakeChatModel):
    """Replays scripted answers and remembers every prompt it was sent.

    ``bind_tools`` returns the model itself so the graph can bind tools to it.
    """

    name: str | None = "scripted"
    model_name: str = "scripted"
    prompts: list[list[BaseMessage]] = Field(default_factory=list)
    call_kwargs: list[dict[str, Any]] = Field(default_factory=list)

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> BaseChatModel:  # type: ignore[override]
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
