"""Resolve, for a run's context, the provider chain its inferences go through.

The graph owns one ``ProviderResolver``. Links (a provider with its pricing)
are built once per distinct setting and shared by every chain that uses them,
so switching context (another cloud model, an operator override) never closes
a provider another chain or an in-flight step still uses; ``aclose`` closes
each link exactly once. It also keeps the llama-server slot pools, which must
outlive single runs so live threads keep their slots.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from langchain_core.language_models import BaseChatModel

from fusion_graph.chain import ChainLink, ProviderChain
from fusion_graph.context import FusionContext
from fusion_graph.health import HealthPolicy
from fusion_graph.llama import LlamaServerUnavailable, NotLlamaServer, fetch_total_slots
from fusion_graph.pricing import TokenPrices, pricing_for
from fusion_graph.providers import Provider, build_cloud_model, build_local_model, model_name
from fusion_graph.routing import Leg
from fusion_graph.slots import SlotPool

logger = logging.getLogger(__name__)


Prices = tuple[dict[str, TokenPrices], TokenPrices]


def _prices(context: FusionContext) -> Prices:
    """The context's price tables: overrides by provider id or model, and the local leg's price."""
    overrides = {
        key: TokenPrices(input=value[0], output=value[1], cached_input=value[2])
        for key, value in context.price_overrides.items()
    }
    local_in, local_out = context.local_price_per_mtok
    return overrides, TokenPrices(input=local_in, output=local_out, cached_input=local_in)


class ProviderResolver:
    """Chains per context, links per setting, slot pools per llama-server."""

    def __init__(
        self,
        *,
        cloud: BaseChatModel | None = None,
        local: BaseChatModel | None = None,
        chain: ProviderChain | None = None,
    ) -> None:
        """Use ``chain`` as given, or build a cloud+local chain from injected models and the context."""
        if chain is not None and (cloud is not None or local is not None):
            raise ValueError("pass either a provider chain or cloud/local models, not both")
        self._fixed_chain = chain
        self._injected: dict[Leg, BaseChatModel | None] = {"cloud": cloud, "local": local}
        self._links: dict[tuple[Any, ...], ChainLink] = {}
        self._chains: dict[tuple[Any, ...], ProviderChain] = {}
        self._pools: dict[tuple[str, int, bool], SlotPool] = {}
        self._lock = asyncio.Lock()
        self._closed = False
        self._not_llama: set[str] = set()

    def _link_key(self, leg: Leg, context: FusionContext, prices: Prices) -> tuple[Any, ...]:
        overrides, local_price = prices
        priced = (tuple(sorted(overrides.items())), local_price)
        if self._injected[leg] is not None:
            return (leg, "injected", priced)
        if leg == "cloud":
            settings: tuple[Any, ...] = (
                context.cloud_model,
                context.cloud_base_url,
                context.cloud_api_key_env,
            )
        else:
            settings = (context.local_model, context.local_base_url)
        return (leg, settings, context.request_timeout, priced)

    async def _link(self, leg: Leg, context: FusionContext, prices: Prices) -> ChainLink:
        key = self._link_key(leg, context, prices)
        link = self._links.get(key)
        if link is None:
            model = self._injected[leg]
            if model is None:
                # Building HTTP clients reads certificate files: keep it off the event loop.
                build = build_cloud_model if leg == "cloud" else build_local_model
                model = await asyncio.to_thread(build, context)
            provider = Provider(id=f"{leg}:{model_name(model)}", leg=leg, model=model)
            overrides, local_price = prices
            link = ChainLink.from_provider(
                provider, pricing_for(provider, overrides=overrides, local=local_price)
            )
            self._links[key] = link
        return link

    async def chain(self, context: FusionContext) -> ProviderChain:
        """The chain for ``context``: ``[cloud, local]`` with the context's health policy."""
        if self._closed:
            raise RuntimeError("the provider resolver is closed: build a new graph to run again")
        if self._fixed_chain is not None:
            return self._fixed_chain
        policy = HealthPolicy(
            allowed_failures=context.provider_allowed_failures,
            window_s=context.provider_failure_window_s,
            cooldown_s=context.provider_cooldown_s,
        )
        async with self._lock:
            prices = _prices(context)
            links = [await self._link(leg, context, prices) for leg in ("cloud", "local")]
            key = (tuple(id(link) for link in links), policy, context.override_provider)
            chain = self._chains.get(key)
            if chain is None:
                chain = ProviderChain(links, policy=policy)
                if context.override_provider is not None:
                    try:
                        chain.set_override(context.override_provider)
                    except KeyError as error:
                        raise ValueError(
                            f"override_provider {context.override_provider!r} is not a provider of "
                            f"this graph; known: {[link.id for link in links]}"
                        ) from error
                self._chains[key] = chain
        return chain

    async def slot_pool(self, link: ChainLink, context: FusionContext) -> SlotPool | None:
        """The slot pool of a local llama-server link, or ``None`` for anything else.

        The slot count is ``context.local_slots`` when set, else the server's own
        ``total_slots`` (asked once per base URL). A local server that is not
        llama-server (no ``/props``) runs without slot affinity; one that cannot
        be reached gets no slot for this call (the call itself will then fail
        over, or succeed if the server is back).
        """
        url = link.as_provider().base_url
        if link.leg != "local" or url is None or url in self._not_llama:
            return None
        reserve = context.reserve_reflection_slot
        if not context.local_slots:
            known = [pool for (u, _, r), pool in self._pools.items() if u == url and r == reserve]
            if known:
                return known[0]
        total = context.local_slots
        if not total:
            try:
                total = await fetch_total_slots(url, timeout=min(context.request_timeout, 10.0))
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
