"""Who answers an inference: providers, their health, the chain that walks them, and what it cost.

- ``models``: a provider (``Provider``: id, leg, model, prices, window), closing the clients its
  model owns, and the default chat models built from the settings
- ``openai_compatible``: ``ChatOpenAI`` with repairable tool-call arguments
- ``llama_server``: llama-server as the local leg (chat model, ``/props``, counting, the start line)
- ``http``: HTTP transports per event loop
- ``slots``: slot affinity in one process (each thread keeps its llama-server slot, per box too)
- ``placement``: where a local request goes (``Placer``): this process's slots, or shared leases
- ``chain``: the one provider call (``ask``), recorded; fallover between providers
  (``ProviderChain``); error classes and each provider's circuit (cooldown, probe)
- ``pricing``: per-provider prices and a thread's totals
- ``resolver``: the chain a run's context resolves to, what the local servers say about themselves
  (slots, windows), and the graph's placement
- ``sampling``: MCP sampling requests answered through the chain
"""

from fusion_graph.errors import (
    ChainExhausted,
    LlamaServerUnavailable,
    ProviderConfigError,
    ProviderRequestError,
)
from fusion_graph.providers.chain import ProviderChain
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph.providers.models import Provider
from fusion_graph.providers.resolver import ProviderResolver
from fusion_graph.providers.slots import SlotPool

__all__ = [
    "ChainExhausted",
    "ChatLlamaServer",
    "LlamaServerUnavailable",
    "Provider",
    "ProviderChain",
    "ProviderConfigError",
    "ProviderRequestError",
    "ProviderResolver",
    "SlotPool",
]
