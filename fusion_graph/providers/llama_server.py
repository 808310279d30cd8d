"""llama-server as the local leg: its chat model and its ``/props`` discovery.

``ChatLlamaServer`` is ``ChatOpenAI`` (with repairable tool arguments) that keeps llama-server's ``timings``
object (``prompt_n`` processed, ``cache_n`` reused, ``prompt_ms``), which
langchain-openai otherwise drops, in the answer's ``response_metadata``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import openai
from langchain_core.outputs import ChatGenerationChunk, ChatResult

from fusion_graph.context import DEFAULTS
from fusion_graph.errors import LlamaServerUnavailable, LocalPoolMismatch, NotLlamaServer  # noqa: F401 - re-exported
from fusion_graph.providers.openai_compatible import ChatOpenAICompatible
from fusion_graph.routing.rule import MAX_BUDGET_SHARE

#: The fewest tokens a start line gives each slot: the graph's first prompt (system prompt and tool
#: definitions: about 600 tokens with the built-in ones) and its tool results, beside the default
#: completion budget (4,096, at most half a slot: ``routing.rule.MAX_BUDGET_SHARE``).
MIN_SLOT_WINDOW = 8192


def slot_window_for(max_completion_tokens: int, prompt_tokens: int = 0) -> int:
    """Tokens one slot needs: ``prompt_tokens`` beside the completion budget, the budget at most half.

    At least ``MIN_SLOT_WINDOW``, rounded up to a multiple of 1,024.

    Args:
        max_completion_tokens: The run's completion budget.
        prompt_tokens: The graph's first prompt (system prompt, tool definitions, the task).
    """
    need = max(
        MIN_SLOT_WINDOW,
        math.ceil(max_completion_tokens / MAX_BUDGET_SHARE),
        prompt_tokens + max_completion_tokens,
    )
    return -(-need // 1024) * 1024


#: What a start line gives each slot when the run needs less: room for an agent loop's tool output to
#: grow before context pressure sends its steps to cloud (the README's and the docs' command).
RECOMMENDED_SLOT_WINDOW = 32768
#: Where llama-server listens when its URL names no port (its own default).
DEFAULT_PORT = 8080
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def start_command(
    max_completion_tokens: int = DEFAULTS["max_completion_tokens"],
    *,
    prompt_tokens: int = 0,
    slots: int = 4,
    base_url: str = "http://127.0.0.1:8080/v1",
) -> str:
    """The llama-server command line fusion-graph expects, listening where ``base_url`` points.

    ``slots`` slots of ``RECOMMENDED_SLOT_WINDOW`` tokens, more when the run
    needs more (``slot_window_for``); the port is the URL's, and a host other
    than loopback adds ``--host 0.0.0.0`` so the graph's machine can reach it.
    """
    window = max(RECOMMENDED_SLOT_WINDOW, slot_window_for(max_completion_tokens, prompt_tokens))
    url = httpx.URL(base_url)
    port = url.port or DEFAULT_PORT
    host = "" if url.host in LOOPBACK else " --host 0.0.0.0"
    return f"llama-server -m MODEL.gguf --jinja -np {slots} -c {slots * window}{host} --port {port}"


#: How the start hint ends, explaining the flags (``start_hint``).
START_NOTE = "(explicit -np keeps one KV cache per slot; context per slot is -c / -np)"


#: How the start hint begins (``checks.unreachable_reason`` cuts an error's text there).
START_HINT_PREFIX = "start one with: "


def start_hint(base_url: str) -> str:
    """How to start llama-server where ``base_url`` points, said wherever it cannot be reached."""
    return f"{START_HINT_PREFIX}{start_command(base_url=base_url)} {START_NOTE}"


def server_root(base_url: str) -> str:
    """``http://host:port`` from an OpenAI-style ``.../v1`` base URL."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


@dataclass(frozen=True)
class ServerProps:
    """What llama-server says about itself (``GET /props``).

    Attributes:
        total_slots: Parallel slots (its ``-np``).
        slot_window: Tokens one slot holds (``-c / -np``, padded by llama.cpp), or ``None``
            when the server does not say.
    """

    total_slots: int
    slot_window: int | None
    model: str | None = None
    """The model it serves: its ``--alias``, else the file name of its ``model_path``."""


def _model_of(props: dict[str, Any]) -> str | None:
    alias = props.get("model_alias")
    path = props.get("model_path")
    if isinstance(alias, str) and alias:
        return alias
    return path.replace("\\", "/").rsplit("/", 1)[-1] if isinstance(path, str) and path else None


def _slot_window(props: dict[str, Any], total: int) -> int | None:
    """The per-slot context from ``/props``: ``default_generation_settings.n_ctx``, else ``n_ctx / total``."""
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    if isinstance(n_ctx, int) and n_ctx > 0:
        return n_ctx  # per slot in current llama-server
    whole = props.get("n_ctx")
    return whole // total if isinstance(whole, int) and whole > 0 else None


async def fetch_props(base_url: str, *, timeout: float = 5.0) -> ServerProps:
    """Ask llama-server for its slots and per-slot window (``GET /props``).

    Raises:
        LlamaServerUnavailable: The server could not be reached.
        NotLlamaServer: It answered, but is not llama-server (e.g. another
            OpenAI-compatible server), so there are no slots to pin.
    """
    url = server_root(base_url) + "/props"
    # Building a client loads certificates (blocking I/O): do it off the event loop.
    client = await asyncio.to_thread(httpx.AsyncClient, timeout=timeout)
    try:
        async with client:
            response = await client.get(url)
    except httpx.HTTPError as error:
        raise LlamaServerUnavailable(f"cannot read {url} ({error!r}); {start_hint(base_url)}") from error
    if response.status_code >= 500:
        raise LlamaServerUnavailable(f"{url} answered {response.status_code}; is llama-server still loading?")
    try:
        props = response.json() if response.status_code == 200 else None
    except ValueError:
        props = None
    total = props.get("total_slots") if isinstance(props, dict) else None
    if not isinstance(props, dict) or not isinstance(total, int) or total < 1:
        raise NotLlamaServer(
            f"{url} did not report total_slots (HTTP {response.status_code}): not llama-server"
        )
    return ServerProps(total, _slot_window(props, total), _model_of(props))


#: Seconds one ``GET /slots`` or warm-up request of the placement may take.
SLOT_CALL_TIMEOUT_S = 5.0


async def slot_states(
    base_url: str, *, timeout: float = SLOT_CALL_TIMEOUT_S
) -> dict[int, tuple[bool, int]] | None:
    """``{slot: (processing, prompt tokens held)}`` from llama-server's ``GET /slots``.

    ``None`` when the server does not say (``--no-slots``, not llama-server, not
    reachable): callers then act as if they could not see the slots.
    """
    client = await asyncio.to_thread(httpx.AsyncClient, timeout=timeout)  # certificates load off the loop
    try:
        async with client:
            response = await client.get(server_root(base_url) + "/slots")
        rows = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(rows, list):
        return None
    states: dict[int, tuple[bool, int]] = {}
    for row in rows:
        if isinstance(row, dict) and isinstance(row.get("id"), int):
            held = row.get("n_prompt_tokens")
            states[row["id"]] = (bool(row.get("is_processing")), held if isinstance(held, int) else 0)
    return states


#: The prompt of a slot's warm-up request (``warm_slot``): any short text.
WARM_PROMPT = "warm"


async def warm_slot(base_url: str, slot: int, *, timeout: float = SLOT_CALL_TIMEOUT_S) -> bool:
    """One one-token completion naming ``slot``, so the slot holds a prompt; whether it answered.

    llama-server consults its host prompt cache for a request naming a slot only
    when that slot holds a prompt (an empty one makes the similarity check 0/0):
    a returning thread whose slot was never used would prefill its whole prefix
    though the cache has it. The caller holds the slot's turn.
    """
    body = {"prompt": WARM_PROMPT, "n_predict": 1, "cache_prompt": True, "id_slot": slot}
    client = await asyncio.to_thread(httpx.AsyncClient, timeout=timeout)
    try:
        async with client:
            response = await client.post(server_root(base_url) + "/completion", json=body)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


async def fetch_total_slots(base_url: str, *, timeout: float = 5.0) -> int:
    """Ask llama-server how many slots it runs (``GET /props`` -> ``total_slots``).

    Raises:
        LlamaServerUnavailable: The server could not be reached.
        NotLlamaServer: It answered, but is not llama-server.
    """
    return (await fetch_props(base_url, timeout=timeout)).total_slots


async def count_prompt_tokens(
    base_url: str,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] = (),
    *,
    timeout: float = 10.0,
    client: httpx.AsyncClient | None = None,
) -> int:
    """Tokens llama-server makes of a chat request: ``/apply-template``, then ``/tokenize``.

    ``messages`` and ``tools`` are OpenAI-format dicts, as sent to ``/v1/chat/completions``;
    the count is the prompt the server would process (template, tools, special tokens).

    Raises:
        httpx.HTTPError: The server could not be reached or refused either call.
    """
    root = server_root(base_url)
    body: dict[str, Any] = {"messages": list(messages)}
    if tools:
        body["tools"] = list(tools)
    own = client is None
    if client is None:
        client = await asyncio.to_thread(httpx.AsyncClient, timeout=timeout)
    try:
        rendered = await client.post(root + "/apply-template", json=body)
        rendered.raise_for_status()
        prompt = rendered.json()["prompt"]
        tokenized = await client.post(
            root + "/tokenize", json={"content": prompt, "add_special": True, "parse_special": True}
        )
        tokenized.raise_for_status()
        return len(tokenized.json()["tokens"])
    finally:
        if own:
            await client.aclose()


def timings_of(payload: Any) -> dict[str, Any] | None:
    """The ``timings`` object of a llama-server response or stream chunk, if any."""
    if isinstance(payload, openai.BaseModel):
        payload = payload.model_dump()
    if isinstance(payload, dict):
        timings = payload.get("timings")
        if isinstance(timings, dict):
            return timings
    return None


def _served_by(info: dict[str, Any] | None, header: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """``info`` without the response headers, and the value of ``header`` among them.

    Only the one header is kept (as ``served_by``): the rest would be saved with
    the message in every checkpoint.
    """
    if not info or "headers" not in info:
        return info, None
    rest = {key: value for key, value in info.items() if key != "headers"}
    headers = info["headers"] if isinstance(info["headers"], dict) else {}
    wanted = (header or "").lower()
    found = next((str(v) for k, v in headers.items() if wanted and str(k).lower() == wanted), None)
    return rest or None, found


class ChatLlamaServer(ChatOpenAICompatible):
    """``ChatOpenAI`` for llama-server that keeps its ``timings`` in ``response_metadata``.

    Behind a gateway, ``worker_header`` names the response header that says which
    box served; its value is kept as ``response_metadata["served_by"]``.
    """

    worker_header: str | None = None

    def _create_chat_result(
        self, response: dict[str, Any] | openai.BaseModel, generation_info: dict[str, Any] | None = None
    ) -> ChatResult:
        generation_info, served_by = _served_by(generation_info, self.worker_header)
        result = super()._create_chat_result(response, generation_info)
        timings = timings_of(response)
        for generation in result.generations:
            if timings is not None:
                generation.message.response_metadata["timings"] = timings
            if served_by is not None:
                generation.message.response_metadata["served_by"] = served_by
        return result

    def _convert_chunk_to_generation_chunk(
        self,
        chunk: dict[str, Any],
        default_chunk_class: type,
        base_generation_info: dict[str, Any] | None,
    ) -> ChatGenerationChunk | None:
        base_generation_info, served_by = _served_by(base_generation_info, self.worker_header)
        generation = super()._convert_chunk_to_generation_chunk(
            chunk, default_chunk_class, base_generation_info
        )
        timings = timings_of(chunk)
        if generation is not None and timings is not None:
            generation.message.response_metadata["timings"] = timings
        if generation is not None and served_by is not None:
            generation.message.response_metadata["served_by"] = served_by
        return generation
