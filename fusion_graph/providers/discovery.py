"""What the graph learns from the servers behind its local links: slots, windows, where to count.

llama-server says its slot count and per-slot window at ``GET /props``; the
graph asks once per server (a gateway: each box behind it, which must agree)
and keeps the answer. A server that is not llama-server is logged once and
then runs without slot affinity; one that cannot be reached is asked again
next time.
"""

from __future__ import annotations

import logging
import weakref

from fusion_graph.errors import LlamaServerUnavailable, LocalPoolMismatch, NotLlamaServer
from fusion_graph.providers.links import ChainLink
from fusion_graph.providers.llama_server import ServerProps, fetch_props
from fusion_graph.settings import FusionSettings

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
        self._windows: weakref.WeakKeyDictionary[ChainLink, int | None] = weakref.WeakKeyDictionary()

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

    def count_url(self, link: ChainLink) -> str | None:
        """Where a local link's prompts are counted (``/tokenize``): a box behind a gateway, else the link."""
        if link.leg == "local" and self.pooled:
            return self._count_url or self.settings.local_workers[0]
        return link.as_provider().base_url

    async def props(self, link: ChainLink) -> ServerProps | None:
        """What a local llama-server link's server says about itself (``GET /props``), asked once.

        ``None`` for a cloud link, a local server that is not llama-server (logged
        once; it then runs without slot affinity) and one that cannot be reached
        now (asked again next time; the call itself will then fail over, or
        succeed if the server is back). Behind a gateway (``local_workers``), the
        boxes are asked and must agree (``LocalPoolMismatch`` otherwise).
        """
        url = link.as_provider().base_url
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

    async def window(self, link: ChainLink) -> int | None:
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
        settled = link.leg == "cloud" or link.as_provider().base_url in self._props
        if settled or link.window is not None or self._window_setting(link):
            self._windows[link] = window
        return window

    def _window_setting(self, link: ChainLink) -> int:
        """The operator's window for ``link``'s leg (0: not set)."""
        if link.leg == "local":
            return self.settings.local_window_tokens or 0
        return self.settings.cloud_window_tokens or 0

    async def _window(self, link: ChainLink) -> int | None:
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
