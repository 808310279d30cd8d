"""Real exception instances from the openai SDK, httpx and langchain-core, for error handling tests."""

from __future__ import annotations

import importlib
from typing import Any

import httpx
import openai

URL = "http://127.0.0.1:9/v1/chat/completions"
EPOCH = 1_700_000_000.0


#: The HTTP library the openai SDK raises with (httpx2 for openai>=3); llama.py uses plain httpx.
try:
    sdk_httpx: Any = importlib.import_module("httpx2")
except ImportError:  # pragma: no cover - openai<3
    sdk_httpx = httpx


def request() -> Any:
    return sdk_httpx.Request("POST", URL)


def response(status: int, headers: dict[str, str] | None = None) -> Any:
    return sdk_httpx.Response(status, request=request(), headers=headers or {})


def plain_request() -> httpx.Request:
    return httpx.Request("POST", URL)


def plain_response(status: int) -> httpx.Response:
    return httpx.Response(status, request=plain_request())


def rate_limited(headers: dict[str, str] | None = None) -> openai.RateLimitError:
    return openai.RateLimitError("slow down", response=response(429, headers), body=None)


def bad_request() -> openai.BadRequestError:
    return openai.BadRequestError("context too long", response=response(400), body=None)


def refused() -> httpx.ConnectError:
    return httpx.ConnectError("connection refused", request=plain_request())


def lc_error(name: str) -> BaseException:
    """A provider-neutral langchain-core model error (in every langchain-core the project allows)."""
    exceptions = importlib.import_module("langchain_core.exceptions")
    error: BaseException = getattr(exceptions, name)("provider said no")
    return error


def caused(error: BaseException) -> BaseException:
    wrapper = RuntimeError("wrapped")
    wrapper.__cause__ = error
    return wrapper


#: llama-server's answer to a request larger than the slot (HTTP 400).
LLAMA_OVERFLOW_BODY = {
    "error": {
        "code": 400,
        "message": (
            "request (4019 tokens) exceeds the available context size (2048 tokens), try increasing it"
        ),
        "type": "exceed_context_size_error",
        "n_prompt_tokens": 4019,
        "n_ctx": 2048,
    }
}


def llama_overflow() -> openai.BadRequestError:
    """The openai SDK's error for llama-server's context-size 400."""
    return openai.BadRequestError(
        f"Error code: 400 - {LLAMA_OVERFLOW_BODY}", response=response(400), body=LLAMA_OVERFLOW_BODY
    )


def openai_overflow() -> openai.BadRequestError:
    """OpenAI's own wording of a prompt past the model's context length."""
    body = {
        "message": "This model's maximum context length is 128000 tokens.",
        "code": "context_length_exceeded",
    }
    return openai.BadRequestError(f"Error code: 400 - {body}", response=response(400), body=body)
