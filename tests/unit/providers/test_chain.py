"""The provider chain: error classes, walks, cooldowns, probes, overrides and lifecycle."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from datetime import UTC, datetime
from email.utils import format_datetime
from typing import Any

import openai
import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatResult
from langchain_openai import ChatOpenAI

from fusion_graph.errors import ChainExhausted, ProviderRequestError
from fusion_graph.providers.chain import HealthPolicy, ProviderChain, RetryPolicy
from fusion_graph.providers.models import Provider, close_chat_model, owned_clients
from fusion_graph.providers.pricing import FREE, Pricing
from fusion_graph.routing.records import Attempt
from fusion_graph.routing.score import Leg
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.errors import (
    EPOCH,
    URL,
    bad_request,
    llama_overflow,
    rate_limited,
    refused,
    request,
    response,
)

# Fakes ------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        return EPOCH + self.now


class TearDownModel(GenericFakeChatModel):
    """A chat model whose close really tears it down: later calls raise."""

    torn_down: bool = False
    closes: int = 0

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        if self.torn_down:
            raise RuntimeError("model used after close")
        return super()._generate(messages, *args, **kwargs)


async def tear_down(model: Any) -> None:
    model.closes += 1
    model.torn_down = True


def answers() -> Iterator[AIMessage]:
    while True:
        yield AIMessage(content="ok")


def link(provider_id: str, leg: Leg, pricing: Pricing | None = None) -> Provider:
    model = TearDownModel(messages=answers())
    return Provider(provider_id, leg, model, pricing or Pricing.flat(FREE), close=tear_down)


class Script:
    """``invoke`` for the chain: each provider raises its queued errors, then answers its id."""

    def __init__(self, **errors: list[BaseException]) -> None:
        self.errors = {key.replace("_", ":"): list(value) for key, value in errors.items()}
        self.calls: list[str] = []

    async def __call__(self, chosen: Provider) -> str:
        self.calls.append(chosen.id)
        queue = self.errors.get(chosen.id, [])
        if queue:
            raise queue.pop(0)
        return f"answer from {chosen.id}"


def make_chain(*ids: str, clock: FakeClock | None = None, **kwargs: Any) -> ProviderChain:
    clock = clock or FakeClock()
    links = [link(i, "local" if i.startswith("local") else "cloud") for i in ids]
    return ProviderChain(links, clock=clock, wall_clock=clock.wall, **kwargs)


TRIP_AT_ONCE = HealthPolicy(allowed_failures=0, window_s=60, cooldown_s=30)


# Walks ------------------------------------------------------------------------


async def test_no_preference_starts_at_the_head() -> None:
    chain, script = make_chain("cloud:a", "local:b"), Script()
    outcome = await chain.call(script)
    assert (outcome.provider.id, outcome.answer, outcome.preferred, outcome.probe) == (
        "cloud:a",
        "answer from cloud:a",
        False,
        False,
    )
    assert outcome.attempts == ()


async def test_preferred_leg_starts_at_that_legs_first_link() -> None:
    chain, script = make_chain("cloud:a", "local:b", "local:c"), Script()
    outcome = await chain.call(script, preferred_leg="local")
    assert (outcome.provider.id, outcome.preferred) == ("local:b", True)
    assert script.calls == ["local:b"]


async def test_prefer_provider_for_repairs() -> None:
    chain, script = make_chain("cloud:a", "local:b", "local:c"), Script()
    outcome = await chain.call(script, preferred_leg="local", prefer_provider="local:c")
    assert outcome.provider.id == "local:c"
    unknown = await chain.call(script, preferred_leg="local", prefer_provider="local:gone")
    assert unknown.provider.id == "local:b"


async def test_failure_resumes_from_the_head_skipping_failed_links() -> None:
    chain = make_chain("cloud:a", "cloud:b", "local:c")
    script = Script(local_c=[refused()], cloud_a=[openai.APITimeoutError(request=request())])
    outcome = await chain.call(script, preferred_leg="local")
    assert script.calls == ["local:c", "cloud:a", "cloud:b"]
    assert outcome.provider.id == "cloud:b"
    assert not outcome.preferred
    assert [(a.provider, a.kind, a.health_failure) for a in outcome.attempts] == [
        ("local:c", "connection", True),
        ("cloud:a", "timeout", True),
    ]


async def test_fallover_crosses_legs_both_ways() -> None:
    chain = make_chain("cloud:a", "local:b")
    local_down = await chain.call(Script(local_b=[refused()]), preferred_leg="local")
    assert local_down.provider.leg == "cloud"
    cloud_down = await chain.call(Script(cloud_a=[rate_limited()]), preferred_leg="cloud")
    assert cloud_down.provider.leg == "local"


async def test_on_attempt_sees_each_failure_as_it_happens() -> None:
    seen: list[Attempt] = []
    chain = make_chain("cloud:a", "local:b")
    await chain.call(Script(local_b=[refused()]), preferred_leg="local", on_attempt=seen.append)
    assert [(a.provider, a.leg, a.error) for a in seen] == [("local:b", "local", "ConnectError")]


async def test_latency_is_measured_with_the_injected_clock() -> None:
    clock = FakeClock()
    chain = make_chain("cloud:a", "local:b", clock=clock)

    async def slow_local(chosen: Provider) -> str:
        clock.now += 2.0
        if chosen.leg == "local":
            raise refused()
        return "ok"

    outcome = await chain.call(slow_local, preferred_leg="local")
    assert outcome.attempts[0].latency_s == 2.0
    assert outcome.latency_s == 4.0


# Override ---------------------------------------------------------------------


async def test_override_is_the_default_start_and_routed_calls_never_touch_it() -> None:
    chain, script = make_chain("cloud:a", "local:b"), Script()
    chain.set_override("local:b")
    assert (await chain.call(script)).provider.id == "local:b"
    routed = await chain.call(script, preferred_leg="cloud")
    assert (routed.provider.id, routed.preferred) == ("cloud:a", True)
    assert chain.override == "local:b"
    chain.set_override(None)
    assert (await chain.call(script)).provider.id == "cloud:a"
    with pytest.raises(KeyError):
        chain.set_override("cloud:nope")


async def test_override_in_cooldown_lets_health_decide() -> None:
    chain = make_chain("cloud:a", "local:b", policy=TRIP_AT_ONCE)
    chain.set_override("local:b")
    await chain.call(Script(local_b=[refused()]))
    outcome = await chain.call(Script())
    assert outcome.provider.id == "cloud:a"
    assert chain.override == "local:b"


# Cooldown and probes ----------------------------------------------------------


async def test_a_preferred_link_in_cooldown_is_skipped() -> None:
    chain = make_chain("cloud:a", "local:b", policy=TRIP_AT_ONCE)
    await chain.call(Script(local_b=[refused()]), preferred_leg="local")
    script = Script()
    outcome = await chain.call(script, preferred_leg="local")
    assert script.calls == ["cloud:a"]
    assert (outcome.provider.id, outcome.preferred) == ("cloud:a", False)


async def test_failures_are_counted_per_window() -> None:
    clock = FakeClock()
    policy = HealthPolicy(allowed_failures=2, window_s=60, cooldown_s=30)
    chain = make_chain("local:b", "cloud:a", clock=clock, policy=policy)
    for at in (0.0, 30.0, 70.0):  # the failure at 0 has left the window by 70
        clock.now = at
        await chain.call(Script(local_b=[refused()]))
        assert chain.health("local:b").state(clock.now) == "healthy"
    clock.now = 80.0  # failures at 30, 70 and 80 are inside one window: trip
    await chain.call(Script(local_b=[refused()]))
    health = chain.health("local:b")
    assert (health.state(80.0), health.cooldown_until) == ("cooldown", 110.0)
    assert health.last_error == "ConnectError: connection refused"


async def test_cooldown_then_health_driven_probe_restores() -> None:
    clock = FakeClock()
    chain = make_chain("local:b", "cloud:a", clock=clock, policy=TRIP_AT_ONCE)
    await chain.call(Script(local_b=[refused()]))
    clock.now = 29.9
    assert (await chain.call(Script())).provider.id == "cloud:a"
    clock.now = 30.0
    probe = await chain.call(Script())
    assert (probe.provider.id, probe.probe, probe.preferred) == ("local:b", True, False)
    assert chain.health("local:b").state(clock.now) == "healthy"
    after = await chain.call(Script())
    assert (after.provider.id, after.probe) == ("local:b", False)


async def test_a_failed_probe_restarts_the_cooldown() -> None:
    clock = FakeClock()
    chain = make_chain("local:b", "cloud:a", clock=clock, policy=TRIP_AT_ONCE)
    await chain.call(Script(local_b=[refused()]))
    clock.now = 40.0
    outcome = await chain.call(Script(local_b=[refused()]))
    assert (outcome.provider.id, outcome.probe) == ("cloud:a", False)
    assert outcome.attempts[0].probe
    assert chain.health("local:b").cooldown_until == 70.0


async def test_a_preferred_start_is_never_reported_as_a_probe() -> None:
    clock = FakeClock()
    chain = make_chain("cloud:a", "local:b", clock=clock, policy=TRIP_AT_ONCE)
    await chain.call(Script(local_b=[refused()]), preferred_leg="local")
    clock.now = 31.0
    outcome = await chain.call(Script(), preferred_leg="local")
    assert (outcome.provider.id, outcome.preferred, outcome.probe) == ("local:b", True, False)
    assert chain.health("local:b").state(clock.now) == "healthy"  # it still closed the circuit


async def test_only_one_probe_at_a_time() -> None:
    clock = FakeClock()
    chain = make_chain("local:b", "cloud:a", clock=clock, policy=TRIP_AT_ONCE)
    await chain.call(Script(local_b=[refused()]))
    clock.now = 30.0
    gate = asyncio.Event()

    async def blocked(chosen: Provider) -> str:
        if chosen.id == "local:b":
            await gate.wait()
        return chosen.id

    probing = asyncio.create_task(chain.call(blocked))
    await asyncio.sleep(0)
    other = await chain.call(blocked, preferred_leg="local")
    assert other.provider.id == "cloud:a"
    gate.set()
    assert (await probing).probe


async def test_rate_limit_cools_down_at_once_for_retry_after() -> None:
    clock = FakeClock()
    chain = make_chain("cloud:a", "local:b", clock=clock, policy=HealthPolicy(allowed_failures=5))
    outcome = await chain.call(Script(cloud_a=[rate_limited({"retry-after": "7"})]))
    assert outcome.attempts[0].retry_after_s == 7.0
    assert outcome.provider.id == "local:b"
    clock.now = 6.9
    assert (await chain.call(Script())).provider.id == "local:b"
    clock.now = 7.0
    assert (await chain.call(Script())).provider.id == "cloud:a"


async def test_rate_limit_honours_an_http_date_and_caps_it() -> None:
    clock = FakeClock()
    policy = HealthPolicy(allowed_failures=5, cooldown_s=30, max_retry_after_s=100)
    chain = make_chain("cloud:a", "local:b", clock=clock, policy=policy)
    date = format_datetime(datetime.fromtimestamp(EPOCH + 45, UTC), usegmt=True)
    await chain.call(Script(cloud_a=[rate_limited({"retry-after": date})]))
    assert chain.health("cloud:a").cooldown_until == 45.0
    clock.now = 50.0
    await chain.call(Script(cloud_a=[rate_limited({"retry-after": "86400"})]))
    assert chain.health("cloud:a").cooldown_until == 150.0
    clock.now = 200.0
    await chain.call(Script(cloud_a=[rate_limited()]))
    assert chain.health("cloud:a").cooldown_until == 230.0


async def test_a_503_with_retry_after_cools_down_at_once() -> None:
    chain = make_chain("cloud:a", "local:b", policy=HealthPolicy(allowed_failures=5))
    busy = openai.InternalServerError("busy", response=response(503, {"retry-after": "9"}), body=None)
    await chain.call(Script(cloud_a=[busy]))
    assert chain.health("cloud:a").cooldown_until == 9.0
    boom = openai.InternalServerError("boom", response=response(500), body=None)
    with pytest.raises(ChainExhausted):  # cloud is still cooling down
        await chain.call(Script(local_b=[boom]), preferred_leg="local")
    local = chain.health("local:b")
    assert (local.state(0.0), len(local.failures)) == ("healthy", 1)  # counted, not yet tripped


async def test_unknown_errors_are_reraised_without_hurting_health() -> None:
    chain = make_chain("cloud:a", "local:b", policy=TRIP_AT_ONCE)
    script = Script(local_b=[RuntimeError("a bug in the caller")])
    with pytest.raises(RuntimeError, match="a bug in the caller"):
        await chain.call(script, preferred_leg="local")
    assert script.calls == ["local:b"], "an unknown error must not be hidden behind a fallover"
    assert chain.health("local:b").state(0.0) == "healthy"


async def test_malformed_response_fails_over_and_counts_against_health() -> None:
    chain = make_chain("cloud:a", "local:b", policy=TRIP_AT_ONCE)
    bad_json = json.JSONDecodeError("Expecting value", "{not json", 1)
    outcome = await chain.call(Script(local_b=[bad_json]), preferred_leg="local")
    assert outcome.provider.id == "cloud:a"
    assert (outcome.attempts[0].kind, outcome.attempts[0].health_failure) == ("malformed_response", True)
    assert chain.health("local:b").state(0.0) == "cooldown"


# Bad requests and exhaustion --------------------------------------------------


async def test_bad_request_is_raised_as_our_own_error_not_failed_over() -> None:
    seen: list[Attempt] = []
    chain = make_chain("cloud:a", "local:b", policy=TRIP_AT_ONCE)
    error = bad_request()
    script = Script(local_b=[error])
    with pytest.raises(ProviderRequestError) as raised:
        await chain.call(script, preferred_leg="local", on_attempt=seen.append)
    assert raised.value.error_type == "BadRequestError" and raised.value.kind == "bad_request"
    assert raised.value.__cause__ is None and raised.value.__context__ is None, "no raw provider error"
    assert script.calls == ["local:b"]
    assert [(a.kind, a.health_failure) for a in seen] == [("bad_request", False)]
    assert any("local:b" in note for note in raised.value.__notes__)
    assert chain.health("local:b").state(0.0) == "healthy"


async def test_links_that_cannot_hold_the_request_are_skipped_like_cooling_ones() -> None:
    chain, script = make_chain("cloud:a", "local:b", "local:c"), Script()
    outcome = await chain.call(script, preferred_leg="local", fits=lambda x: x.id != "local:b")
    assert (outcome.provider.id, outcome.preferred) == ("local:c", True), "the first local link that fits"
    script = Script()
    outcome = await chain.call(script, preferred_leg="local", fits=lambda x: x.leg == "cloud")
    assert (outcome.provider.id, outcome.preferred, script.calls) == ("cloud:a", False, ["cloud:a"])
    chain.set_override("local:b")
    outcome = await chain.call(Script(), fits=lambda x: x.id != "local:b")
    assert outcome.provider.id == "cloud:a", "an override that cannot hold the request is not the start"


async def test_a_context_overflow_walks_on_without_hurting_health() -> None:
    seen: list[Attempt] = []
    chain = make_chain("local:b", "cloud:a", policy=TRIP_AT_ONCE)
    script = Script(local_b=[llama_overflow()])
    outcome = await chain.call(script, preferred_leg="local", on_attempt=seen.append)
    assert outcome.provider.id == "cloud:a"
    assert [(a.kind, a.health_failure, a.prompt_tokens) for a in seen] == [("context_overflow", False, 4019)]
    assert chain.health("local:b").state(0.0) == "healthy", "a too-large request is not the server's fault"


async def test_fits_is_asked_again_after_each_failure() -> None:
    overflowed: list[str] = []
    chain = make_chain("local:b", "cloud:a", "cloud:z")
    script = Script(local_b=[llama_overflow()])

    def fits(link: Provider) -> bool:  # after an overflow, only the larger window is tried
        return not overflowed or link.id == "cloud:z"

    outcome = await chain.call(
        script, preferred_leg="local", on_attempt=lambda a: overflowed.append(a.provider), fits=fits
    )
    assert (outcome.provider.id, script.calls) == ("cloud:z", ["local:b", "cloud:z"])


async def test_nothing_that_fits_is_exhausted_without_calling() -> None:
    script = Script()
    with pytest.raises(ChainExhausted):
        await make_chain("cloud:a", "local:b").call(script, fits=lambda x: False)
    assert script.calls == []


async def test_every_provider_failing_raises_chain_exhausted() -> None:
    chain = make_chain("cloud:a", "local:b", policy=TRIP_AT_ONCE)
    last = refused()
    script = Script(cloud_a=[rate_limited({"retry-after": "12"})], local_b=[last])
    with pytest.raises(ChainExhausted) as raised:
        await chain.call(script, preferred_leg="cloud")
    error = raised.value
    assert [a.provider for a in error.attempts] == ["cloud:a", "local:b"]
    assert error.__cause__ is None and error.__suppress_context__  # raw provider errors may hold keys
    assert "connection refused" in str(last) and "connection refused" in str(error)
    assert error.retry_in_s == 12.0
    message = str(error)
    assert "cloud:a (cloud): RateLimitError [rate_limited]" in message
    assert "back in 12.0s" in message
    assert "local:b (local): ConnectError [connection]" in message
    assert "back in 30.0s" in message


async def test_everything_cooling_down_raises_without_calling() -> None:
    chain = make_chain("cloud:a", "local:b", policy=TRIP_AT_ONCE)
    with pytest.raises(ChainExhausted):
        await chain.call(Script(cloud_a=[refused()], local_b=[refused()]))
    script = Script()
    with pytest.raises(ChainExhausted) as raised:
        await chain.call(script, preferred_leg="local")
    assert script.calls == []
    assert raised.value.attempts == ()
    assert "not tried (last error: ConnectError: connection refused)" in str(raised.value)


async def test_an_empty_chain_is_exhausted() -> None:
    with pytest.raises(ChainExhausted, match="empty"):
        await ProviderChain([]).call(Script())


# In-place retries -------------------------------------------------------------


async def test_no_in_place_retry_by_default() -> None:
    chain = make_chain("cloud:a", "local:b")
    script = Script(local_b=[openai.APITimeoutError(request=request())])
    outcome = await chain.call(script, preferred_leg="local")
    assert script.calls == ["local:b", "cloud:a"]
    assert outcome.provider.id == "cloud:a"


async def test_in_place_retry_with_tenacity_backoff() -> None:
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    chain = make_chain("cloud:a", "local:b", retry=RetryPolicy(attempts=2, jitter_s=0), sleep=sleep)
    script = Script(local_b=[openai.APITimeoutError(request=request()), refused()])
    outcome = await chain.call(script, preferred_leg="local")
    assert script.calls == ["local:b"] * 3
    assert outcome.provider.id == "local:b"
    assert len(outcome.attempts) == 2
    assert waits == [0.5, 1.0]


async def test_rate_limits_and_bad_requests_are_not_retried_in_place() -> None:
    chain = make_chain("cloud:a", "local:b", retry=RetryPolicy(attempts=3), sleep=lambda s: asyncio.sleep(0))
    script = Script(local_b=[rate_limited()])
    assert (await chain.call(script, preferred_leg="local")).provider.id == "cloud:a"
    assert script.calls == ["local:b", "cloud:a"]
    bad = Script(cloud_a=[bad_request()])
    with pytest.raises(ProviderRequestError, match="BadRequestError"):
        await chain.call(bad, preferred_leg="cloud")
    assert bad.calls == ["cloud:a"]


# Lifecycle --------------------------------------------------------------------


def torn(chain_link: Provider) -> tuple[int, bool]:
    model: Any = chain_link.model
    return model.closes, model.torn_down


async def test_a_pinned_provider_survives_a_swap_and_closes_once_on_release() -> None:
    chain = make_chain("cloud:a", "local:b")
    old_local = chain.acquire("local:b")  # e.g. the router pins its local leg
    new_local = link("local:b", "local")
    await chain.replace([chain.link("cloud:a"), new_local])
    assert torn(old_local) == (0, False)
    assert (await old_local.model.ainvoke("still works")).content == "ok"
    assert chain.link("local:b") is new_local
    await chain.release(old_local)
    assert torn(old_local) == (1, True)
    with pytest.raises(RuntimeError, match="after close"):
        await old_local.model.ainvoke("now it is gone")
    await chain.aclose()
    assert torn(old_local) == (1, True)
    assert torn(new_local) == (1, True)


async def test_an_unheld_provider_closes_as_soon_as_it_leaves() -> None:
    chain = make_chain("cloud:a", "local:b")
    gone, kept = chain.link("local:b"), chain.link("cloud:a")
    await chain.replace([kept])
    assert torn(gone) == (1, True)
    assert torn(kept) == (0, False)


async def test_switching_the_override_closes_nothing() -> None:
    chain = make_chain("cloud:a", "local:b")
    async with chain.hold("local:b") as held:
        chain.set_override("cloud:a")
        chain.set_override("local:b")
        assert torn(held) == (0, False)
    assert torn(held) == (0, False)  # released, but still in the chain


async def test_an_in_flight_call_keeps_its_provider_open() -> None:
    chain = make_chain("cloud:a", "local:b")
    gate = asyncio.Event()
    local = chain.link("local:b")

    async def slow(chosen: Provider) -> str:
        await gate.wait()
        return str((await chosen.model.ainvoke("hi")).content)

    task = asyncio.create_task(chain.call(slow, preferred_leg="local"))
    await asyncio.sleep(0)
    await chain.replace([chain.link("cloud:a")])
    assert torn(local) == (0, False)
    gate.set()
    assert (await task).answer == "ok"
    assert torn(local) == (1, True)


async def test_closed_chain_closes_held_links_on_release() -> None:
    chain = make_chain("cloud:a", "local:b")
    held = chain.acquire("cloud:a")
    await chain.aclose()
    assert torn(held) == (0, False)
    await chain.release(held)
    assert torn(held) == (1, True)
    with pytest.raises(RuntimeError, match="closed"):
        await chain.call(Script())
    with pytest.raises(RuntimeError, match="closed"):
        chain.acquire("cloud:a")


async def test_lifecycle_misuse_is_refused() -> None:
    chain = make_chain("cloud:a", "local:b")
    with pytest.raises(ValueError, match="not held"):
        await chain.release(chain.link("cloud:a"))
    with pytest.raises(ValueError, match="unique"):
        await chain.replace([link("cloud:a", "cloud"), link("cloud:a", "cloud")])
    with pytest.raises(KeyError):
        chain.acquire("local:zzz")


async def test_replace_keeps_health_of_kept_links_and_drops_a_departed_override() -> None:
    chain = make_chain("cloud:a", "local:b", policy=TRIP_AT_ONCE)
    await chain.call(Script(cloud_a=[refused()]))
    chain.set_override("local:b")
    await chain.replace([chain.link("cloud:a"), link("local:c", "local")])
    assert chain.health("cloud:a").state(0.0) == "cooldown"
    assert chain.override is None
    assert chain.leg_of("local:c") == "local"
    assert chain.leg_of("local:b") is None


async def test_default_closer_closes_owned_clients_only() -> None:
    owned_async, owned_sync = openai.DefaultAsyncHttpxClient(), openai.DefaultHttpxClient()
    own = ChatOpenAI(
        model="gpt-4o-mini", api_key="x", base_url=URL, http_async_client=owned_async, http_client=owned_sync
    )
    shared_a = ChatOpenAI(model="gpt-4o-mini", api_key="x", base_url="http://127.0.0.1:9/v1", timeout=5.0)
    shared_b = ChatOpenAI(model="gpt-4o", api_key="x", base_url="http://127.0.0.1:9/v1", timeout=5.0)
    assert shared_a.root_async_client._client is shared_b.root_async_client._client
    assert owned_clients(shared_a) == []
    await close_chat_model(own)
    await close_chat_model(shared_a)
    assert owned_async.is_closed and owned_sync.is_closed
    assert not shared_b.root_async_client._client.is_closed
    await close_chat_model(GenericFakeChatModel(messages=answers()))  # nothing to close


async def test_default_closer_closes_private_clients_of_an_unhashable_timeout() -> None:
    httpx2: Any = pytest.importorskip("httpx2")  # the client library openai>=3 builds on
    model = ChatOpenAI(model="gpt-4o-mini", api_key="x", base_url=URL, timeout=httpx2.Timeout(3.0))
    clients = owned_clients(model)
    assert clients == [model.root_async_client, model.root_client]
    await Provider("cloud:x", "cloud", model, Pricing()).aclose()
    assert model.root_async_client.is_closed() and model.root_client.is_closed()


def test_a_provider_is_priced_by_its_leg_and_reads_its_kind_and_base_url_once() -> None:
    cloud = ChatOpenAI(model="gpt-4o-mini", api_key="x")
    local = GenericFakeChatModel(messages=answers())
    cloud_link = Provider("cloud:gpt-4o-mini", "cloud", cloud)
    local_link = Provider("local:fake", "local", local)
    assert cloud_link.pricing == Pricing.catalog("gpt-4o-mini")
    assert local_link.pricing == Pricing.flat(FREE)
    served = Provider("local:served", "local", ChatOpenAI(model="q", api_key="x", base_url=URL))
    assert (cloud_link.base_url, local_link.base_url, served.base_url) == (None, None, URL)
    # The kind is read once, where the provider is made: only the OpenAI wire carries a slot's body.
    assert (cloud_link.openai_wire, local_link.openai_wire, served.openai_wire) == (True, False, True)
    assert cloud_link != Provider("cloud:gpt-4o-mini", "cloud", cloud)  # a rebuilt provider is a new one


# The real SDK against a loopback fake server ----------------------------------


async def test_real_chat_openai_errors_drive_the_chain() -> None:
    clock = FakeClock()
    with (
        FakeOpenAI([Reply(status=429, headers={"Retry-After": "5"})]) as cloud_server,
        FakeOpenAI() as local_server,
    ):

        def chat(model: str, server: FakeOpenAI, timeout: float = 5.0) -> ChatOpenAI:
            # max_retries=0: the SDK would otherwise retry 429/5xx/timeouts itself; the chain is the retry.
            return ChatOpenAI(
                model=model, api_key="x", base_url=server.base_url, timeout=timeout, max_retries=0
            )

        cloud = Provider("cloud:gpt-4o-mini", "cloud", chat("gpt-4o-mini", cloud_server), Pricing())
        local = Provider("local:qwen", "local", chat("qwen", local_server), Pricing.flat(FREE))
        chain = ProviderChain([cloud, local], clock=clock, wall_clock=clock.wall)

        async def invoke(chosen: Provider) -> Any:
            return await chosen.model.ainvoke("hi")

        outcome = await chain.call(invoke, preferred_leg="cloud")
        assert outcome.provider.id == "local:qwen"
        first = outcome.attempts[0]
        assert (first.error, first.kind, first.retry_after_s) == ("OpenAIRateLimitError", "rate_limited", 5.0)

        clock.now = 5.0
        cloud_server.script([Reply(status=400)])
        with pytest.raises(ProviderRequestError, match="BadRequestError"):
            await chain.call(invoke, preferred_leg="cloud")

        cloud_server.script([Reply(delay=1.0)])
        slow = Provider("cloud:slow", "cloud", chat("gpt-4o-mini", cloud_server, timeout=0.2), Pricing())
        await chain.replace([slow, local])
        outcome = await chain.call(invoke, preferred_leg="cloud")
        assert [(a.error, a.kind) for a in outcome.attempts] == [("OpenAITimeoutError", "timeout")]

    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        closed_url = f"http://127.0.0.1:{probe.getsockname()[1]}/v1"
    refused_model = ChatOpenAI(model="qwen", api_key="x", base_url=closed_url, timeout=5.0, max_retries=0)
    gone = Provider("local:gone", "local", refused_model, Pricing.flat(FREE))
    chain = ProviderChain([gone])
    with pytest.raises(ChainExhausted) as raised:
        await chain.call(invoke)
    assert [(a.error, a.kind) for a in raised.value.attempts] == [("OpenAIConnectionError", "connection")]
