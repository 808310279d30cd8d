"""Providers: who answers a leg's inference, and the default models built from the settings.

A ``Provider`` is one answering endpoint of the chain: an id (as recorded in
``route_log``), the leg it serves, its chat model, its prices, its window and
the base URL read once from the model. The chain, the placement, the fit rule
and the records all take this one class, so what a provider is lives beside
how it is built and closed. What kind of client a model is (``speaks_openai``:
the OpenAI-compatible wire, whose requests carry a llama-server slot's body
fields and headers) is asked here only, once per provider.

Default models are OpenAI-compatible ``ChatOpenAI`` clients with their own HTTP
client and no client-side retries: the provider chain is the retry. Closing a
provider (``Provider.aclose``, once) closes only the HTTP clients its model
owns (``owned_clients``), so it really releases its connections without
breaking a sibling that shares langchain-openai's cached client.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_openai import ChatOpenAI
from langchain_openai.chat_models.base import BaseChatOpenAI

from fusion_graph.errors import ProviderConfigError
from fusion_graph.providers.http import loop_safe_client
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph.providers.openai_compatible import ChatOpenAICompatible
from fusion_graph.providers.pricing import Pricing, pricing_for
from fusion_graph.redact import register_model_secrets, register_secret
from fusion_graph.routing.score import Leg
from fusion_graph.settings import FusionSettings

#: llama-server ignores the key, but the OpenAI client insists on one.
LOCAL_API_KEY = "sk-no-key-required"


def register_cloud_key(settings: FusionSettings, cloud: object | None = None) -> None:
    """Register the operator's cloud key (and an injected cloud model's) for scrubbing, now.

    Called when a graph reads its settings (``ProviderResolver``), not when the
    cloud model is first built: a run that never builds it (``mode="local"``, a
    cloud leg down) may still meet the key, in a workspace file ``read_file``
    returns, and the tool message, the next local request and the checkpoint
    must not carry it.
    """
    secret = settings.api_key()
    register_secret(secret.get_secret_value() if secret is not None else None)
    if cloud is not None:
        register_model_secrets(cloud)


def build_cloud_model(settings: FusionSettings) -> BaseChatModel:
    """The cloud leg's default model: OpenAI, or any OpenAI-compatible ``cloud_base_url``.

    The key is registered with ``redact.register_secret``, so no error text
    fusion-graph records or logs can carry it.
    """
    secret = settings.api_key()
    key = secret.get_secret_value() if secret is not None else None
    register_secret(key)
    if not key:
        raise ProviderConfigError(
            f"the cloud leg needs an API key: set the environment variable "
            f"{settings.cloud_api_key_env} (named by FUSION_CLOUD_API_KEY_ENV) or FUSION_CLOUD_API_KEY, pass "
            "cloud_model=... to build_graph, or run with mode='local'"
        )
    kwargs: dict[str, Any] = {}
    if settings.cloud_base_url:
        kwargs["base_url"] = settings.cloud_base_url
    return ChatOpenAICompatible(
        model=settings.cloud_model,
        api_key=secret,
        timeout=settings.request_timeout,
        max_retries=0,
        stream_usage=True,
        http_async_client=loop_safe_client(settings.request_timeout),
        **kwargs,
    )


def build_local_model(settings: FusionSettings) -> BaseChatModel:
    """The local leg's default model: llama-server's OpenAI-compatible API."""
    return ChatLlamaServer(
        model=settings.local_model,
        base_url=settings.local_base_url,
        api_key=LOCAL_API_KEY,
        timeout=settings.request_timeout,
        max_retries=0,
        http_async_client=loop_safe_client(settings.request_timeout),
        # langchain-openai only asks for streamed usage by itself when no
        # base_url is set; llama-server's cache numbers ride on that usage.
        stream_usage=True,
        # Behind a gateway, which box served (one response header, kept as ``served_by``).
        include_response_headers=bool(settings.local_worker_header),
        worker_header=settings.local_worker_header or None,
    )


Closer = Callable[[BaseChatModel], Awaitable[None]]


def owned_clients(model: BaseChatModel) -> list[object]:
    """The HTTP clients ``model`` owns, i.e. those safe to close with it.

    langchain-openai shares one cached default httpx client among every
    ``ChatOpenAI`` with the same base URL and (hashable) timeout; closing it
    would break the siblings, including a provider's replacement. Owned are
    explicit ``http_client``/``http_async_client`` (also per model under
    ``openai_proxy``) and the private clients built for an unhashable timeout.
    """
    if not isinstance(model, ChatOpenAI):
        return []
    owned: list[object] = [c for c in (model.http_async_client, model.http_client) if c is not None]
    try:
        hash(model.request_timeout)
    except TypeError:
        pairs = ((model.http_async_client, model.root_async_client), (model.http_client, model.root_client))
        owned += [root for explicit, root in pairs if explicit is None and root is not None]
    return owned


async def close_chat_model(model: BaseChatModel) -> None:
    """The default ``Closer``: close the HTTP clients ``model`` owns (see ``owned_clients``)."""
    for client in owned_clients(model):
        closer = getattr(client, "aclose", None) or getattr(client, "close", None)
        result = closer() if closer is not None else None
        if isinstance(result, Awaitable):
            await result


def speaks_openai(model: BaseChatModel) -> bool:
    """Whether ``model`` speaks the OpenAI-compatible wire (langchain-openai's client, llama-server's).

    Such a request may carry body fields (a llama-server slot) and headers, and
    its slot can be primed; any other chat model gets the plain call.
    """
    return isinstance(model, BaseChatOpenAI)


@dataclass(eq=False)
class Provider:
    """One answering endpoint of the chain: its id (as recorded in ``route_log``), leg, model and prices.

    Providers compare by identity: a rebuilt provider is a new one. ``pricing``
    defaults to ``pricing_for`` the provider; ``window`` (tokens it holds per
    request, prompt + completion) ``None`` lets the resolver find it (operator
    setting, llama-server's ``/props``, the model's profile). ``base_url`` is
    read from the model once: slot pools, locks and call configs key on it.
    """

    id: str
    leg: Leg
    model: BaseChatModel
    pricing: Pricing = None  # type: ignore[assignment]  # set in __post_init__ when not given
    close: Closer = close_chat_model
    window: int | None = None
    base_url: str | None = field(default=None, init=False)
    openai_wire: bool = field(default=False, init=False)
    """The model speaks the OpenAI-compatible wire: a request may carry body fields and headers."""
    max_tokens: int | None = field(default=None, init=False)
    """The model's own completion cap (``max_tokens``), when it sets one: a step never asks for more."""
    _closed: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        """Read the model's kind, base URL and cap once, price the provider, register its key for scrubbing.

        The one place that asks what kind of client a model is: the chain, the
        placement and the memory jobs read ``openai_wire`` and ``base_url``.
        """
        self.openai_wire = speaks_openai(self.model)
        own = getattr(self.model, "max_tokens", None)
        self.max_tokens = own if isinstance(own, int) and own > 0 else None
        if isinstance(self.model, ChatOpenAI):
            self.base_url = self.model.openai_api_base or None
        if self.pricing is None:
            self.pricing = pricing_for(self)
        register_model_secrets(self.model)  # its key is scrubbed from error texts from now on

    @property
    def closed(self) -> bool:
        """Whether ``aclose`` ran."""
        return self._closed

    async def aclose(self) -> None:
        """Tear the model down; idempotent, so it happens at most once."""
        if not self._closed:
            self._closed = True
            await self.close(self.model)
