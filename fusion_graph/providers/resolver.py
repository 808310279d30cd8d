"""Resolve, for a run's context, the provider chain its inferences go through, and what its servers say.

The graph owns one ``ProviderResolver``, built from the operator's
``FusionSettings``; a run's context can only narrow them (``settings.narrow``).
Providers (each with its pricing) are built once per distinct setting and
shared by every chain that uses them, so a run that picks another allowed
cloud model never closes a provider another chain or an in-flight step still
uses; ``aclose`` closes each provider exactly once.

The resolver also holds what outlives single runs: the placement of local
requests (``placement``) and what the local servers said about themselves
(``LocalServers``). They live here because a provider's window is part of
resolving it: llama-server says its slot count and per-slot window at
``GET /props``; the resolver asks once per server (a gateway: each box behind
it, which must agree) and keeps the answer. A server that is not llama-server
is logged once and then runs without slot affinity; one that cannot be reached
is asked again next time.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from dataclasses import dataclass
from typing import Any

from langchain_core.language_models import BaseChatModel

from fusion_graph.context import FusionContext
from fusion_graph.coordination.shared_state import SharedState
from fusion_graph.coordination.slot_leases import LOCAL_LEASES
from fusion_graph.errors import (
    Closed,
    ContextError,
    LlamaServerUnavailable,
    LocalPoolMismatch,
    NotLlamaServer,
    ProviderConfigError,
    UsageError,
)
from fusion_graph.providers.chain import HealthPolicy, ProviderChain
from fusion_graph.providers.llama_server import ServerProps, fetch_props
from fusion_graph.providers.models import (
    Provider,
    build_cloud_model,
    build_local_model,
    close_chat_model,
    register_cloud_key,
)
from fusion_graph.providers.placement import LeasedPlacement, Placer, ServerSlots
from fusion_graph.providers.pricing import Pricing, TokenPrices, check_price_like, model_name, pricing_for
from fusion_graph.providers.slots import SlotPool
from fusion_graph.routing.rule import CloudBudget, cloud_budget
from fusion_graph.routing.score import Leg
from fusion_graph.settings import FusionSettings
from fusion_graph.telemetry import switch as telemetry

logger = logging.getLogger(__name__)


#: The cloud window when neither the operator nor the model's profile says (most current cloud
#: chat models hold at least this much).
DEFAULT_CLOUD_WINDOW = 128_000


class LocalServers:
    """``/props`` of the local servers, asked once each, and the windows that follow from them."""

    def __init__(self, settings: FusionSettings, *, injected_local: bool) -> None:
        """Ask by ``settings``; ``injected_local``: the local model was passed in (no gateway boxes)."""
        self.settings = settings
        self.injected_local = injected_local
        self._not_llama: set[str] = set()
        self._props: dict[str, ServerProps] = {}
        #: Servers that could not be read, said once per outage (until one answers again).
        self._unreachable: set[str] = set()
        self._count_url: str | None = None
        #: Windows that cannot change any more (asked on every step): by link.
        self._windows: weakref.WeakKeyDictionary[Provider, int | None] = weakref.WeakKeyDictionary()

    @property
    def pooled(self) -> bool:
        """Whether the local endpoint is a gateway over the boxes of ``local_workers``."""
        return bool(self.settings.local_workers)

    @property
    def gateway(self) -> bool:
        """Whether local slots are per box (a gateway the graph built its local model for)."""
        return self.pooled and not self.injected_local

    async def _pool_props(self) -> ServerProps | None:
        """``/props`` of the boxes behind the gateway, which must agree; ``None`` when none answers.

        Raises:
            LocalPoolMismatch: Two boxes serve different models or slot counts, or one is not
                llama-server.
        """
        timeout = min(self.settings.request_timeout, 10.0)
        seen: list[tuple[str, ServerProps]] = []
        for url in self.settings.local_workers:
            try:
                props = await fetch_props(url, timeout=timeout)
            except NotLlamaServer as error:
                raise LocalPoolMismatch(f"local_workers: {error}") from None
            except LlamaServerUnavailable as error:
                logger.warning("local worker not reachable, read from the others: %s", error)
                continue
            seen.append((url, props))
        if not seen:
            return None
        first_url, first = seen[0]
        for url, props in seen[1:]:
            if (props.model, props.total_slots, props.slot_window) != (
                first.model,
                first.total_slots,
                first.slot_window,
            ):
                raise LocalPoolMismatch(
                    "the boxes of local_workers must serve the same model with the same -np and -c: "
                    f"{first_url} serves {first.model!r} with {first.total_slots} slots of "
                    f"{first.slot_window} tokens, {url} serves {props.model!r} with "
                    f"{props.total_slots} slots of {props.slot_window} tokens"
                )
        self._count_url = first_url
        return first

    def count_url(self, link: Provider) -> str | None:
        """Where a local link's prompts are counted (``/tokenize``): a box behind a gateway, else the link."""
        if link.leg == "local" and self.pooled:
            return self._count_url or self.settings.local_workers[0]
        return link.base_url

    async def props(self, link: Provider) -> ServerProps | None:
        """What a local llama-server link's server says about itself (``GET /props``), asked once.

        ``None`` for a cloud link, a local server that is not llama-server (logged
        once; it then runs without slot affinity) and one that cannot be reached
        now (asked again next time; the call itself will then fail over, or
        succeed if the server is back). Behind a gateway (``local_workers``), the
        boxes are asked and must agree (``LocalPoolMismatch`` otherwise).
        """
        url = link.base_url
        if link.leg != "local" or url is None or url in self._not_llama:
            return None
        known = self._props.get(url)
        if known is not None:
            return known
        if self.gateway:
            pooled = await self._pool_props()
            if pooled is None:
                return None
            self._props[url] = pooled
            return pooled
        try:
            props = await fetch_props(url, timeout=min(self.settings.request_timeout, 10.0))
        except NotLlamaServer as error:
            logger.warning("%s; its slots and window are not known (set FUSION_LOCAL_SLOTS)", error)
            self._not_llama.add(url)
            return None
        except LlamaServerUnavailable as error:
            if url not in self._unreachable:  # once per outage, not once per call
                self._unreachable.add(url)
                logger.warning("no slot or window until llama-server answers (calls fall over): %s", error)
            return None
        if url in self._unreachable:
            self._unreachable.discard(url)
            logger.warning("llama-server at %s answers again: slots and window known", url)
        self._props[url] = props
        return props

    async def window(self, link: Provider) -> int | None:
        """Tokens ``link`` holds per request (prompt + completion); ``None`` when unknown.

        In order: the link's own ``window``; the operator's ``local_window_tokens`` /
        ``cloud_window_tokens``; llama-server's per-slot context (``GET /props``, asked
        once per server); ``max_input_tokens`` of the model's langchain-core profile;
        for the cloud leg ``DEFAULT_CLOUD_WINDOW``. A local server that is none of
        these has no known window (every step is assumed to fit it). A window
        that rests on anything but an unreachable server is kept.
        """
        if link in self._windows:
            return self._windows[link]
        window = await self._window(link)
        settled = link.leg == "cloud" or link.base_url in self._props
        if settled or link.window is not None or self._window_setting(link):
            self._windows[link] = window
        return window

    def _window_setting(self, link: Provider) -> int:
        """The operator's window for ``link``'s leg (0: not set)."""
        if link.leg == "local":
            return self.settings.local_window_tokens or 0
        return self.settings.cloud_window_tokens or 0

    async def _window(self, link: Provider) -> int | None:
        if link.window is not None:
            return link.window
        setting = self._window_setting(link)
        if setting:
            return setting
        props = await self.props(link)
        if props is not None and props.slot_window is not None:
            return props.slot_window
        profile = link.model.profile or {}
        limit = profile.get("max_input_tokens")
        if isinstance(limit, int) and limit > 0:
            return limit
        return DEFAULT_CLOUD_WINDOW if link.leg == "cloud" else None


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
            raise UsageError("pass either a provider chain or cloud/local models, not both")
        self.settings = settings if settings is not None else FusionSettings()
        # Scrubbed from now, not from when the cloud leg is first built: a local-only first run
        # may meet the key in a workspace file before any cloud model exists.
        register_cloud_key(self.settings, cloud)
        telemetry.configure(self.settings)  # metrics and traces, when the operator turned them on
        self._fixed_chain = chain
        self._injected: dict[Leg, BaseChatModel | None] = {"cloud": cloud, "local": local}
        self._links: dict[tuple[Any, ...], Provider] = {}
        self._chains: dict[tuple[Any, ...], ProviderChain] = {}
        # The operator settings are fixed, so a run's narrowing alone decides its chain.
        self._by_context: dict[tuple[str | None, str | None, tuple[Leg, ...] | None], ProviderChain] = {}
        self._locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )
        self._closed = False
        #: What the local servers say about themselves (slots, windows).
        self.servers = LocalServers(self.settings, injected_local=local is not None)
        #: How many slots the local servers have, and the headers their requests carry.
        self.local_slots = ServerSlots(self.settings, self.servers.props)
        boxes = self.settings.local_workers if self.servers.gateway else ()
        box_model = self._box_model if boxes else None
        #: Where every local request goes (``Placer``): leases by one rule (``slot_leases.choose_slot``)
        #: and slot turns, in this process's table, or the deployment's when shared; over several
        #: boxes, straight to the box the lease names.
        self.placement: Placer = LeasedPlacement(
            LOCAL_LEASES, self.local_slots, boxes=boxes, box_model=box_model
        )
        #: What the deployment's worker processes share (``shared_state="postgres"``), else ``None``.
        self.shared: SharedState | None = None
        self._box_models: dict[str, BaseChatModel] = {}
        url = self.settings.shared_url()
        if self.settings.shared_state != "off" and url is None:
            raise ProviderConfigError(
                "shared_state='postgres' needs a database: set FUSION_SHARED_STATE_URL "
                "(a LangGraph server sets DATABASE_URI, which is used when it is empty)"
            )
        if url is not None:
            scheme = url.split("://", 1)[0] if "://" in url else ""
            if scheme not in ("postgresql", "postgres"):
                raise ProviderConfigError(
                    f"the shared state's URL must start with postgresql:// (its scheme is {scheme[:20]!r}): "
                    "fix FUSION_SHARED_STATE_URL (or DATABASE_URI when that is empty)"
                )
            self.shared = SharedState(
                url,
                namespace=self.settings.shared_state_namespace,
                timeout_s=self.settings.shared_state_timeout_s,
            )
            telemetry.watch_shared(self.shared)
            self.placement = LeasedPlacement(self.shared, self.local_slots, boxes=boxes, box_model=box_model)
            if chain is not None:
                chain.share_health(self.shared.health)

    def check_bounds(self, context: FusionContext) -> None:
        """Refuse a run context past the operator's size bounds (``ContextError``): the system prompt."""
        limit = self.settings.max_system_prompt_chars
        if len(context.system_prompt) > limit:
            raise ContextError(
                f"system_prompt is {len(context.system_prompt):,} characters; this deployment allows at "
                f"most {limit:,} (the operator sets FUSION_MAX_SYSTEM_PROMPT_CHARS)"
            )

    def cloud_budget(self, context: FusionContext) -> CloudBudget:
        """The run's cloud budgets: its own, never above the operator's (a run may only lower them)."""
        return cloud_budget(
            operator_turn=self.settings.turn_cloud_budget_usd,
            operator_thread=self.settings.thread_cloud_budget_usd,
            run_turn=context.turn_cloud_budget_usd,
            run_thread=context.thread_cloud_budget_usd,
        )

    def effective(self, context: FusionContext) -> FusionSettings:
        """The operator's settings as ``context`` may narrow them (``ContextError`` if it may not)."""
        self.check_bounds(context)
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

    async def _link(self, leg: Leg, settings: FusionSettings, prices: Prices) -> Provider:
        key = self._link_key(leg, settings, prices)
        link = self._links.get(key)
        if link is None:
            model = self._injected[leg]
            if model is None:
                # Building HTTP clients reads certificate files: keep it off the event loop.
                build = build_cloud_model if leg == "cloud" else build_local_model
                model = await asyncio.to_thread(build, settings)
            link = Provider(id=f"{leg}:{model_name(model)}", leg=leg, model=model)
            link.pricing = prices.pricing(link)  # the run's price settings, not the defaults
            self._links[key] = link
        return link

    def legs_for(self, context: FusionContext) -> tuple[Leg, ...] | None:
        """The legs a run may use (``None``: both, as in ``fusion``).

        ``mode="local"``/``"cloud"`` only its own, unless the operator allows
        cross-leg fallover (``cross_leg_fallover``).
        """
        if context.mode == "fusion" or self.settings.cross_leg_fallover:
            return None
        return (context.mode,)

    async def chain(self, context: FusionContext) -> ProviderChain:
        """The chain for a run: ``[cloud, local]`` with the operator's health policy.

        A run in ``mode="local"`` (or ``"cloud"``) gets a chain of that leg's links
        only: nothing it sends can reach the other leg's provider, not even in an
        outage, unless the operator sets ``cross_leg_fallover``.

        Raises:
            ContextError: ``context`` asks for a model or workspace the operator did not allow.
        """
        if self._closed:
            raise Closed("the provider resolver is closed: build a new graph to run again")
        self.check_bounds(context)
        legs = self.legs_for(context)
        narrowing = (context.cloud_model, context.workspace_root, legs)
        known = self._by_context.get(narrowing)
        if known is not None:  # every step of a run asks again: answer from what was resolved
            return known
        settings = self.effective(context)
        if self._fixed_chain is not None:
            fixed = self._fixed_chain if legs is None else self._fixed_chain.only(legs)
            self._by_context[narrowing] = fixed
            telemetry.watch_chain(fixed)
            return fixed
        policy = HealthPolicy(
            allowed_failures=settings.provider_allowed_failures,
            window_s=settings.provider_failure_window_s,
            cooldown_s=settings.provider_cooldown_s,
        )
        async with self._locks.setdefault(asyncio.get_running_loop(), asyncio.Lock()):
            prices = _prices(settings)
            links = [await self._link(leg, settings, prices) for leg in legs or ("cloud", "local")]
            key = (tuple(id(link) for link in links), policy, settings.override_provider)
            chain = self._chains.get(key)
            if chain is None:
                board = self.shared.health if self.shared is not None else None
                chain = ProviderChain(links, policy=policy, board=board)
                if settings.override_provider is not None:
                    try:
                        chain.set_override(settings.override_provider)
                    except KeyError as error:
                        raise ProviderConfigError(
                            f"override_provider {settings.override_provider!r} is not a provider of "
                            f"this graph; known: {[link.id for link in links]}"
                        ) from error
                self._chains[key] = chain
                telemetry.watch_chain(chain)
            self._by_context[narrowing] = chain
        return chain

    @property
    def pooled(self) -> bool:
        """Whether the local endpoint is a gateway over the boxes of ``local_workers``."""
        return self.servers.pooled

    async def server_props(self, link: Provider) -> ServerProps | None:
        """What a local llama-server link's server says about itself (``LocalServers.props``)."""
        return await self.servers.props(link)

    async def window(self, link: Provider) -> int | None:
        """Tokens ``link`` holds per request (``LocalServers.window``)."""
        return await self.servers.window(link)

    def count_url(self, link: Provider) -> str | None:
        """Where a local link's prompts are counted (``LocalServers.count_url``)."""
        return self.servers.count_url(link)

    async def slot_pool(self, link: Provider, context: FusionContext | None = None) -> SlotPool | None:
        """The slots of a local llama-server link (``ServerSlots.pool``)."""
        return await self.local_slots.pool(link)

    async def _box_model(self, box: str) -> BaseChatModel:
        """The local model that reaches ``box`` directly (built once per box, like the gateway's)."""
        model = self._box_models.get(box)
        if model is None:
            settings = self.settings.model_copy(update={"local_base_url": f"{box}/v1", "local_workers": ()})
            # Building HTTP clients reads certificate files: keep it off the event loop.
            model = self._box_models[box] = await asyncio.to_thread(build_local_model, settings)
        return model

    async def aclose(self) -> None:
        """Close every chain, link (each exactly once) and the shared state; later runs are refused."""
        self._closed = True
        for model in self._box_models.values():
            await close_chat_model(model)
        self._box_models.clear()
        if self.shared is not None:
            await self.shared.aclose()
        chains = list(self._chains.values()) + ([self._fixed_chain] if self._fixed_chain else [])
        for chain in chains:
            await chain.aclose()
        for link in self._links.values():
            await link.aclose()
        self._chains.clear()
        self._by_context.clear()
        self._links.clear()
