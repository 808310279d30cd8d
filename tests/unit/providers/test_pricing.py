"""Pricing: catalogue lookups, overrides, the answering provider's price, and thread totals."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI

from fusion_graph.context import FusionContext
from fusion_graph.providers.chain import ProviderChain
from fusion_graph.providers.models import Provider
from fusion_graph.providers.pricing import (
    FREE,
    LegTotals,
    Pricing,
    TokenPrices,
    answering_leg,
    catalog_provider_ids,
    chain_totals,
    default_pricing,
    price,
    pricing_for,
    unit_prices,
)
from fusion_graph.providers.resolver import ProviderResolver
from fusion_graph.routing.records import RouteRecord, make_record
from fusion_graph.routing.score import Leg, RouteDecision
from fusion_graph.settings import FusionSettings

MINI = Pricing.catalog("gpt-4o-mini", provider_id="openai")
POWER = TokenPrices(input=0.02, output=0.05)


def price_record(record: RouteRecord, pricing: Pricing) -> RouteRecord:
    """``record`` priced as the graph prices an answered inference (``chain.answered_record``)."""
    priced = record.copy()
    priced["cost_usd"] = price(
        pricing, record["prompt_tokens"], record["cached_tokens"], record["completion_tokens"]
    )
    return priced


def test_catalog_knows_gpt_4o_mini() -> None:
    prices = unit_prices(MINI)
    assert prices is not None
    assert prices.input > 0 and prices.output > 0
    assert prices.cached_input is not None and 0 < prices.cached_input < prices.input


def test_catalog_price_splits_cached_input() -> None:
    prices = unit_prices(MINI)
    assert prices is not None and prices.cached_input is not None
    cost = price(MINI, 1000, 400, 10)
    expected = (600 * prices.input + 400 * prices.cached_input + 10 * prices.output) / 1e6
    assert cost == pytest.approx(expected)
    cached, uncached = price(MINI, 1000, 400, 10), price(MINI, 1000, 0, 10)
    assert cached is not None and uncached is not None and cached < uncached


def test_catalog_infers_the_provider_and_takes_a_timestamp() -> None:
    at = datetime(2025, 6, 1, tzinfo=UTC)
    assert price(Pricing.catalog("gpt-4o-mini"), 1000, 0, 10, at=at) == price(MINI, 1000, 0, 10, at=at)


@pytest.mark.parametrize(
    "pricing",
    [
        pytest.param(Pricing.catalog("qwen-local-xyz"), id="unknown-model"),
        pytest.param(Pricing.catalog("qwen-local-xyz", provider_id="openai"), id="unknown-at-provider"),
        pytest.param(Pricing.catalog("gpt-4o-mini", provider_id="nobody"), id="unknown-provider"),
        pytest.param(Pricing.catalog("gpt-4o-mini", api_url="http://10.0.0.1:1234/v1"), id="unknown-url"),
        pytest.param(Pricing(), id="nothing"),
    ],
)
def test_unknown_without_override_is_none(pricing: Pricing) -> None:
    assert price(pricing, 1000, 0, 10) is None
    assert unit_prices(pricing) is None


def test_fixed_prices() -> None:
    assert price(Pricing.flat(POWER), 1_000_000, 0, 1_000_000) == pytest.approx(0.07)
    discounted = Pricing.flat(TokenPrices(input=1.0, output=2.0, cached_input=0.5))
    assert price(discounted, 1_000_000, 500_000, 0) == pytest.approx(0.75)


def test_missing_numbers_are_never_guessed() -> None:
    assert price(MINI, None, None, 10) is None
    assert price(MINI, 1000, None, None) is None
    assert price(Pricing.flat(POWER), 1000, None, 0) == price(Pricing.flat(POWER), 1000, 0, 0)
    assert price(MINI, 10, 50, 0) == price(MINI, 10, 10, 0)  # cached clamped to the prompt


def test_default_pricing_order() -> None:
    overrides = {"cloud:mine": TokenPrices(1.0, 2.0), "gpt-4o": TokenPrices(3.0, 4.0)}
    by_id = default_pricing(
        provider_id="cloud:mine", leg="cloud", model_ref="gpt-4o-mini", overrides=overrides
    )
    assert by_id == Pricing.flat(TokenPrices(1.0, 2.0))
    by_model = default_pricing(provider_id="cloud:x", leg="cloud", model_ref="gpt-4o", overrides=overrides)
    assert by_model == Pricing.flat(TokenPrices(3.0, 4.0))
    assert default_pricing(provider_id="local:q", leg="local", model_ref="gpt-4o-mini") == Pricing.flat(FREE)
    assert default_pricing(provider_id="local:q", leg="local", model_ref="q", local=POWER) == Pricing.flat(
        POWER
    )
    catalog = default_pricing(provider_id="cloud:x", leg="cloud", model_ref="gpt-4o-mini", api_url="u")
    assert catalog == Pricing.catalog("gpt-4o-mini", api_url="u")


def test_pricing_for_a_provider() -> None:
    cloud = Provider("cloud:gpt-4o-mini", "cloud", ChatOpenAI(model="gpt-4o-mini", api_key="x"))
    assert pricing_for(cloud) == Pricing.catalog("gpt-4o-mini")
    assert price(pricing_for(cloud), 1000, 0, 10) == price(MINI, 1000, 0, 10)
    local = Provider("local:q", "local", GenericFakeChatModel(messages=iter([])))
    assert pricing_for(local, local=POWER) == Pricing.flat(POWER)


# The answering provider's price -----------------------------------------------


def answers() -> Iterator[AIMessage]:
    while True:
        yield AIMessage(content="ok")


def usage(prompt: int, cached: int, completion: int) -> AIMessage:
    return AIMessage(
        content="ok",
        usage_metadata={
            "input_tokens": prompt,
            "output_tokens": completion,
            "total_tokens": prompt + completion,
            "input_token_details": {"cache_read": cached},
        },
    )


def record(leg: Leg, provider: str | None, answer: AIMessage | None, step: int = 1) -> RouteRecord:
    decision = RouteDecision(leg, None, None, "test")
    return make_record(
        turn=0,
        step=step,
        kind="step",
        leg=leg,
        decision=decision,
        signals=None,
        provider=provider,
        answer=answer,
    )


def mixed_chain() -> ProviderChain:
    cloud = Provider("cloud:gpt-4o-mini", "cloud", GenericFakeChatModel(messages=answers()), MINI)
    local = Provider("local:qwen", "local", GenericFakeChatModel(messages=answers()), Pricing.flat(POWER))
    return ProviderChain([cloud, local])


async def test_a_local_step_costs_the_local_price_while_cloud_is_the_override() -> None:
    chain = mixed_chain()
    chain.set_override("cloud:gpt-4o-mini")

    async def invoke(chosen: Provider) -> AIMessage:
        return usage(1000, 200, 50)

    outcome = await chain.call(invoke, preferred_leg="local")
    assert outcome.provider.id == "local:qwen"
    priced = price_record(record("local", outcome.provider.id, outcome.answer), outcome.provider.pricing)
    assert priced["cost_usd"] == pytest.approx(price(Pricing.flat(POWER), 1000, 200, 50))
    assert priced["cost_usd"] != pytest.approx(price(MINI, 1000, 200, 50))


async def test_a_fallover_is_priced_at_the_provider_that_answered() -> None:
    chain = mixed_chain()

    async def invoke(chosen: Provider) -> AIMessage:
        if chosen.leg == "local":
            raise ConnectionRefusedError("llama-server is down")
        return usage(1000, 0, 50)

    outcome = await chain.call(invoke, preferred_leg="local")
    priced = price_record(record("local", outcome.provider.id, outcome.answer), outcome.provider.pricing)
    assert priced["cost_usd"] == pytest.approx(price(MINI, 1000, 0, 50))
    totals = chain_totals([priced], leg_of=chain.leg_of)
    assert (totals.cloud.inferences, totals.local.inferences) == (1, 0)


# Thread totals ----------------------------------------------------------------


def test_chain_totals_per_leg_and_provider() -> None:
    chain = mixed_chain()
    rows = [
        price_record(record("cloud", "cloud:gpt-4o-mini", usage(1000, 0, 100), 0), MINI),
        price_record(record("local", "local:qwen", usage(2000, 1500, 50), 1), Pricing.flat(POWER)),
        price_record(record("local", "local:qwen", usage(2100, 2000, 40), 2), Pricing.flat(POWER)),
        record("local", "local:qwen", None, 3),  # the provider reported nothing
    ]
    totals = chain_totals(rows, leg_of=chain.leg_of)
    assert totals.cloud == LegTotals(1, 1000, 0, 100, price(MINI, 1000, 0, 100) or 0.0, 0, 0)
    local_cost = (price(Pricing.flat(POWER), 2000, 1500, 50) or 0) + (
        price(Pricing.flat(POWER), 2100, 2000, 40) or 0
    )
    assert totals.local.inferences == 4 - 1
    assert (totals.local.prompt_tokens, totals.local.cached_tokens, totals.local.completion_tokens) == (
        4100,
        3500,
        90,
    )
    assert totals.local.cost_usd == pytest.approx(local_cost)
    assert (totals.local.unpriced, totals.local.unreported) == (1, 1)
    assert totals.total.inferences == 4
    assert totals.total.cost_usd == pytest.approx(totals.cloud.cost_usd + local_cost)
    assert set(totals.by_provider) == {"cloud:gpt-4o-mini", "local:qwen"}
    assert totals.by_provider["local:qwen"].inferences == 3
    assert chain_totals([]) == type(totals)()


def test_answering_leg_fallbacks() -> None:
    def leg_of(provider: str) -> Leg | None:
        return "cloud" if provider == "gateway" else None

    rows: list[Any] = [
        record("local", "gateway", None),
        record("local", "cloud:gpt-4o-mini", None),
        record("cloud", "somebody", None),
        record("local", None, None),
    ]
    assert [answering_leg(r, leg_of) for r in rows] == ["cloud", "cloud", "cloud", "local"]


# Pricing by link, not by name -------------------------------------------------

NAMED_LIKE_CLOUD = {"gpt-4o-mini": TokenPrices(5.0, 10.0)}


def test_a_model_name_override_never_prices_a_local_link() -> None:
    local = default_pricing(
        provider_id="local:gpt-4o-mini",
        leg="local",
        model_ref="gpt-4o-mini",
        overrides=NAMED_LIKE_CLOUD,
        local=POWER,
    )
    assert local == Pricing.flat(POWER)
    cloud = default_pricing(
        provider_id="cloud:gpt-4o-mini", leg="cloud", model_ref="gpt-4o-mini", overrides=NAMED_LIKE_CLOUD
    )
    assert cloud == Pricing.flat(TokenPrices(5.0, 10.0))


def test_a_provider_id_override_prices_a_local_link() -> None:
    overrides = {"local:gpt-4o-mini": TokenPrices(0.5, 0.7), **NAMED_LIKE_CLOUD}
    local = default_pricing(
        provider_id="local:gpt-4o-mini",
        leg="local",
        model_ref="gpt-4o-mini",
        overrides=overrides,
        local=POWER,
    )
    assert local == Pricing.flat(TokenPrices(0.5, 0.7))


def test_price_like_looks_a_cloud_model_up_at_that_catalogue_provider() -> None:
    gateway = "http://127.0.0.1:9/v1"
    like = default_pricing(
        provider_id="cloud:gpt-4o-mini",
        leg="cloud",
        model_ref="gpt-4o-mini",
        api_url=gateway,
        price_like="openai",
    )
    assert like == Pricing.catalog("gpt-4o-mini", provider_id="openai", api_url=gateway)
    assert price(like, 1000, 400, 10) == price(MINI, 1000, 400, 10) is not None
    unknown = default_pricing(
        provider_id="cloud:gpt-4o-mini", leg="cloud", model_ref="gpt-4o-mini", api_url=gateway
    )
    assert price(unknown, 1000, 400, 10) is None, "without price_like a gateway stays unpriced"
    named = default_pricing(
        provider_id="cloud:gpt-4o-mini",
        leg="cloud",
        model_ref="gpt-4o-mini",
        overrides=NAMED_LIKE_CLOUD,
        price_like="openai",
    )
    assert named == Pricing.flat(TokenPrices(5.0, 10.0)), "an override still beats the catalogue"
    local = default_pricing(provider_id="local:q", leg="local", model_ref="gpt-4o-mini", price_like="openai")
    assert local == Pricing.flat(FREE), "price_like is for cloud links only"


ChainFor = Callable[[FusionSettings], Awaitable[ProviderChain]]


@pytest.fixture
async def chain_for(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ChainFor]:
    """Builds the chain a graph with these operator settings would run on (closed afterwards)."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-pricing")
    made: list[ProviderResolver] = []

    async def chain(settings: FusionSettings) -> ProviderChain:
        made.append(ProviderResolver(settings=settings))
        return await made[-1].chain(FusionContext())

    yield chain
    for resolver in made:
        await resolver.aclose()


def same_name(**settings: Any) -> FusionSettings:
    """Both servers call their model gpt-4o-mini: the cost-attribution trap."""
    return FusionSettings(
        local_model="gpt-4o-mini", local_slots=2, local_price_per_mtok=(0.02, 0.05), **settings
    )


async def test_the_resolver_prices_each_link_by_its_leg(chain_for: ChainFor) -> None:
    chain = await chain_for(same_name(price_overrides={"gpt-4o-mini": (5.0, 10.0, None)}))
    pricing = {link.id: link.pricing for link in chain.links}
    assert pricing == {
        "cloud:gpt-4o-mini": Pricing.flat(TokenPrices(5.0, 10.0)),
        "local:gpt-4o-mini": Pricing.flat(TokenPrices(0.02, 0.05, 0.02)),
    }
    by_id = await chain_for(same_name(price_overrides={"local:gpt-4o-mini": (1.0, 2.0, 0.5)}))
    assert by_id.link("local:gpt-4o-mini").pricing == Pricing.flat(TokenPrices(1.0, 2.0, 0.5))
    assert by_id.link("cloud:gpt-4o-mini").pricing == Pricing.catalog("gpt-4o-mini")


async def test_the_resolver_prices_a_gateway_like_its_catalogue_provider(chain_for: ChainFor) -> None:
    gateway = "http://127.0.0.1:9/v1"
    plain = await chain_for(same_name(cloud_base_url=gateway))
    like = await chain_for(same_name(cloud_base_url=gateway, cloud_price_like="openai"))
    assert price(plain.link("cloud:gpt-4o-mini").pricing, 1000, 0, 10) is None
    assert price(like.link("cloud:gpt-4o-mini").pricing, 1000, 0, 10) == price(MINI, 1000, 0, 10)
    assert plain.links[1].pricing == like.links[1].pricing, "the local price does not depend on it"


async def test_an_unknown_price_like_names_the_known_providers(chain_for: ChainFor) -> None:
    with pytest.raises(
        ValueError, match=r"cloud_price_like 'opnai' is not a genai-prices provider; known: .*openai"
    ):
        await chain_for(same_name(cloud_price_like="opnai"))
    assert "openai" in catalog_provider_ids() and "anthropic" in catalog_provider_ids()


def test_cloud_price_like_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert FusionSettings().cloud_price_like is None
    monkeypatch.setenv("FUSION_CLOUD_PRICE_LIKE", "openai")
    assert FusionSettings().cloud_price_like == "openai"


@pytest.mark.parametrize(
    "bad",
    [{"local_price_per_mtok": (-1, -1)}, {"price_overrides": {"x": (float("inf"), 1.0, None)}}],
    ids=["negative", "infinite"],
)
def test_prices_must_be_finite_and_not_negative(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="prices must be between 0 and"):
        FusionSettings(**bad)
