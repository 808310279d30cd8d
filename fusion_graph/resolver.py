"""Resolve, for a run's context, the provider chain its inferences go through.

The graph owns one ``ProviderResolver``, built from the operator's
``FusionSettings``; a run's context can only narrow them (``settings.narrow``).
Links (a provider with its pricing) are built once per distinct setting and
shared by every chain that uses them, so a run that picks another allowed
cloud model never closes a provider another chain or an in-flight step still
uses; ``aclose`` closes each link exactly once. It also keeps the llama-server slot pools, which must
outlive single runs so live threads keep their slots.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from langchain_core.language_models import BaseChatModel

from fusion_graph.chain import ChainLink, ProviderChain
from fusion_graph.context import FusionContext
from fusion_graph.health import HealthPolicy
from fusion_graph.llama import LlamaServerUnavailable, NotLlamaServer, fetch_total_slots
from fusion_graph.pricing import Pricing, TokenPrices, check_price_like, pricing_for
from fusion_graph.providers import Provider, build_cloud_model, build_local_model, model_name
from fusion_graph.routing import Leg
from fusion_graph.settings import FusionSettings
from fusion_graph.slots import SlotPool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prices:
    """The context's price settings, as ``pricing.default_pricing`` takes them.

    Attributes:
        overrides: Fixed prices by provider id (any leg) or model name (cloud links only).
        local: The local leg's price (``local_price_per_mtok``).
        cloud_like: The catalogue provider the cloud leg bills like (``cloud_price_like``).
    """

    overrides: dict[str, TokenPrices]
    local: TokenPrices
    cloud_like: str | None

    def key(self, leg: Leg) -> tuple[Any, ...]:
        """What a link of ``leg`` is priced by, hashable (part of its cache key)."""
        shared = tuple(sorted(self.overrides.items()))
        return (shared, self.local) if leg == "local" else (shared, self.cloud_like)

    def pricing(self, provider: Provider) -> Pricing:
        """The pricing of ``provider`` by its leg (see ``pricing.default_pricing``)."""
        return pricing_for(provider, overrides=self.overrides, local=self.local, price_like=self.cloud_like)


def _prices(settings: FusionSettings) -> Prices:
    """The context's price settings; an unknown ``cloud_price_like`` is refused with the known ones."""
    overrides = {
        key: TokenPrices(input=value[0], output=value[1], cached_input=value[2])
        for key, value in settings.price_overrides.items()
    }
    local_in, local_out = settings.local_price_per_mtok
    local = TokenPrices(input=local_in, output=local_out, cached_input=local_in)
    like = check_price_like(settings.cloud_price_like) if settings.cloud_price_like else None
    return Prices(overrides, local, like)


class ProviderResolver:
    """Chains per context, links per setting, slot pools per llama-server."""

    def __init__(
        self,
        *,
        cloud: BaseChatModel | None = None,
        local: BaseChatModel | None = None,
        chain: ProviderChain | None = None,
        settings: FusionSettings | None = None,
    ) -> None:
        """Use ``chain`` as given, or build a cloud+local chain from injected models and the settings.

        ``settings`` defaults to ``FusionSettings()``, read from the environment now.
        """
        if chain is not None and (cloud is not None or local is not None):
            raise ValueError("pass either a provider chain or cloud/local models, not both")
        self.settings = settings if settings is not None else FusionSettings()
        self._fixed_chain = chain
        self._injected: dict[Leg, BaseChatModel | None] = {"cloud": cloud, "local": local}
        self._links: dict[tuple[Any, ...], ChainLink] = {}
        self._chains: dict[tuple[Any, ...], ProviderChain] = {}
        self._pools: dict[tuple[str, int, bool], SlotPool] = {}
        self._lock = asyncio.Lock()
        self._closed = False
        self._not_llama: set[str] = set()

    def effective(self, context: FusionContext) -> FusionSettings:
        """The operator's settings as ``context`` may narrow them (``ContextError`` if it may not)."""
        return self.settings.narrow(cloud_model=context.cloud_model, workspace_root=context.workspace_root)

    def _link_key(self, leg: Leg, settings: FusionSettings, prices: Prices) -> tuple[Any, ...]:
        priced = prices.key(leg)
        if self._injected[leg] is not None:
            return (leg, "injected", priced)
        if leg == "cloud":
            endpoint: tuple[Any, ...] = (
                settings.cloud_model,
                settings.cloud_base_url,
                settings.cloud_api_key_env,
                settings.cloud_api_key,
            )
        else:
            endpoint = (settings.local_model, settings.local_base_url)
        return (leg, endpoint, settings.request_timeout, priced)

    async def _link(self, leg: Leg, settings: FusionSettings, prices: Prices) -> ChainLink:
        key = self._link_key(leg, settings, prices)
        link = self._links.get(key)
        if link is None:
            model = self._injected[leg]
            if model is None:
                # Building HTTP clients reads certificate files: keep it off the event loop.
                build = build_cloud_model if leg == "cloud" else build_local_model
                model = await asyncio.to_thread(build, settings)
            provider = Provider(id=f"{leg}:{model_name(model)}", leg=leg, model=model)
            link = ChainLink.from_provider(provider, prices.pricing(provider))
            self._links[key] = link
        return link

    async def chain(self, context: FusionContext) -> ProviderChain:
        """The chain for a run: ``[cloud, local]`` with the operator's health policy.

        Raises:
            ContextError: ``context`` asks for a model or workspace the operator did not allow.
        """
        if self._closed:
            raise RuntimeError("the provider resolver is closed: build a new graph to run again")
        settings = self.effective(context)
        if self._fixed_chain is not None:
            return self._fixed_chain
        policy = HealthPolicy(
            allowed_failures=settings.provider_allowed_failures,
            window_s=settings.provider_failure_window_s,
            cooldown_s=settings.provider_cooldown_s,
        )
        async with self._lock:
            prices = _prices(settings)
            links = [await self._link(leg, settings, prices) for leg in ("cloud", "local")]
            key = (tuple(id(link) for link in links), policy, settings.override_provider)
            chain = self._chains.get(key)
            if chain is None:
                chain = ProviderChain(links, policy=policy)
                if settings.override_provider is not None:
                    try:
                        chain.set_override(settings.override_provider)
                    except KeyError as error:
                        raise ValueError(
                            f"override_provider {settings.override_provider!r} is not a provider of "
                            f"this graph; known: {[link.id for link in links]}"
                        ) from error
                self._chains[key] = chain
        return chain

    async def slot_pool(self, link: ChainLink, context: FusionContext) -> SlotPool | None:
        """The slot pool of a local llama-server link, or ``None`` for anything else.

        The slot count is ``local_slots`` when set, else the server's own
        ``total_slots`` (asked once per base URL). A local server that is not
        llama-server (no ``/props``) runs without slot affinity; one that cannot
        be reached gets no slot for this call (the call itself will then fail
        over, or succeed if the server is back).
        """
        settings = self.settings
        url = link.as_provider().base_url
        if link.leg != "local" or url is None or url in self._not_llama:
            return None
        reserve = settings.reserve_reflection_slot
        if not settings.local_slots:
            known = [pool for (u, _, r), pool in self._pools.items() if u == url and r == reserve]
            if known:
                return known[0]
        total = settings.local_slots
        if not total:
            try:
                total = await fetch_total_slots(url, timeout=min(settings.request_timeout, 10.0))
            except NotLlamaServer as error:
                logger.warning("%s; local steps run without slot affinity", error)
                self._not_llama.add(url)
                return None
            except LlamaServerUnavailable as error:
                logger.warning("no slot for this call: %s", error)
                return None
        key = (url, total, reserve)
        if key not in self._pools:
            self._pools[key] = SlotPool(total, reserve_reflection=reserve)
        return self._pools[key]

    async def aclose(self) -> None:
        """Close every chain and every link (each exactly once); later runs are refused."""
        self._closed = True
        chains = list(self._chains.values()) + ([self._fixed_chain] if self._fixed_chain else [])
        for chain in chains:
            await chain.aclose()
        for link in self._links.values():
            await link.aclose()
        self._chains.clear()
        self._links.clear()
