"""A real llama-server chat model whose answers' tool calls are scripted afterwards, and a request recorder.

A random-weight model never decides to call a tool, so tests keep the real
request (prefill, slot, cache numbers) and script only what the answer asks for.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatResult
from pydantic import Field

from fusion_graph.providers.llama_server import ChatLlamaServer

Script = list[list[tuple[str, dict[str, Any]]]]


class Recorder:
    """Captures every request body an httpx client sends."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, request: httpx.Request) -> None:
        if request.method == "POST" and request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.content))

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(event_hooks={"request": [self]}, timeout=120)


class ScriptedLlama(ChatLlamaServer):
    """A real llama-server call whose answer's tool calls are then set from a script."""

    script: list[list[tuple[str, dict[str, Any]]]] = Field(default_factory=list)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: Any = None,
        **kwargs: Any,
    ) -> ChatResult:
        result = await super()._agenerate(messages, stop=stop, run_manager=run_manager, **kwargs)
        if "response_format" in kwargs or "response_format" in (kwargs.get("extra_body") or {}):
            return result  # structured (memory) jobs keep the real, grammar-constrained answer
        calls = self.script.pop(0) if self.script else []
        real = result.generations[0].message
        assert isinstance(real, AIMessage)
        result.generations[0].message = AIMessage(
            content="" if calls else "done",
            tool_calls=[
                {"name": n, "args": a, "id": f"call_{len(messages)}_{i}", "type": "tool_call"}
                for i, (n, a) in enumerate(calls)
            ],
            usage_metadata=real.usage_metadata,
            response_metadata=real.response_metadata,
        )
        return result


def scripted_llama(base_url: str, script: Script, **settings: Any) -> ScriptedLlama:
    """A ``ScriptedLlama`` with the settings the real-server tests share: a tiny, greedy answer."""
    return ScriptedLlama(
        model="tiny",
        base_url=base_url,
        api_key="none",
        max_tokens=4,
        temperature=0,
        script=script,
        **settings,
    )
