"""``ChatOpenAI`` for the graph's own providers, with tool-call arguments made repairable.

langchain-openai builds an ``AIMessage`` straight from the response; a tool
call whose arguments are JSON but not an object (``[1, 2]``, ``"hi"``) makes
that fail with a validation error, so one bad call would end the turn. Here
such calls become ``invalid_tool_calls`` instead, which the tool batch check
sends to ``repair`` on the same leg like any malformed call.

An answer that is not a chat completion at all (no ``choices``, a choice
without a message, tool calls whose ``function`` or ``arguments`` are not what
the API defines) raises ``errors.MalformedAnswer``: the provider's fault, so
the chain counts it against the provider's health and falls over.

Streaming (what LangGraph Studio and the server make every model do) gets the
same checks: a stream that yields no generation (a body that is not a stream
of chat-completion chunks: truncated JSON, an HTML page, empty ``choices``),
one that breaks off with a parse error, and one that ends before any
``finish_reason`` are malformed answers, never a reply. So is an answer cut at
``max_tokens`` before it said anything (``finish_reason: "length"``, no text,
no tool call), streamed or not.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
from langchain_core.messages import AIMessage, BaseMessage, InvalidToolCall
from langchain_core.messages.tool import invalid_tool_call
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_openai import ChatOpenAI
from pydantic import ValidationError

from fusion_graph.errors import MalformedAnswer


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


def _malformed_call(raw: Any) -> str | None:
    """Why a raw tool call is not one the API defines, or ``None`` when it is."""
    if not isinstance(raw, dict):
        return f"a tool call is a {type(raw).__name__}, not an object"
    function = raw.get("function")
    if not isinstance(function, dict):
        return f"a tool call's function is a {type(function).__name__}, not an object"
    arguments = function.get("arguments")
    if arguments is not None and not isinstance(arguments, str):
        return f"a tool call's arguments are a {type(arguments).__name__}, not a JSON string"
    return None


def check_completion(response: Any) -> None:
    """Raise ``MalformedAnswer`` unless ``response`` has the shape of a chat completion."""
    if not isinstance(response, dict):
        return  # langchain-openai reports other bodies itself (classed malformed_response)
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise MalformedAnswer(f"the answer has no choices (choices={choices!r:.80})")
    for choice in choices:
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            raise MalformedAnswer(f"a choice has no message object ({choice!r:.120})")
        calls = message.get("tool_calls")
        if calls is None:
            continue
        if not isinstance(calls, list):
            raise MalformedAnswer(f"tool_calls is a {type(calls).__name__}, not a list")
        why = next((w for w in map(_malformed_call, calls) if w is not None), None)
        if why is not None:
            raise MalformedAnswer(why)


def check_not_empty_cut(message: BaseMessage, finish_reason: object) -> None:
    """Raise ``MalformedAnswer`` for an answer cut at ``max_tokens`` before it said anything."""
    if finish_reason != "length" or not isinstance(message, AIMessage):
        return
    if (
        message.text.strip()
        or message.tool_calls
        or message.invalid_tool_calls
        or getattr(message, "tool_call_chunks", None)
    ):
        return
    raise MalformedAnswer("the answer was cut at max_tokens (finish_reason 'length') before any content")


def _finish_reason(chunk: ChatGenerationChunk) -> object:
    info = chunk.generation_info or {}
    return info.get("finish_reason") or chunk.message.response_metadata.get("finish_reason")


class ChatOpenAICompatible(ChatOpenAI):
    """``ChatOpenAI`` whose non-object tool arguments become ``invalid_tool_calls``.

    An answer that is not a chat completion raises ``MalformedAnswer`` (see the module docstring).
    """

    def _create_chat_result(
        self, response: dict[str, Any] | openai.BaseModel, generation_info: dict[str, Any] | None = None
    ) -> ChatResult:
        data = response.model_dump() if isinstance(response, openai.BaseModel) else response
        check_completion(data)
        removed = split_non_object_calls(data) if isinstance(data, dict) else {}
        result = super()._create_chat_result(data if removed else response, generation_info)
        for index, calls in removed.items():
            message = result.generations[index].message if index < len(result.generations) else None
            if isinstance(message, AIMessage):
                message.invalid_tool_calls = [*message.invalid_tool_calls, *calls]
        for generation in result.generations:
            info = generation.generation_info or {}
            check_not_empty_cut(generation.message, info.get("finish_reason"))
        return result

    async def _astream(self, *args: Any, **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        """The parent's stream, checked: it must yield an answer and end with a finish reason."""
        total: ChatGenerationChunk | None = None
        finish: object = None
        stream = super()._astream(*args, **kwargs)
        try:
            async for chunk in stream:
                total = chunk if total is None else total + chunk
                finish = _finish_reason(chunk) or finish
                yield chunk
        except (KeyError, IndexError, TypeError, AttributeError, ValidationError) as error:
            raise MalformedAnswer(
                f"the stream broke off with an unreadable chunk ({error!r:.160})"
            ) from error
        if total is None:
            raise MalformedAnswer("the stream carried no answer (not a stream of chat-completion chunks)")
        if finish is None:
            raise MalformedAnswer("the stream ended before a finish_reason: the answer is incomplete")
        check_not_empty_cut(total.message, finish)
