"""Who answers an inference: providers, their health, the chain that walks them, and what it cost.

- ``models``: a provider (leg, model, endpoint) and the default chat models built from the settings
- ``openai_compatible``: ``ChatOpenAI`` with repairable tool-call arguments
- ``llama_server``: llama-server as the local leg (chat model, ``/props`` discovery, counting)
- ``slots``: slot affinity (each thread keeps its llama-server slot, so its KV cache)
- ``health``: classify an error; one provider's circuit (cooldown, probe)
- ``chain``: fallover between providers (``ProviderChain``, ``ChainExhausted``)
- ``pricing``: per-provider prices and a thread's totals
- ``resolver``: the chain a run's context resolves to
- ``records``: one route record per answered inference
- ``sizes``: windows, budgets and prompt estimates of a step (the I/O around ``sizing``)
- ``inference``: one inference through the chain, recorded
"""

from fusion_graph.errors import (
    ChainExhausted,
    LlamaServerUnavailable,
    ProviderConfigError,
    ProviderRequestError,
)
from fusion_graph.providers.chain import ChainLink, ProviderChain
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph.providers.models import Provider
from fusion_graph.providers.resolver import ProviderResolver
from fusion_graph.providers.slots import SlotPool

__all__ = [
    "ChainExhausted",
    "ChainLink",
    "ChatLlamaServer",
    "LlamaServerUnavailable",
    "Provider",
    "ProviderChain",
    "ProviderConfigError",
    "ProviderRequestError",
    "ProviderResolver",
    "SlotPool",
]
