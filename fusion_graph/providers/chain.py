"""Who answers a step: the one provider call, the chain it walks, and each provider's health.

Every inference comes through ``ask``, which walks the ``ProviderChain``, which
falls over on what the health code says of an error: the three are one path,
read top to bottom here.

**Health.** ``classify`` names an inference error (rate limited, timeout,
context overflow, malformed answer, ...); a ``Health`` circuit per provider
turns failures within a window into a cooldown, makes the first use after it a
probe (half-open), and lets the probe close or re-open the circuit. It is pure
code over explicit ``now`` values, so cooldown timing is testable with an
injected clock; a ``HealthBoard`` shares cooldowns between processes.

**The chain.** Providers (``Provider``) sit in one ordered list across both
legs. A call's start is, in order: ``prefer_provider`` (repairs), the first
provider of ``preferred_leg`` (the router), the operator's override, the first
available provider; a start in cooldown, or one whose window cannot hold the
request (``fits``), is skipped. So the routed leg beats the override, which is
only the default start, and a routed call never touches the override. On a
failure the walk resumes from the head, skipping providers that already failed
in this call: local down runs on cloud and vice versa, and a request that
overflowed a window walks on to a larger one. A half-open provider used as a
preferred start is probed (its circuit learns from the call) but not
*reported* as a probe: ``probe`` says the chain's health logic, not the
router, chose it.

**The call.** ``ask`` serves every inference: the steps (plan, continuation
steps, repairs), the re-synthesis of a reply, the memory jobs, MCP samples and
shadow checks (every ``routing.records.StepKind``). So every call is made and
recorded the same way:

- a local provider gets the request's ``Placement`` (the slot as ``id_slot`` +
  ``cache_prompt``, its headers), decided per provider actually called by the
  graph's one ``Placer``, never from whichever provider is "active";
- every attempt is bounded: ``timeout_s`` (``asyncio.timeout``, so injected
  models too), a completion budget sent as ``max_tokens``, and the providers
  the fit rule allows (``Bounds``); a response the model cannot parse is a
  malformed answer (a health failure, so the chain falls over), never an
  uncaught exception;
- one ``route_log`` entry (who answered, which attempts failed before, what it
  cost at the answering provider's prices), also for a call no provider
  answered (``routing.records.make_record``);
- a slot's priming request (``prime_slot``, before a memory job) is built by
  the same request builder on the same placement, and is never recorded;
- where a ``writer`` is given, two custom stream events
  (``stream_mode="custom"``: the decision before the call, the outcome after),
  and leg/score tags and metadata on the model run (LangGraph Studio and
  LangSmith traces show them).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import time
import traceback
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any, Generic, Literal, Protocol, TypeVar, cast

import httpx
import openai
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage
from langchain_core.runnables import Runnable, RunnableConfig
from langchain_core.runnables.config import ensure_config
from langchain_core.tools import BaseTool
from pydantic import ValidationError
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from fusion_graph.errors import (
    ChainExhausted,
    Closed,
    MalformedAnswer,
    ProviderRequestError,
    UnknownProvider,
    UsageError,
    causes,
)
from fusion_graph.providers.models import Provider
from fusion_graph.providers.placement import NOWHERE, Placement, Placer
from fusion_graph.providers.pricing import price
from fusion_graph.redact import scrub, scrub_content
from fusion_graph.routing.records import (
    Attempt,
    ErrorClass,
    RecordParts,
    RouteRecord,
    SizingRecord,
    StepKind,
    in_all_cloud_baseline,
    joined,
    make_record,
)
from fusion_graph.routing.score import Leg, RouteDecision, StepSignals
from fusion_graph.sizing.turn import Estimate
from fusion_graph.telemetry import switch as telemetry

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


logger = logging.getLogger(__name__)


T = TypeVar("T")


Clock = Callable[[], float]


@dataclass(frozen=True)
class ChainOutcome(Generic[T]):
    """A call that got an answer: who gave it, and which attempts failed before it.

    ``preferred``: the answer came from the preferred start. ``probe``: the
    chain's health logic picked a half-open link (never a preferred start).
    """

    provider: Provider
    answer: T
    attempts: tuple[Attempt, ...]
    probe: bool
    preferred: bool
    latency_s: float


def _any_link(link: Provider) -> bool:
    """The default ``fits``: every link can hold the request."""
    return True


def _counted(number: int, noun: str) -> str:
    """``1 recent failure``, ``2 recent failures``: the exhausted chain's message reads as English."""
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _own_error(error: Exception, attempts: Sequence[Attempt]) -> ProviderRequestError:
    """``error`` as a ``ProviderRequestError``: scrubbed text, scrubbed traceback and attempts as notes."""
    kind = classify(error)
    text = scrub(f"{type(error).__name__}: {error}")
    what = "the provider refused the request" if kind == "bad_request" else "an unexpected error"
    own = ProviderRequestError(
        f"{what} ({kind}), not retried on another provider: {text}", attempts, type(error).__name__, kind
    )
    for note in getattr(error, "__notes__", ()):
        own.add_note(scrub(str(note)))
    own.add_note(scrub("".join(traceback.format_exception(error))))
    own.add_note(scrub(f"provider chain attempts: {list(attempts)}"))
    return own


def scrub_answer(answer: T) -> T:
    """An ``AIMessage`` answer with the registered secret values replaced in its text and tool calls."""
    if not isinstance(answer, AIMessage):
        return answer
    calls = [{**call, "args": scrub_content(call["args"])} for call in answer.tool_calls]
    content = scrub_content(answer.content)
    if content == answer.content and calls == answer.tool_calls:
        return answer
    return cast(T, answer.model_copy(update={"content": content, "tool_calls": calls}))


class HealthBoard(Protocol):
    """Where the circuits of a deployment's worker processes meet (``SharedState.health``)."""

    def cooldown(self, provider: str) -> tuple[float, str | None] | None:
        """A cooldown some worker announced for ``provider``: wall-clock end and last error."""
        ...

    async def publish_cooldown(self, provider: str, until: float | None, error: str | None) -> None:
        """Announce that ``provider`` cools down until ``until`` (wall clock; ``None``: recovered)."""
        ...


def board_key(link: Provider) -> str:
    """A link as every worker process names it: its id and endpoint."""
    return f"{link.id}@{link.base_url or ''}"


class ProviderChain:
    """Ordered providers across both legs: health, fallover, an operator override and lifecycle.

    Links are reference-counted: ``acquire``/``release`` (or ``hold``) pin one,
    an in-flight call holds the link it calls, and a link is closed exactly once,
    when it has left the chain (``replace``, ``aclose``) and nothing holds it.
    """

    def __init__(
        self,
        links: Sequence[Provider],
        *,
        policy: HealthPolicy | None = None,
        retry: RetryPolicy | None = None,
        clock: Clock = time.monotonic,
        wall_clock: Clock = time.time,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        board: HealthBoard | None = None,
    ) -> None:
        """Build a chain; ``clock`` times cooldowns, ``wall_clock`` reads HTTP-date Retry-After.

        ``board``: where cooldowns are shared with the deployment's other worker
        processes (``SharedState``); ``None`` keeps them in this process.
        """
        self._board = board
        self._policy, self._retry = policy or HealthPolicy(), retry or RetryPolicy()
        self._clock, self._wall_clock, self._sleep = clock, wall_clock, sleep
        self._links: list[Provider] = []
        self._health: dict[Provider, Health] = {}
        self._holds: dict[Provider, int] = {}
        self._override: str | None = None
        self._closed = False
        self._owns_links = True
        self._install(links)

    def only(self, legs: Collection[Leg]) -> ProviderChain:
        """A chain over this chain's links of ``legs``, sharing their health; it never closes a link.

        What a ``mode="local"`` (or ``"cloud"``) run uses, so no call of it can
        fall over to the other leg.
        """
        view = ProviderChain(
            [link for link in self._links if link.leg in legs],
            policy=self._policy,
            retry=self._retry,
            clock=self._clock,
            wall_clock=self._wall_clock,
            sleep=self._sleep,
            board=self._board,
        )
        view._health = {link: self._health[link] for link in view._links}
        view._override = self._override if self._override in {link.id for link in view._links} else None
        view._owns_links = False
        return view

    def share_health(self, board: HealthBoard | None) -> None:
        """Share cooldowns through ``board`` from now on (``None``: keep them in this process)."""
        self._board = board

    def _install(self, links: Sequence[Provider]) -> list[Provider]:
        ids = [link.id for link in links]
        if len(set(ids)) != len(ids):
            raise UsageError(f"provider ids must be unique in a chain, got {ids}")
        removed = [link for link in self._links if link not in links]
        self._links = list(links)
        self._health = {link: self._health.get(link) or Health(self._policy) for link in links}
        self._override = self._override if self._override in ids else None
        return removed

    @property
    def links(self) -> tuple[Provider, ...]:
        """The links in chain order."""
        return tuple(self._links)

    @property
    def override(self) -> str | None:
        """The operator's pinned default start, if any."""
        return self._override

    def link(self, provider_id: str) -> Provider:
        """The link called ``provider_id``; ``KeyError`` when it is not in the chain."""
        for link in self._links:
            if link.id == provider_id:
                return link
        raise UnknownProvider(f"no provider {provider_id!r} in the chain ({[x.id for x in self._links]})")

    @property
    def first_cloud(self) -> Provider | None:
        """The chain's first cloud link: the one a step is priced at before its call (``None``: no cloud)."""
        return next((link for link in self._links if link.leg == "cloud"), None)

    def leg_of(self, provider_id: str) -> Leg | None:
        """The leg of ``provider_id`` (``None`` if absent): the ``leg_of`` of ``chain_totals``."""
        return next((link.leg for link in self._links if link.id == provider_id), None)

    def set_override(self, provider_id: str | None) -> None:
        """Pin (``None``: unpin) the default start. A switch closes nothing: all links stay."""
        if provider_id is not None:
            self.link(provider_id)
        self._override = provider_id

    def health(self, provider_id: str) -> Health:
        """The circuit of ``provider_id`` (read ``state(now)``, ``cooldown_until``, ``last_error``)."""
        return self._health[self.link(provider_id)]

    def health_states(self) -> dict[str, HealthState]:
        """Each link's circuit state now, by provider id (the metrics' cooldown gauge reads it)."""
        now = self._clock()
        return {link.id: self._health[link].state(now) for link in self._links}

    def acquire(self, provider_id: str) -> Provider:
        """Pin a link (e.g. the router's pick for a leg) so no swap closes it; pair with ``release``."""
        if self._closed:
            raise Closed("the provider chain is closed")
        link = self.link(provider_id)
        self._holds[link] = self._holds.get(link, 0) + 1
        return link

    async def release(self, link: Provider) -> None:
        """Drop one hold; the last one closes the link if it has left the chain."""
        count = self._holds.get(link, 0)
        if count <= 0:
            raise UsageError(f"provider {link.id!r} is not held")
        if count > 1:
            self._holds[link] = count - 1
            return
        del self._holds[link]
        if link not in self._links:
            await self._close([link])

    @contextlib.asynccontextmanager
    async def hold(self, provider_id: str) -> AsyncIterator[Provider]:
        """``acquire``/``release`` as an async context manager."""
        link = self.acquire(provider_id)
        try:
            yield link
        finally:
            await self.release(link)

    async def replace(self, links: Sequence[Provider]) -> None:
        """Swap the provider list; links that left close now, or on their last release.

        Kept links (the same objects) keep their health; new ones start healthy.
        The override is cleared when its provider left.
        """
        removed = self._install(links)
        await self._close([link for link in removed if link not in self._holds])

    async def aclose(self) -> None:
        """Close every link nothing holds; held ones close on their last release."""
        self._closed = True
        await self.replace([])

    async def _close(self, links: Sequence[Provider]) -> None:
        if not self._owns_links:
            return  # a view: the chain it was taken from closes them
        for link in links:
            try:
                await link.aclose()
            except Exception:
                logger.exception("closing provider %s failed", link.id)

    def _adopt_shared(self) -> None:
        """Take the cooldowns other worker processes announced (``board``) into the links' circuits."""
        if self._board is None:
            return
        now, wall = self._clock(), self._wall_clock()
        for link in self._links:
            shared = self._board.cooldown(board_key(link))
            if shared is None:
                continue
            until, error = shared
            health = self._health[link]
            local_until = now + (until - wall)
            if health.cooldown_until is None or health.cooldown_until < local_until:
                health.cooldown_until, health.failures = local_until, []
                health.last_error = error or health.last_error

    def _start(
        self, leg: Leg | None, provider_id: str | None, fits: Callable[[Provider], bool]
    ) -> tuple[Provider | None, bool]:
        self._adopt_shared()
        now = self._clock()
        first_of_leg = [x for x in self._links if x.leg == leg and fits(x)][:1]
        for link in [x for x in self._links if x.id == provider_id and fits(x)] + first_of_leg:
            if self._health[link].available(now):
                return link, True
        pinned = [
            x for x in self._links if x.id == self._override and self._health[x].available(now) and fits(x)
        ]
        return next(iter(pinned), None), False

    def _next(self, failed: set[Provider], fits: Callable[[Provider], bool]) -> Provider | None:
        now = self._clock()
        return next(
            (x for x in self._links if x not in failed and fits(x) and self._health[x].available(now)), None
        )

    async def call(
        self,
        invoke: Callable[[Provider], Awaitable[T]],
        *,
        preferred_leg: Leg | None = None,
        prefer_provider: str | None = None,
        on_attempt: Callable[[Attempt], None] | None = None,
        fits: Callable[[Provider], bool] | None = None,
    ) -> ChainOutcome[T]:
        """Run ``invoke`` on the chain's providers until one answers.

        Args:
            invoke: Makes the inference on the given link (e.g. with ``link.model``).
            preferred_leg: The router's leg; the walk starts at that leg's first link.
            prefer_provider: A provider id to start at before that (repairs).
            on_attempt: Called with each failed attempt as it happens.
            fits: Whether a link can hold the request (``routing.rule.fits``); links that cannot are
                skipped like links in cooldown. Asked again before each next link, so an
                attempt that overflowed a window (``context_overflow``, seen by ``on_attempt``)
                can rule out every link no larger.

        Raises:
            ChainExhausted: Every provider failed, is cooling down or cannot hold the request.
            ProviderRequestError: A ``bad_request`` or unknown (``other``) error: the request would
                fail on any provider. Scrubbed, with the attempts in its notes, never chained to the
                provider's exception.
        """
        if self._closed:
            raise Closed("the provider chain is closed")
        can_hold = fits or _any_link
        attempts: list[Attempt] = []
        failed: set[Provider] = set()
        began = self._clock()
        link, preferred = self._start(preferred_leg, prefer_provider, can_hold)
        link = link or self._next(failed, can_hold)
        while link is not None:
            refused: ProviderRequestError | None = None
            try:
                answer, probe = await self._attempt(link, invoke, preferred, attempts, on_attempt)
            except Exception as error:  # noqa: BLE001 - classified: raised as our own, or fall over
                if classify(error) in NO_FALLOVER:
                    refused = _own_error(error, attempts)
                failed.add(link)
            else:
                answer = scrub_answer(answer)
                return ChainOutcome(link, answer, tuple(attempts), probe, preferred, self._clock() - began)
            if refused is not None:
                raise refused  # raised outside the handler: not even as context, the provider's error
            link, preferred = self._next(failed, can_hold), False
        raise self._exhausted(attempts) from None  # see ChainExhausted: no raw provider error

    async def _attempt(
        self,
        link: Provider,
        invoke: Callable[[Provider], Awaitable[T]],
        preferred: bool,
        attempts: list[Attempt],
        on_attempt: Callable[[Attempt], None] | None,
    ) -> tuple[T, bool]:
        health = self._health[link]
        health_probe = health.state(self._clock()) == "half_open"
        reported = health_probe and not preferred
        health.probing = health.probing or health_probe
        self._holds[link] = self._holds.get(link, 0) + 1  # an in-flight call keeps its link open

        def in_place(error: BaseException) -> bool:
            transient = isinstance(error, Exception) and classify(error) in RETRY_IN_PLACE
            return transient and health.state(self._clock()) != "cooldown"

        async def once() -> T:
            started = self._clock()
            try:
                return await invoke(link)
            except Exception as error:
                before = health.cooldown_until
                attempts.append(self._failed(link, health, error, started, reported))
                if health.cooldown_until is not None and health.cooldown_until != before:
                    await self._announce(link, health)
                if on_attempt is not None:
                    on_attempt(attempts[-1])
                raise

        try:
            if self._retry.attempts == 0:  # the default: the chain itself is the retry
                answer = await once()
            else:
                retrying = AsyncRetrying(
                    stop=stop_after_attempt(1 + self._retry.attempts),
                    wait=wait_exponential_jitter(
                        multiplier=self._retry.initial_s, max=self._retry.max_s, jitter=self._retry.jitter_s
                    ),
                    retry=retry_if_exception(in_place),
                    sleep=self._sleep,
                    reraise=True,
                )
                answer = await retrying(once)
            if health_probe:
                health.recovered()
                await self._announce(link, health)
            return answer, reported
        finally:
            health.probing = health.probing and not health_probe
            await self.release(link)

    async def _announce(self, link: Provider, health: Health) -> None:
        """Tell the other worker processes a link's circuit opened (or closed); never fails the call."""
        if self._board is None:
            return
        until = None
        if health.cooldown_until is not None:
            until = self._wall_clock() + (health.cooldown_until - self._clock())
        try:
            await self._board.publish_cooldown(board_key(link), until, health.last_error)
        except Exception as error:  # noqa: BLE001 - the other workers learn it themselves then
            logger.warning("announcing %s's cooldown failed: %s", link.id, scrub(str(error)))

    def _failed(self, link: Provider, health: Health, error: Exception, start: float, probe: bool) -> Attempt:
        kind, name = classify(error), type(error).__name__
        hurt = kind in HEALTH_FAILURES
        wait = retry_after(error, self._wall_clock()) if hurt else None
        if hurt:
            health.failed(self._clock(), f"{name}: {error}", wait, immediate=kind == "rate_limited")
        latency = self._clock() - start
        message = scrub(error_text(error))[:500]  # scrub first: a cut could leave part of a key unmatched
        size = overflow_numbers(error)[0] if kind == "context_overflow" else None
        return Attempt(link.id, link.leg, name, kind, message, latency, hurt, probe, wait, size)

    def _exhausted(self, attempts: Sequence[Attempt]) -> ChainExhausted:
        now, lines, backs = self._clock(), [], []
        for link in self._links:
            health, tried = self._health[link], [a for a in attempts if a.provider == link.id]
            what = f"{tried[-1].error} [{tried[-1].kind}] {tried[-1].message}" if tried else "not tried"
            what += f" (last error: {health.last_error})" if not tried and health.last_error else ""
            failures = len(health.failures)
            when = f"still available ({_counted(failures, 'recent failure')})" if failures else "available"
            if health.cooldown_until is not None:
                backs.append(max(health.cooldown_until - now, 0.0))
                when = f"cooling down, back in {backs[-1]:.1f}s" if backs[-1] else "due for a probe"
            lines.append(f"  - {link.id} ({link.leg}): {what}; {when}")
        head = f"every provider failed or is cooling down ({_counted(len(attempts), 'failed attempt')})"
        message = head + (":\n" + "\n".join(lines) if lines else ": the chain is empty")
        return ChainExhausted(scrub(message), attempts, min(backs) if backs else None)


ROUTE_EVENT = "fusion_route"


#: Sends a custom stream event (``runtime.stream_writer``).
Writer = Callable[[dict[str, Any]], None]


#: Runs the model call of one attempt on a link at its placement (memory jobs prime their slot first).
Around = Callable[[Provider, Placement, Callable[[], Awaitable[Any]]], Awaitable[Any]]


#: Sends one attempt another way than ``model.ainvoke``: the link's chat model (tools not bound) and
#: the attempt's arguments (budget, slot body, headers); a ``create_agent`` middleware sends it through
#: the agent's own model call so the agent binds the tools and its inner middleware run.
Sender = Callable[[BaseChatModel, Mapping[str, Any]], Awaitable[AIMessage]]


@dataclass(frozen=True)
class Bounds:
    """What bounds each attempt of an inference.

    Attributes:
        allowed: Ids of the links the call may use (the fit rule's, a budget's); ``None``: every link.
        windows: Each link's window by id; after a context overflow, only larger ones are tried.
        estimates: The prompt estimate per leg, recorded next to the server's count.
        max_tokens: The completion budget sent to each link (``max_tokens``), by id.
        timeout_s: Seconds an attempt may take (``request_timeout``), injected models included.
    """

    allowed: frozenset[str] | None = None
    windows: Mapping[str, int | None] = field(default_factory=dict)
    estimates: Mapping[str, Estimate] = field(default_factory=dict)
    max_tokens: Mapping[str, int] = field(default_factory=dict)
    timeout_s: float | None = None


@dataclass(frozen=True)
class Ask:
    """One inference to make: what it is, where it was sent, and what it sends.

    Attributes:
        kind: What the inference is for (``routing.records.StepKind``).
        turn: Index of the turn.
        step: Index of the inference in its turn (a side inference: the step it sits beside).
        decision: The router's (or the kind's own rule's) decision: the leg it starts on, and why.
        prompt: The whole prompt, system message first.
        thread_id: The conversation (its placement on the local leg).
        tools: Tools bound to the model (their schemas are part of the prompt's prefix).
        signals: The routing signals of a scored step (``None`` otherwise).
        prefer_provider: A provider to start at while healthy (a repair's).
        reflection: Use the reserved reflection slot (memory jobs, samples), not the thread's.
        kwargs: Model-call arguments for any link (``stop``, ``temperature``).
        body: Request-body fields for OpenAI-compatible links only (``response_format``, ``tool_choice``).
        max_tokens: The completion budget where ``Bounds.max_tokens`` does not name the link.
        config: The run's config (callbacks); ``None``: the one of the run this is called in, if any.
        tags: More tags for the model run (e.g. ``nostream``).
        parts: Sub-records the record takes, joined over what the call records itself.
        send: How each attempt goes out (``None``: the link's model with ``tools`` bound, ``ainvoke``).
    """

    kind: StepKind
    turn: int
    step: int
    decision: RouteDecision
    prompt: Sequence[BaseMessage]
    thread_id: str
    tools: Sequence[BaseTool] = ()
    signals: StepSignals | None = None
    prefer_provider: str | None = None
    reflection: bool = False
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    body: Mapping[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    config: RunnableConfig | None = None
    tags: Sequence[str] = ()
    parts: RecordParts = field(default_factory=lambda: RecordParts())
    send: Sender | None = None


@dataclass(frozen=True)
class Asked:
    """What an inference came to: the answer (``None``: no provider answered), its record, the failure."""

    answer: AIMessage | None
    record: RouteRecord
    exhausted: ChainExhausted | None = None


#: Each link's model with the graph's tools bound (binding converts every schema, once is enough).
_BOUND: weakref.WeakKeyDictionary[Provider, tuple[tuple[int, ...], Runnable[Any, Any]]] = (
    weakref.WeakKeyDictionary()
)


#: The same for the models that reach one box directly (a placement's ``model``), by identity.
_BOUND_BOX: dict[int, tuple[BaseChatModel, tuple[int, ...], Runnable[Any, Any]]] = {}


def bound_model(
    link: Provider, tools: Sequence[BaseTool], model: BaseChatModel | None = None
) -> Runnable[Any, Any]:
    """``link.model`` (or ``model``, a box's own) with ``tools`` bound, built once per model and tool list."""
    key = tuple(id(tool) for tool in tools)
    if model is not None:
        known = _BOUND_BOX.get(id(model))
        if known is not None and known[0] is model and known[1] == key:
            return known[2]
        bound: Runnable[Any, Any] = model.bind_tools(list(tools)) if tools else model
        _BOUND_BOX[id(model)] = (model, key, bound)
        return bound
    cached = _BOUND.get(link)
    if cached is not None and cached[0] == key:
        return cached[1]
    bound = link.model.bind_tools(list(tools)) if tools else link.model
    _BOUND[link] = (key, bound)
    return bound


def request_kwargs(link: Provider, call: Ask, placement: Placement, bounds: Bounds) -> dict[str, Any]:
    """The model-call arguments of one attempt on ``link``: budget, slot, body fields, headers."""
    kwargs: dict[str, Any] = dict(call.kwargs)
    max_tokens = bounds.max_tokens.get(link.id, call.max_tokens)
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    body = placement.body(link.leg) or {}
    if link.openai_wire:
        body |= call.body
        if placement.headers:
            kwargs["extra_headers"] = dict(placement.headers)
    if body:
        own = getattr(link.model, "extra_body", None)  # a call's extra_body replaces the model's
        kwargs["extra_body"] = {**own, **body} if isinstance(own, dict) else body
    return kwargs


def call_config(call: Ask, link: Provider) -> RunnableConfig:
    """The run's config with this call's tags and metadata (leg, kind, step, score, provider)."""
    decision = call.decision
    score = decision.score.score if decision.score is not None else None
    metadata: dict[str, Any] = {
        "fusion_leg": link.leg,
        "fusion_routed_leg": decision.leg,
        "fusion_kind": call.kind,
        "fusion_step": call.step,
        "fusion_score": score,
        "fusion_threshold": decision.threshold,
        "fusion_provider": link.id,
    }
    # What ``merge_configs`` makes of these three keys, at a sixth of its cost (it runs at every
    # inference): ``ensure_config`` already returns a fresh dict with its own tags list and metadata.
    config = ensure_config(call.config)
    config["tags"] = sorted(
        {*config.get("tags", ()), f"fusion:leg={link.leg}", f"fusion:kind={call.kind}", *call.tags}
    )
    config["metadata"] = {**config.get("metadata", {}), **metadata}
    config["run_name"] = f"{call.kind}:{link.leg}"
    return config


def decision_event(call: Ask, slot: int | None) -> dict[str, Any]:
    """The ``fusion_route`` event sent before an inference: where it is going and why."""
    decision = call.decision
    return {
        "event": ROUTE_EVENT,
        "phase": "decision",
        "turn": call.turn,
        "step": call.step,
        "kind": call.kind,
        "routed_leg": decision.leg,
        "score": decision.score.score if decision.score is not None else None,
        "threshold": decision.threshold,
        "reason": decision.reason,
        "slot": slot,
    }


async def _model_call(
    model: Runnable[Any, Any],
    prompt: Sequence[BaseMessage],
    config: RunnableConfig,
    link: Provider,
    timeout_s: float | None,
    kwargs: Mapping[str, Any],
) -> AIMessage:
    """One model call within ``timeout_s``; a response the model cannot parse is a ``MalformedAnswer``.

    ``kwargs`` go to the model's ``ainvoke``, as ``model.bind(**kwargs)`` would send them.
    """
    return await within(model.ainvoke(list(prompt), config=config, **kwargs), link, timeout_s)


def timeout_text(provider: str, timeout_s: float | None, *, local: bool = False) -> str:
    """What a request that outlasted its bound says: the variable that sets it, its value, the fixes.

    The setting's name alone (``request_timeout``) is not what an operator types;
    a slow local model (a CPU box) is the usual cause, so the message names
    ``FUSION_REQUEST_TIMEOUT`` with its current value, and the other fixes.
    """
    if timeout_s is None:
        head = f"{provider} gave no answer within its client's own timeout (no request_timeout bound it)"
        fixes = "raise the model client's timeout, or lower max_completion_tokens"
    else:
        head = f"{provider} gave no answer within request_timeout={timeout_s:g} s"
        fixes = f"raise FUSION_REQUEST_TIMEOUT (now {timeout_s:g}), or lower max_completion_tokens"
    cpu = " (llama-server on CPU: also try fewer threads, -t)" if local else ""
    return f"{head}: {fixes}{cpu}"


async def within(answering: Awaitable[Any], link: Provider, timeout_s: float | None) -> AIMessage:
    """``answering`` within ``timeout_s``; a response the model cannot parse is a ``MalformedAnswer``."""
    try:
        async with asyncio.timeout(timeout_s):
            answer = await answering
    except (TimeoutError, openai.APITimeoutError) as error:
        raise TimeoutError(timeout_text(link.id, timeout_s, local=link.leg == "local")) from error
    except (IndexError, ValidationError) as error:
        raise MalformedAnswer(
            f"{link.id} answered something that is not a chat completion ({type(error).__name__}: {error})"
        ) from error
    return answer if isinstance(answer, AIMessage) else AIMessage(content=answer.content)


#: The decision of a priming request: a slot's housekeeping, not a step (never recorded).
PRIMING = RouteDecision("local", None, None, "prime the reserved slot")


async def prime_slot(link: Provider, placement: Placement, text: str, timeout_s: float | None) -> None:
    """A one-token request of ``text`` on ``placement``'s slot, built as every attempt is; unrecorded.

    Kept out of the run's callbacks and streams: it answers nothing the caller asked.

    Raises:
        Exception: Whatever the call raised (the caller decides whether priming matters).
    """
    call = Ask(
        kind="memory",
        turn=0,
        step=0,
        decision=PRIMING,
        prompt=(HumanMessage(text),),
        thread_id="",
        kwargs={"temperature": 0},
        max_tokens=1,
    )
    kwargs = request_kwargs(link, call, placement, Bounds())
    config: RunnableConfig = {"callbacks": [], "tags": ["nostream"], "run_name": "prime:local"}
    await _model_call(placement.model or link.model, call.prompt, config, link, timeout_s, kwargs)


class _Walk:
    """The links an inference may still try: the bounds' own, and after an overflow only larger ones."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.overflowed: int | None = None

    def saw(self, attempt: Attempt) -> None:
        if attempt.kind == "context_overflow":
            window = self.bounds.windows.get(attempt.provider) or 0
            self.overflowed = max(self.overflowed or 0, window)

    def fits(self, link: Provider) -> bool:
        if self.bounds.allowed is not None and link.id not in self.bounds.allowed:
            return False
        if self.overflowed is None:
            return True
        window = self.bounds.windows.get(link.id)
        return window is not None and window > self.overflowed


async def ask(
    call: Ask,
    *,
    chain: ProviderChain,
    placer: Placer,
    bounds: Bounds | None = None,
    writer: Writer | None = None,
    around: Around | None = None,
) -> Asked:
    """Make ``call`` through ``chain``, starting at its decision's leg, and record it.

    The routed leg is only the preferred starting link: when it fails the
    chain falls over (possibly to the other leg) and the record says so. Links
    outside ``bounds.allowed`` are never tried; a context overflow walks on to
    a link with a larger window. ``writer`` gets the decision and outcome
    events; ``around`` wraps each model call (a memory job's slot priming).

    Raises:
        ProviderRequestError: The request itself was refused (it would fail on any provider).
    """
    bounds = bounds or Bounds()
    decision = call.decision
    placements: dict[str, Placement] = {}
    started_ns = time.time_ns() if telemetry.ACTIVE.on else 0

    async def placed(link: Provider) -> Placement:
        if link.leg != "local":
            return NOWHERE
        known = placements.get(link.id)
        if known is None:
            known = placements[link.id] = await placer.place(link, call.thread_id, reflection=call.reflection)
        return known

    if writer is not None:
        routed = next((link for link in chain.links if link.leg == decision.leg), None)
        planned = await placed(routed) if routed is not None else NOWHERE
        writer(decision_event(call, planned.slot))

    sent: dict[str, Placement] = {}

    async def invoke(link: Provider) -> AIMessage:
        while True:
            placement = await placed(link)
            try:
                # The slot is named only inside its turn (no other request runs on it meanwhile).
                async with placement.hold() as held:
                    sent[link.id] = held
                    kwargs = request_kwargs(link, call, held, bounds)
                    once = _once(link, held, kwargs)
                    return await (around(link, held, once) if around is not None else once())
            except Exception as error:
                if link.leg == "local" and placer.unreachable(placement, error):
                    placements.pop(link.id, None)  # its box is down: placed again on one that answers
                    continue
                raise

    def _once(link: Provider, held: Placement, kwargs: dict[str, Any]) -> Callable[[], Awaitable[AIMessage]]:
        send = call.send

        def once() -> Awaitable[AIMessage]:
            if send is not None:
                return within(send(held.model or link.model, kwargs), link, bounds.timeout_s)
            model = bound_model(link, call.tools, held.model)
            return _model_call(model, call.prompt, call_config(call, link), link, bounds.timeout_s, kwargs)

        return once

    walk = _Walk(bounds)
    try:
        outcome = await chain.call(
            invoke,
            preferred_leg=decision.leg,
            prefer_provider=call.prefer_provider,
            on_attempt=walk.saw,
            fits=walk.fits,
        )
    except ChainExhausted as exhausted:
        record = make_record(
            turn=call.turn,
            step=call.step,
            kind=call.kind,
            decision=decision,
            signals=call.signals,
            attempts=exhausted.attempts,
            **joined({"outcome": {"status": "exhausted", "retry_in_s": exhausted.retry_in_s}}, call.parts),
        )
        if writer is not None:
            writer({"event": ROUTE_EVENT, "phase": "outcome", **record})
        if telemetry.ACTIVE.on:
            _report(call, chain, record, None, started_ns)
        return Asked(None, record, exhausted)
    link = outcome.provider
    placement = sent.get(link.id, NOWHERE)
    sizing = SizingRecord()
    estimate = bounds.estimates.get(link.leg)
    if estimate is not None:
        sizing |= {"estimate": estimate.tokens, "estimate_basis": estimate.basis}
    if link.id in bounds.windows:
        sizing["window"] = bounds.windows[link.id]
    if link.id in bounds.max_tokens:
        sizing["max_tokens"] = bounds.max_tokens[link.id]
    parts = RecordParts(sizing=sizing)
    if placement.notes:
        parts["placement"] = placement.notes
    record = answered_record(
        outcome,
        turn=call.turn,
        step=call.step,
        kind=call.kind,
        decision=decision,
        signals=call.signals,
        slot=placement.slot if placement.body(link.leg) is not None else None,
        parts=joined(parts, call.parts),
    )
    if writer is not None:
        writer({"event": ROUTE_EVENT, "phase": "outcome", **record})
    if telemetry.ACTIVE.on:
        _report(call, chain, record, outcome.answer, started_ns)
    return Asked(outcome.answer, record)


def all_cloud_cost(record: RouteRecord, chain: ProviderChain) -> float | None:
    """What a priced inference would have cost on the chain's first cloud link (its own cost on cloud).

    A local inference is priced from its reported tokens at the cloud link's prices,
    cached tokens credited as the report's all-cloud figure credits them.
    """
    if record["cost_usd"] is None:
        return None
    if not in_all_cloud_baseline(record):
        return 0.0
    if record["leg"] == "cloud":
        return record["cost_usd"]
    cloud, prompt, completion = chain.first_cloud, record["prompt_tokens"], record["completion_tokens"]
    if cloud is None or prompt is None or completion is None:
        return None
    return price(cloud.pricing, prompt, min(record["cached_tokens"] or 0, prompt), completion)


def _report(
    call: Ask, chain: ProviderChain, record: RouteRecord, answer: AIMessage | None, started_ns: int
) -> None:
    """Hand one inference to the telemetry (metrics, a span), when it is on."""
    provider = record["provider"]
    link = chain.link(provider) if provider is not None else None
    if link is None:
        link = next((x for x in chain.links if x.leg == call.decision.leg), None)
    model = str(getattr(link.model, "model_name", None) or link.id) if link is not None else "unknown"
    metadata = answer.response_metadata if answer is not None else {}
    telemetry.inference(
        record,
        all_cloud_usd=all_cloud_cost(record, chain),
        started_ns=started_ns,
        model=model,
        response_model=metadata.get("model_name") or metadata.get("model"),
        thread_id=call.thread_id or None,
    )


def answered_record(
    outcome: ChainOutcome[AIMessage],
    *,
    turn: int,
    step: int,
    kind: StepKind,
    decision: RouteDecision,
    signals: StepSignals | None,
    slot: int | None,
    parts: RecordParts | None = None,
) -> RouteRecord:
    """The record of an inference the chain got an answer for, priced at the answering provider."""
    link = outcome.provider
    record = make_record(
        turn=turn,
        step=step,
        kind=kind,
        leg=link.leg,
        decision=decision,
        signals=signals,
        provider=link.id,
        answer=outcome.answer,
        slot=slot,
        attempts=outcome.attempts,
        **joined(
            RecordParts(outcome={"probe": outcome.probe, "latency_s": round(outcome.latency_s, 4)}),
            parts or {},
        ),
    )
    record["cost_usd"] = price(
        link.pricing, record["prompt_tokens"], record["cached_tokens"], record["completion_tokens"]
    )
    return record
