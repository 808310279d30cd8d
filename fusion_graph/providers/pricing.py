"""What an inference cost: per-provider prices and a thread's running totals.

Prices come from two places. Known cloud models are looked up in the
``genai-prices`` catalogue (bundled with the package, so no network), which
knows input, cached-input and output prices and their tiers. Anything else
(llama-server, a private endpoint, a negotiated rate) takes a fixed
``TokenPrices`` from a per-provider override table. The local leg defaults to
free; set ``local`` to a non-zero price to account for power.

A link is priced by its leg first, never by a model name alone: a local link
costs the local price unless an override names its provider id, and
model-name overrides and the catalogue apply to cloud links only, so a
llama-server that serves a model under a cloud model's name is not billed at
the cloud's rate. A gateway's cloud model is looked up at the catalogue
provider it bills like (``price_like``), when given.

A cost is always priced against the provider that *answered*, so a fallback
to the other leg is billed at that leg's price. When a price cannot be known
the answer is ``None``, never a made-up number.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING

from genai_prices import Usage, calc_price
from genai_prices.data_snapshot import find_provider_by_id, get_snapshot
from genai_prices.types import TieredPrices

from fusion_graph.errors import ProviderConfigError
from fusion_graph.routing.records import RouteRecord
from fusion_graph.routing.rule import StepPrice
from fusion_graph.routing.score import Leg

if TYPE_CHECKING:
    from langchain_core.language_models import BaseChatModel

    from fusion_graph.providers.models import Provider

MILLION = 1_000_000


@dataclass(frozen=True)
class TokenPrices:
    """USD per million tokens.

    Attributes:
        input: Uncached prompt tokens.
        output: Completion tokens.
        cached_input: Prompt tokens served from the provider's cache; ``None``
            bills them at the ``input`` price.
    """

    input: float
    output: float
    cached_input: float | None = None

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        """USD for one call; ``cached_tokens`` is the part of ``prompt_tokens`` read from cache."""
        cached_price = self.input if self.cached_input is None else self.cached_input
        uncached = prompt_tokens - cached_tokens
        return (
            uncached * self.input + cached_tokens * cached_price + completion_tokens * self.output
        ) / MILLION


#: The local leg's default: the hardware is already paid for.
FREE = TokenPrices(input=0.0, output=0.0, cached_input=0.0)


@dataclass(frozen=True)
class Pricing:
    """How one provider is priced: a fixed table, or a ``genai-prices`` catalogue entry.

    Attributes:
        model_ref: Model name to look up in the catalogue (e.g. ``gpt-4o-mini``).
        provider_id: ``genai-prices`` provider id (``openai``, ``anthropic``...);
            ``None`` lets the catalogue infer it from ``api_url`` or the model name.
        api_url: The provider's base URL, to tell e.g. Groq from OpenAI.
        fixed: A fixed price; wins over the catalogue when set.
    """

    model_ref: str | None = None
    provider_id: str | None = None
    api_url: str | None = None
    fixed: TokenPrices | None = None

    @classmethod
    def flat(cls, prices: TokenPrices) -> Pricing:
        """Fixed prices (an override, or the local leg's power cost)."""
        return cls(fixed=prices)

    @classmethod
    def catalog(
        cls, model_ref: str, *, provider_id: str | None = None, api_url: str | None = None
    ) -> Pricing:
        """Prices from the ``genai-prices`` catalogue."""
        return cls(model_ref=model_ref, provider_id=provider_id, api_url=api_url)


def model_name(model: BaseChatModel) -> str:
    """A readable name for a chat model (its ``model_name``/``model`` or class name)."""
    for attr in ("model_name", "model"):
        value = getattr(model, attr, None)
        if isinstance(value, str) and value:
            return value
    return type(model).__name__


def default_pricing(
    *,
    provider_id: str,
    leg: Leg,
    model_ref: str,
    api_url: str | None = None,
    overrides: Mapping[str, TokenPrices] | None = None,
    local: TokenPrices = FREE,
    price_like: str | None = None,
) -> Pricing:
    """The pricing of a chain provider, by its leg first.

    In order: an override keyed by ``provider_id``; for a local provider,
    ``local``; for a cloud provider, an override keyed by ``model_ref``, then
    the catalogue (at ``price_like`` when given, else the provider inferred
    from ``api_url`` or the model name).

    Args:
        provider_id: The chain's provider id (an exact key of ``overrides``, for any leg).
        leg: The provider's leg; local providers cost ``local`` unless their id is overridden.
        model_ref: The model name: a key of ``overrides`` and a catalogue entry, for cloud providers.
        api_url: The provider's base URL, if not the vendor's default.
        overrides: USD per million tokens per provider id (any leg) or model name (cloud only).
        local: Price of the local leg (default free; set it to count power).
        price_like: ``genai-prices`` provider id whose catalogue prices a cloud provider
            (e.g. ``openai`` for a gateway at an unknown ``api_url``); ``None`` infers it.
    """
    table = overrides or {}
    if provider_id in table:
        return Pricing.flat(table[provider_id])
    if leg == "local":
        return Pricing.flat(local)
    if model_ref in table:
        return Pricing.flat(table[model_ref])
    if price_like:
        return Pricing.catalog(model_ref, provider_id=price_like, api_url=api_url)
    return Pricing.catalog(model_ref, api_url=api_url)


def catalog_provider_ids() -> list[str]:
    """The ``genai-prices`` provider ids (values of ``price_like``/``cloud_price_like``)."""
    return sorted(provider.id for provider in get_snapshot().providers)


def check_price_like(price_like: str) -> str:
    """``price_like`` if the catalogue knows that provider; else a ``ValueError`` listing the known ones."""
    if find_provider_by_id(get_snapshot().providers, price_like) is None:
        known = ", ".join(catalog_provider_ids())
        raise ProviderConfigError(
            f"cloud_price_like {price_like!r} is not a genai-prices provider; known: {known}"
        )
    return price_like


def _catalog_calc(pricing: Pricing, usage: Usage, at: datetime | None) -> tuple[Decimal, TokenPrices] | None:
    if pricing.model_ref is None:
        return None
    try:
        if pricing.provider_id is not None:
            result = calc_price(
                usage, pricing.model_ref, provider_id=pricing.provider_id, genai_request_timestamp=at
            )
        else:
            result = calc_price(
                usage, pricing.model_ref, provider_api_url=pricing.api_url, genai_request_timestamp=at
            )
    except (LookupError, ValueError):  # unknown model/provider, or usage the entry cannot price
        return None
    prices = result.model_price

    def per_mtok(value: Decimal | TieredPrices | None) -> float | None:
        if isinstance(value, TieredPrices):
            return float(value.base)
        return None if value is None else float(value)

    table = TokenPrices(
        input=per_mtok(prices.input_mtok) or 0.0,
        output=per_mtok(prices.output_mtok) or 0.0,
        cached_input=per_mtok(prices.cache_read_mtok),
    )
    return result.total_price, table


def unit_prices(pricing: Pricing, *, at: datetime | None = None) -> TokenPrices | None:
    """The base per-million prices of ``pricing`` (tiers ignored), or ``None`` when unknown."""
    if pricing.fixed is not None:
        return pricing.fixed
    found = _catalog_calc(pricing, Usage(input_tokens=0, output_tokens=0), at)
    return None if found is None else found[1]


def price(
    pricing: Pricing,
    prompt_tokens: int | None,
    cached_tokens: int | None,
    completion_tokens: int | None,
    *,
    at: datetime | None = None,
) -> float | None:
    """USD for one call, or ``None`` when the price is unknown.

    ``prompt_tokens`` includes ``cached_tokens`` (OpenAI's and LangChain's
    convention). Returns ``None`` when the model is not in the catalogue and
    has no fixed price, or when the provider reported no prompt or completion
    count: a cost is never guessed. Unreported cached tokens count as uncached.

    Args:
        pricing: The pricing of the provider that answered.
        prompt_tokens: Prompt tokens, cached ones included.
        cached_tokens: Prompt tokens read from the provider's cache.
        completion_tokens: Generated tokens.
        at: When the call was made (catalogue prices change over time); default now.
    """
    if prompt_tokens is None or completion_tokens is None:
        return None
    cached = min(max(cached_tokens or 0, 0), prompt_tokens)
    if pricing.fixed is not None:
        return pricing.fixed.cost(prompt_tokens, cached, completion_tokens)
    usage = Usage(input_tokens=prompt_tokens, cache_read_tokens=cached, output_tokens=completion_tokens)
    found = _catalog_calc(pricing, usage, at)
    return None if found is None else float(found[0])


def step_price(pricing: Pricing, prompt_tokens: int, cached_tokens: int = 0) -> StepPrice:
    """What a cloud inference of ``prompt_tokens`` costs before it is made: its prompt, and each token out.

    The one way a step is priced ahead of its call (the route's budget guard,
    memory jobs, MCP sampling): ``cached_tokens`` of the prompt at the cached
    rate (the thread's warm prefix, when a server reported one), and the price
    of one completion token, so the budget can cap how long the call may write.
    """
    per_million = price(pricing, 0, 0, 1_000_000)
    token = per_million / 1_000_000 if per_million is not None else None
    return StepPrice(price(pricing, prompt_tokens, cached_tokens, 0), token)


@dataclass(frozen=True)
class LegTotals:
    """Running totals of the inferences that one leg (or provider) answered.

    ``unpriced`` counts inferences without a cost and ``unreported`` those
    without token counts, so a total is known to be a lower bound when they
    are non-zero.
    """

    inferences: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    unpriced: int = 0
    unreported: int = 0

    def __add__(self, other: LegTotals) -> LegTotals:
        return LegTotals(
            inferences=self.inferences + other.inferences,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            cached_tokens=self.cached_tokens + other.cached_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            cost_usd=self.cost_usd + other.cost_usd,
            unpriced=self.unpriced + other.unpriced,
            unreported=self.unreported + other.unreported,
        )


@dataclass(frozen=True)
class ChainTotals:
    """A thread's totals per answering leg and per answering provider."""

    local: LegTotals = field(default_factory=LegTotals)
    cloud: LegTotals = field(default_factory=LegTotals)
    by_provider: Mapping[str, LegTotals] = field(default_factory=dict)

    @property
    def total(self) -> LegTotals:
        """Both legs together."""
        return self.local + self.cloud


def _record_totals(record: RouteRecord) -> LegTotals:
    prompt, completion = record["prompt_tokens"], record["completion_tokens"]
    cost = record["cost_usd"]
    return LegTotals(
        inferences=1,
        prompt_tokens=prompt or 0,
        cached_tokens=record["cached_tokens"] or 0,
        completion_tokens=completion or 0,
        cost_usd=cost or 0.0,
        unpriced=int(cost is None),
        unreported=int(prompt is None and completion is None),
    )


def answering_leg(record: RouteRecord, leg_of: Callable[[str], Leg | None] | None = None) -> Leg:
    """The leg that answered ``record``: ``leg_of(provider)``, the id's ``leg:`` prefix, else the routed leg.

    A route record's ``leg`` is where the router *sent* the step; after a
    fallback the answer came from the other leg, and totals follow the answer.
    """
    provider = record["provider"]
    if provider is not None:
        leg = leg_of(provider) if leg_of is not None else None
        if leg is not None:
            return leg
        prefix = provider.split(":", 1)[0]
        if prefix in ("local", "cloud"):
            return "local" if prefix == "local" else "cloud"
    return record["leg"]


def chain_totals(
    records: Iterable[RouteRecord], *, leg_of: Callable[[str], Leg | None] | None = None
) -> ChainTotals:
    """Total cost and tokens of a thread's ``route_log``, per answering leg and provider.

    Args:
        records: The thread's route records, in any order.
        leg_of: Maps a provider id to its leg (e.g. ``ProviderChain.leg_of``);
            falls back as described in ``answering_leg``.
    """
    legs: dict[Leg, LegTotals] = {"local": LegTotals(), "cloud": LegTotals()}
    providers: dict[str, LegTotals] = {}
    for record in records:
        row = _record_totals(record)
        leg = answering_leg(record, leg_of)
        legs[leg] = legs[leg] + row
        key = record["provider"] or f"{record['leg']}:?"
        providers[key] = providers.get(key, LegTotals()) + row
    return ChainTotals(local=legs["local"], cloud=legs["cloud"], by_provider=providers)


def pricing_for(
    provider: Provider,
    *,
    overrides: Mapping[str, TokenPrices] | None = None,
    local: TokenPrices = FREE,
    price_like: str | None = None,
) -> Pricing:
    """``default_pricing`` of a ``providers.Provider`` (its id, leg, model name and base URL)."""
    return default_pricing(
        provider_id=provider.id,
        leg=provider.leg,
        model_ref=model_name(provider.model),
        api_url=provider.base_url,
        overrides=overrides,
        local=local,
        price_like=price_like,
    )
