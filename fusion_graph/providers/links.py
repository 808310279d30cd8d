"""A provider in the chain (``ChainLink``), and closing the HTTP clients its model owns, exactly once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from langchain_core.language_models import BaseChatModel
from langchain_openai import ChatOpenAI

from fusion_graph.providers.models import Provider
from fusion_graph.providers.pricing import Pricing, pricing_for
from fusion_graph.redact import register_model_secrets
from fusion_graph.routing.score import Leg

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


@dataclass(eq=False)
class ChainLink:
    """A provider in the chain. Links compare by identity: a rebuilt provider is a new link.

    ``window``: tokens the provider holds per request (prompt + completion); ``None``
    lets the resolver find it (operator setting, llama-server's ``/props``, the
    model's profile).
    """

    id: str
    leg: Leg
    model: BaseChatModel
    pricing: Pricing
    close: Closer = close_chat_model
    window: int | None = None
    _closed: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        register_model_secrets(self.model)  # its key is scrubbed from error texts from now on

    @classmethod
    def from_provider(
        cls, provider: Provider, pricing: Pricing | None = None, close: Closer = close_chat_model
    ) -> ChainLink:
        """Wrap a ``providers.Provider``; ``pricing`` defaults to ``pricing_for(provider)``."""
        return cls(provider.id, provider.leg, provider.model, pricing or pricing_for(provider), close)

    @property
    def closed(self) -> bool:
        """Whether ``aclose`` ran."""
        return self._closed

    def as_provider(self) -> Provider:
        """This link as a ``providers.Provider`` (slot pools, call configs, ``base_url``)."""
        return Provider(id=self.id, leg=self.leg, model=self.model)

    async def aclose(self) -> None:
        """Tear the model down; idempotent, so it happens at most once."""
        if not self._closed:
            self._closed = True
            await self.close(self.model)
