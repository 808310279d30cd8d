"""``ChatOpenAI`` for the graph's own providers, with tool-call arguments made repairable.

langchain-openai builds an ``AIMessage`` straight from the response; a tool
call whose arguments are JSON but not an object (``[1, 2]``, ``"hi"``) makes
that fail with a validation error, so one bad call would end the turn. Here
such calls become ``invalid_tool_calls`` instead, which the tool batch check
sends to ``repair`` on the same leg like any malformed call.
"""

from __future__ import annotations

import json
from typing import Any

import openai
from langchain_core.messages import AIMessage, InvalidToolCall
from langchain_core.messages.tool import invalid_tool_call
from langchain_core.outputs import ChatResult
from langchain_openai import ChatOpenAI


def _non_object(arguments: Any) -> str | None:
    """Why ``arguments`` (a JSON string) is not an object, or ``None`` when it is (or is not JSON)."""
    if not isinstance(arguments, str) or not arguments.strip():
        return None
    try:
        value = json.loads(arguments)
    except ValueError:
        return None  # not JSON at all: langchain-openai already reports it as invalid
    if value is None or isinstance(value, dict):
        return None
    return f"arguments must be a JSON object, got {type(value).__name__}"


def split_non_object_calls(response: dict[str, Any]) -> dict[int, list[InvalidToolCall]]:
    """Remove, in place, tool calls whose arguments are not an object; return them by choice index."""
    removed: dict[int, list[InvalidToolCall]] = {}
    for index, choice in enumerate(response.get("choices") or []):
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict) or not isinstance(message.get("tool_calls"), list):
            continue
        calls: list[Any] = message["tool_calls"]
        kept = []
        for raw in calls:
            function = raw.get("function") or {} if isinstance(raw, dict) else {}
            why = _non_object(function.get("arguments"))
            if why is None:
                kept.append(raw)
                continue
            removed.setdefault(index, []).append(
                invalid_tool_call(
                    name=function.get("name"), args=function.get("arguments"), id=raw.get("id"), error=why
                )
            )
        message["tool_calls"] = kept or None
    return removed


class ChatOpenAICompatible(ChatOpenAI):
    """``ChatOpenAI`` whose non-object tool arguments become ``invalid_tool_calls``."""

    def _create_chat_result(
        self, response: dict[str, Any] | openai.BaseModel, generation_info: dict[str, Any] | None = None
    ) -> ChatResult:
        data = response.model_dump() if isinstance(response, openai.BaseModel) else response
        removed = split_non_object_calls(data) if isinstance(data, dict) else {}
        result = super()._create_chat_result(data if removed else response, generation_info)
        for index, calls in removed.items():
            message = result.generations[index].message if index < len(result.generations) else None
            if isinstance(message, AIMessage):
                message.invalid_tool_calls = [*message.invalid_tool_calls, *calls]
        return result
