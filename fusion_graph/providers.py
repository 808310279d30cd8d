"""Providers: who answers a leg's inference.

A ``Provider`` is an id, the leg it serves and its chat model. ``Providers``
resolves the provider for a leg: the model injected into ``build_graph``, or
an OpenAI-compatible ``ChatOpenAI`` built from the run's context (cached by
its settings so HTTP clients are reused across steps).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_openai import ChatOpenAI

from fusion_graph.context import FusionContext
from fusion_graph.llama import ChatLlamaServer, fetch_total_slots
from fusion_graph.routing import Leg
from fusion_graph.slots import SlotPool

#: llama-server ignores the key, but the OpenAI client insists on one.
LOCAL_API_KEY = "sk-no-key-required"


class ProviderConfigError(ValueError):
    """A provider cannot be built from the context; the message names the fix."""


@dataclass(frozen=True)
class Provider:
    """One answering endpoint: its id (as recorded in ``route_log``), leg and model."""

    id: str
    leg: Leg
    model: BaseChatModel

    @property
    def base_url(self) -> str | None:
        """The OpenAI-compatible base URL when the model speaks that wire format."""
        if isinstance(self.model, ChatOpenAI):
            return self.model.openai_api_base or None
        return None


def model_name(model: BaseChatModel) -> str:
    """A readable name for a chat model (its ``model_name``/``model`` or class name)."""
    for attr in ("model_name", "model"):
        value = getattr(model, attr, None)
        if isinstance(value, str) and value:
            return value
    return type(model).__name__


def build_cloud_model(context: FusionContext) -> BaseChatModel:
    """The cloud leg's default model: OpenAI, or any OpenAI-compatible ``cloud_base_url``."""
    key = os.environ.get(context.cloud_api_key_env)
    if not key:
        raise ProviderConfigError(
            f"the cloud leg needs an API key: set the environment variable "
            f"{context.cloud_api_key_env} (named by cloud_api_key_env), pass "
            "cloud_model=... to build_graph, or run with mode='local'"
        )
    kwargs: dict[str, Any] = {}
    if context.cloud_base_url:
        kwargs["base_url"] = context.cloud_base_url
    return ChatOpenAI(
        model=context.cloud_model,
        api_key=key,
        timeout=context.request_timeout,
        stream_usage=True,
        **kwargs,
    )


def build_local_model(context: FusionContext) -> BaseChatModel:
    """The local leg's default model: llama-server's OpenAI-compatible API."""
    return ChatLlamaServer(
        model=context.local_model,
        base_url=context.local_base_url,
        api_key=LOCAL_API_KEY,
        timeout=context.request_timeout,
        # langchain-openai only asks for streamed usage by itself when no
        # base_url is set; llama-server's cache numbers ride on that usage.
        stream_usage=True,
    )


class Providers:
    """Resolves the provider of each leg for a run."""

    def __init__(self, *, cloud: BaseChatModel | None = None, local: BaseChatModel | None = None) -> None:
        """Keep injected models; legs without one are built from the context on use."""
        self._injected: dict[Leg, BaseChatModel | None] = {"cloud": cloud, "local": local}
        self._built: dict[tuple[Any, ...], Provider] = {}
        self._pools: dict[tuple[str, int, bool], SlotPool] = {}

    async def for_leg(self, leg: Leg, context: FusionContext) -> Provider:
        """The provider serving ``leg`` under ``context``.

        Models are built in a worker thread: creating HTTP clients reads
        certificate files, a blocking call ``langgraph dev`` rejects on the event loop.
        """
        injected = self._injected[leg]
        if injected is not None:
            return Provider(id=f"{leg}:{model_name(injected)}", leg=leg, model=injected)
        if leg == "cloud":
            key: tuple[Any, ...] = (
                leg,
                context.cloud_model,
                context.cloud_base_url,
                context.cloud_api_key_env,
                context.request_timeout,
            )
        else:
            key = (leg, context.local_model, context.local_base_url, context.request_timeout)
        provider = self._built.get(key)
        if provider is None:
            build = build_cloud_model if leg == "cloud" else build_local_model
            model = await asyncio.to_thread(build, context)
            provider = Provider(id=f"{leg}:{model_name(model)}", leg=leg, model=model)
            self._built[key] = provider
        return provider

    async def slot_pool(self, provider: Provider, context: FusionContext) -> SlotPool | None:
        """The slot pool of a local provider, or ``None`` when it is not an HTTP llama-server.

        The slot count is ``context.local_slots`` when set, else the server's own
        ``total_slots`` (asked once per base URL). Pools live as long as the graph,
        so live threads keep their slots.
        """
        url = provider.base_url
        if provider.leg != "local" or url is None:
            return None
        reserve = context.reserve_reflection_slot
        known = [pool for (u, _, r), pool in self._pools.items() if u == url and r == reserve]
        if not context.local_slots and known:
            return known[0]
        total = context.local_slots or await fetch_total_slots(
            url, timeout=min(context.request_timeout, 10.0)
        )
        key = (url, total, reserve)
        if key not in self._pools:
            self._pools[key] = SlotPool(total, reserve_reflection=reserve)
        return self._pools[key]
