"""The provider chain: who answers a step when the routed provider cannot.

Providers (``ChainLink``) sit in one ordered list across both legs, each with a
circuit (``Health``): failures within a window put it in cooldown, the first
use after the cooldown is a probe (half-open), and the probe closes or
re-opens the circuit. A call's start is, in order: ``prefer_provider``
(repairs), the first link of ``preferred_leg`` (the router), the operator's
override, the first available link; a start in cooldown, or one whose window
cannot hold the request (``fits``), is skipped. So the
routed leg beats the override, which is only the default start, and a routed
call never touches the override. On a failure the walk resumes from the head,
skipping links that already failed in this call: local down runs on cloud and
vice versa, and a request that overflowed a window walks on to a larger one.
A half-open link used as a preferred start is probed (its circuit learns
from the call) but not *reported* as a probe: ``probe`` says the chain's
health logic, not the router, chose the link.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, cast

from langchain_core.messages import AIMessage
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from fusion_graph.errors import ChainExhausted, Closed, ProviderRequestError, UnknownProvider, UsageError
from fusion_graph.providers.health import (
    HEALTH_FAILURES,
    NO_FALLOVER,
    RETRY_IN_PLACE,
    Health,
    HealthPolicy,
    HealthState,
    RetryPolicy,
    classify,
    error_text,
    overflow_numbers,
    retry_after,
)
from fusion_graph.providers.links import ChainLink
from fusion_graph.redact import scrub, scrub_content
from fusion_graph.routing.records import Attempt
from fusion_graph.routing.score import Leg

logger = logging.getLogger(__name__)
T = TypeVar("T")
Clock = Callable[[], float]


@dataclass(frozen=True)
class ChainOutcome(Generic[T]):
    """A call that got an answer: who gave it, and which attempts failed before it.

    ``preferred``: the answer came from the preferred start. ``probe``: the
    chain's health logic picked a half-open link (never a preferred start).
    """

    provider: ChainLink
    answer: T
    attempts: tuple[Attempt, ...]
    probe: bool
    preferred: bool
    latency_s: float


def _any_link(link: ChainLink) -> bool:
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


def board_key(link: ChainLink) -> str:
    """A link as every worker process names it: its id and endpoint."""
    return f"{link.id}@{link.as_provider().base_url or ''}"


class ProviderChain:
    """Ordered providers across both legs: health, fallover, an operator override and lifecycle.

    Links are reference-counted: ``acquire``/``release`` (or ``hold``) pin one,
    an in-flight call holds the link it calls, and a link is closed exactly once,
    when it has left the chain (``replace``, ``aclose``) and nothing holds it.
    """

    def __init__(
        self,
        links: Sequence[ChainLink],
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
        self._links: list[ChainLink] = []
        self._health: dict[ChainLink, Health] = {}
        self._holds: dict[ChainLink, int] = {}
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

    def _install(self, links: Sequence[ChainLink]) -> list[ChainLink]:
        ids = [link.id for link in links]
        if len(set(ids)) != len(ids):
            raise UsageError(f"provider ids must be unique in a chain, got {ids}")
        removed = [link for link in self._links if link not in links]
        self._links = list(links)
        self._health = {link: self._health.get(link) or Health(self._policy) for link in links}
        self._override = self._override if self._override in ids else None
        return removed

    @property
    def links(self) -> tuple[ChainLink, ...]:
        """The links in chain order."""
        return tuple(self._links)

    @property
    def override(self) -> str | None:
        """The operator's pinned default start, if any."""
        return self._override

    def link(self, provider_id: str) -> ChainLink:
        """The link called ``provider_id``; ``KeyError`` when it is not in the chain."""
        for link in self._links:
            if link.id == provider_id:
                return link
        raise UnknownProvider(f"no provider {provider_id!r} in the chain ({[x.id for x in self._links]})")

    @property
    def first_cloud(self) -> ChainLink | None:
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

    def acquire(self, provider_id: str) -> ChainLink:
        """Pin a link (e.g. the router's pick for a leg) so no swap closes it; pair with ``release``."""
        if self._closed:
            raise Closed("the provider chain is closed")
        link = self.link(provider_id)
        self._holds[link] = self._holds.get(link, 0) + 1
        return link

    async def release(self, link: ChainLink) -> None:
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
    async def hold(self, provider_id: str) -> AsyncIterator[ChainLink]:
        """``acquire``/``release`` as an async context manager."""
        link = self.acquire(provider_id)
        try:
            yield link
        finally:
            await self.release(link)

    async def replace(self, links: Sequence[ChainLink]) -> None:
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

    async def _close(self, links: Sequence[ChainLink]) -> None:
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
        self, leg: Leg | None, provider_id: str | None, fits: Callable[[ChainLink], bool]
    ) -> tuple[ChainLink | None, bool]:
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

    def _next(self, failed: set[ChainLink], fits: Callable[[ChainLink], bool]) -> ChainLink | None:
        now = self._clock()
        return next(
            (x for x in self._links if x not in failed and fits(x) and self._health[x].available(now)), None
        )

    async def call(
        self,
        invoke: Callable[[ChainLink], Awaitable[T]],
        *,
        preferred_leg: Leg | None = None,
        prefer_provider: str | None = None,
        on_attempt: Callable[[Attempt], None] | None = None,
        fits: Callable[[ChainLink], bool] | None = None,
    ) -> ChainOutcome[T]:
        """Run ``invoke`` on the chain's providers until one answers.

        Args:
            invoke: Makes the inference on the given link (e.g. with ``link.model``).
            preferred_leg: The router's leg; the walk starts at that leg's first link.
            prefer_provider: A provider id to start at before that (repairs).
            on_attempt: Called with each failed attempt as it happens.
            fits: Whether a link can hold the request (``fit.fits``); links that cannot are
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
        failed: set[ChainLink] = set()
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
        link: ChainLink,
        invoke: Callable[[ChainLink], Awaitable[T]],
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

    async def _announce(self, link: ChainLink, health: Health) -> None:
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

    def _failed(
        self, link: ChainLink, health: Health, error: Exception, start: float, probe: bool
    ) -> Attempt:
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
