"""Provider health: classify an inference error, and one provider's circuit (cooldown, probe).

Pure code over explicit ``now`` values, so cooldown timing is testable with an
injected clock.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any, Literal

import httpx
import openai

from fusion_graph.errors import MalformedAnswer
from fusion_graph.redact import scrub
from fusion_graph.routing.records import ErrorClass

#: Errors that count against a provider (``misconfigured``: 401/403/404, a bad key, model or URL).
HEALTH_FAILURES: frozenset[ErrorClass] = frozenset(
    {"rate_limited", "timeout", "connection", "server_error", "misconfigured", "malformed_response"}
)
#: ``context_overflow`` (the request is larger than this provider's window) is neither: it does not
#: count against the provider, and the chain walks on to a link with a larger window.
#: Errors that are not the provider's fault: re-raised as they are, never failed over.
#: ``other`` (an unknown error, e.g. a bug in a tool binding) is not hidden behind a fallover.
NO_FALLOVER: frozenset[ErrorClass] = frozenset({"bad_request", "other"})
#: How langchain-openai words a body that is JSON but not a chat completion.
_MALFORMED_HINTS = ("'choices'", "Unexpected response type", "No generations found in stream")
#: How servers say a request is larger than the context window: llama-server's error type and
#: text, OpenAI's error code, and the usual wording of OpenAI-compatible servers.
_OVERFLOW_HINTS = (
    "exceed_context_size_error",
    "exceeds the available context size",
    "context_length_exceeded",
    "maximum context length",
)


def causes(error: BaseException, *, context: bool = False) -> Iterator[BaseException]:
    """``error``, then what caused it (``__cause__``; with ``context``, else ``__context__``), each once."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or (current.__context__ if context else None)


def context_overflow(error: BaseException) -> bool:
    """Whether ``error`` (or its cause) says the request exceeds the provider's context window."""
    for current in causes(error):
        if isinstance(current, _OVERFLOW_ERRORS):
            return True
        text = f"{current} {_attr(current, 'body')!r} {_attr(current, 'code')!r}"
        if any(hint in text for hint in _OVERFLOW_HINTS):
            return True
    return False


def overflow_numbers(error: BaseException) -> tuple[int | None, int | None]:
    """``(prompt tokens, window)`` a context-size error reports (llama-server: n_prompt_tokens, n_ctx)."""
    for current in causes(error):
        body = _attr(current, "body")
        details = body.get("error", body) if isinstance(body, dict) else None
        if isinstance(details, dict):
            prompt, window = details.get("n_prompt_tokens"), details.get("n_ctx")
            if isinstance(prompt, int) or isinstance(window, int):
                return (
                    prompt if isinstance(prompt, int) else None,
                    window if isinstance(window, int) else None,
                )
    return None, None


#: Transient errors worth an in-place retry (a 429 waits out its Retry-After instead).
RETRY_IN_PLACE: frozenset[ErrorClass] = frozenset({"timeout", "connection", "server_error"})


def _classes(modules: tuple[str, ...], *names: str) -> tuple[type[BaseException], ...]:
    """Exception classes by name from whichever of ``modules`` are installed and have them."""
    found = []
    for module in modules:
        with contextlib.suppress(ImportError):
            loaded = importlib.import_module(module)
            found += [getattr(loaded, name, None) for name in names]
    return tuple(c for c in found if isinstance(c, type) and issubclass(c, BaseException))


_HTTP = ("httpx", "httpx2")  # httpx2 is what openai>=3 speaks
_LC = ("langchain_core.exceptions",)  # provider-neutral errors of newer langchain-core
_TIMEOUT = _classes(_HTTP + _LC, "TimeoutException", "ModelTimeoutError")
_CONNECTION = _classes(_HTTP + _LC, "TransportError", "ModelConnectionError")
_MISCONFIGURED = _classes(_LC, "ModelAuthenticationError", "ModelPermissionDeniedError", "ModelNotFoundError")
#: Checked in order after the status code (openai's timeout is an ``APIConnectionError``).
_KINDS: tuple[tuple[tuple[type[BaseException], ...], ErrorClass], ...] = (
    ((openai.APITimeoutError, TimeoutError, *_TIMEOUT), "timeout"),
    ((openai.APIConnectionError, ConnectionError, *_CONNECTION), "connection"),
    (_classes(_LC, "ModelRateLimitError"), "rate_limited"),
    (_classes(_LC, "ModelAPIError"), "server_error"),
    (_MISCONFIGURED, "misconfigured"),
    (_classes(_LC, "ModelInvalidRequestError"), "bad_request"),
)
_OVERFLOW_ERRORS = _classes(_LC, "ContextOverflowError")


def _attr(obj: object, name: str) -> Any:
    try:
        return getattr(obj, name, None)
    except RuntimeError:  # httpx raises this for a response/request that was never set
        return None


def status_code(error: BaseException) -> int | None:
    """The HTTP status behind ``error`` (openai ``APIStatusError``, ``httpx.HTTPStatusError``)."""
    code = _attr(error, "status_code")
    code = code if isinstance(code, int) else _attr(_attr(error, "response"), "status_code")
    return code if isinstance(code, int) else None


_LOOP_HINTS = ("bound to a different event loop", "attached to a different loop", "Event loop is closed")


def _loop_bound(error: BaseException) -> bool:
    """Whether ``error`` (or a cause) is a client used from an event loop it does not belong to."""
    return any(
        isinstance(current, RuntimeError) and any(hint in str(current) for hint in _LOOP_HINTS)
        for current in causes(error, context=True)
    )


def what_answered(response: httpx.Response) -> str:
    """What a response that is not JSON holds, in a few words: ``an HTML page``, ``text/plain ...``."""
    kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        start = response.text.lstrip()[:15].lower()
    except (httpx.ResponseNotRead, UnicodeDecodeError):  # a streamed body never read
        start = ""
    if kind == "text/html" or start.startswith(("<!doctype html", "<html")):
        return "an HTML page"
    return f"{kind} that is not JSON" if kind else "a body that is not JSON"


def error_text(error: BaseException) -> str:
    """An inference error's text; a status error whose body was not JSON also says what the body was.

    The OpenAI client words an HTML error page as ``Error code: 405`` alone; the
    page itself is what tells an operator the URL is a website, not an API.
    """
    text = str(error)
    response = getattr(error, "response", None)
    parsed = isinstance(getattr(error, "body", None), dict | list)  # the client keeps a non-JSON body as text
    if isinstance(error, openai.APIStatusError) and not parsed and isinstance(response, httpx.Response):
        text += f" (the server answered {what_answered(response)})"
    return text


def classify(error: BaseException) -> ErrorClass:
    """Sort an inference error: is the provider at fault, and may another provider try?

    A request larger than the provider's context window (llama-server's
    context-size 400, OpenAI's ``context_length_exceeded``, langchain-core's
    ``ContextOverflowError``) is ``context_overflow``: another provider with a
    larger window may take it. Any other 4xx but 401/403/404
    (``misconfigured``), 408 and 429 is ``bad_request``: the request itself is
    wrong and would fail anywhere. A body that is not a chat completion
    (``MalformedAnswer`` included) is ``malformed_response`` (the provider's
    fault). Unknown errors are ``other`` unless their ``__cause__`` says more.
    """
    if context_overflow(error):
        return "context_overflow"
    if _loop_bound(error):
        return "other"  # our use of a client, not the provider: never a health failure
    for current in causes(error):
        if isinstance(current, MalformedAnswer):
            return "malformed_response"
        code = status_code(current)
        if code is not None and code >= 400:
            if code in (408, 429):
                return "timeout" if code == 408 else "rate_limited"
            if code >= 500:
                return "server_error"
            return "misconfigured" if code in (401, 403, 404) else "bad_request"
        kind = next((kind for classes, kind in _KINDS if isinstance(current, classes)), None)
        if kind is not None:
            return kind
        if isinstance(current, json.JSONDecodeError | openai.APIResponseValidationError) or (
            isinstance(current, TypeError | KeyError | ValueError)
            and any(hint in str(current) for hint in _MALFORMED_HINTS)
        ):
            return "malformed_response"
        if isinstance(current, openai.APIError):
            return "server_error"  # an error the server sent in place of an answer (an SSE ``error`` event)
    return "other"


def retry_after(error: BaseException, now: float) -> float | None:
    """Seconds the server asked us to wait (``retry-after-ms``/``Retry-After``), else ``None``.

    Args:
        error: The failed call's exception; its ``response.headers`` are read.
        now: Wall-clock epoch seconds, to turn an HTTP date into a delay.
    """
    headers = _attr(_attr(error, "response"), "headers")
    if not hasattr(headers, "get"):
        return None
    value = headers.get("retry-after")
    for raw, scale in ((headers.get("retry-after-ms"), 1000.0), (value, 1.0)):
        with contextlib.suppress(TypeError, ValueError):
            return max(float(raw) / scale, 0.0)
    with contextlib.suppress(TypeError, ValueError):
        return max(parsedate_to_datetime(value).timestamp() - now, 0.0)
    return None


@dataclass(frozen=True)
class HealthPolicy:
    """When a provider leaves the rotation, and for how long.

    Attributes:
        allowed_failures: Health failures tolerated within ``window_s``; one more trips the cooldown.
        window_s: The failure-counting window.
        cooldown_s: Cooldown after a trip; a Retry-After replaces it.
        max_retry_after_s: Cap on Retry-After, so one header cannot bench a provider for days.
    """

    allowed_failures: int = 2
    window_s: float = 60.0
    cooldown_s: float = 30.0
    max_retry_after_s: float = 600.0


@dataclass(frozen=True)
class RetryPolicy:
    """In-place retries of one provider's transient errors; none by default: the chain is the retry."""

    attempts: int = 0
    initial_s: float = 0.5
    max_s: float = 4.0
    jitter_s: float = 0.25


HealthState = Literal["healthy", "cooldown", "half_open"]


@dataclass
class Health:
    """One provider's circuit, driven by explicit ``now`` values so it stays pure."""

    policy: HealthPolicy = field(default_factory=HealthPolicy)
    failures: list[float] = field(default_factory=list)
    cooldown_until: float | None = None
    probing: bool = False
    #: The last health failure's text, scrubbed of secrets (``redact.scrub``).
    last_error: str | None = None

    def state(self, now: float) -> HealthState:
        """``healthy``; ``cooldown``; ``half_open`` once the cooldown has elapsed."""
        if self.cooldown_until is None:
            return "healthy"
        return "cooldown" if now < self.cooldown_until else "half_open"

    def available(self, now: float) -> bool:
        """Usable now: healthy, or half-open with no probe in flight (one probe at a time)."""
        state = self.state(now)
        return state == "healthy" or (state == "half_open" and not self.probing)

    def failed(self, now: float, error: str, retry_after_s: float | None, *, immediate: bool) -> None:
        """Count a health failure; trip the cooldown (or restart it, e.g. a failed probe) when due.

        ``error`` is kept as ``last_error`` after ``redact.scrub``.
        """
        self.last_error = scrub(error)
        self.failures = [t for t in self.failures if t > now - self.policy.window_s] + [now]
        tripped = len(self.failures) > self.policy.allowed_failures or self.cooldown_until is not None
        if immediate or retry_after_s is not None or tripped:
            wait = self.policy.cooldown_s
            if retry_after_s is not None:
                wait = min(retry_after_s, self.policy.max_retry_after_s)
            self.cooldown_until, self.failures = now + wait, []

    def recovered(self) -> None:
        """A probe succeeded: close the circuit."""
        self.cooldown_until, self.failures, self.last_error = None, [], None
