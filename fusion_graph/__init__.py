"""fusion-graph: a LangGraph agent that routes each step to a cloud or a local (llama-server) model.

What users call or catch is here; each subpackage exports the rest
(``fusion_graph.providers``, ``fusion_graph.memory``, ``fusion_graph.replay``, ...).
``graph`` is the default graph that ``langgraph.json`` serves, built from the
``FUSION_*`` environment at import.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fusion_graph.context import FusionContext
from fusion_graph.graph import build_graph, graph
from fusion_graph.memory import MemoryJob, drain, sweep
from fusion_graph.nodes import InvalidInput
from fusion_graph.providers.chain import ChainExhausted, ChainLink, ProviderChain, ProviderRequestError
from fusion_graph.providers.llama_server import ChatLlamaServer, LlamaServerUnavailable
from fusion_graph.providers.models import ProviderConfigError
from fusion_graph.replay import route_history
from fusion_graph.routing import RouteDecision, decide_leg, score_step
from fusion_graph.settings import ContextError, FusionSettings
from fusion_graph.state import RouteRecord
from fusion_graph.tools import make_workspace_tools

try:
    __version__ = version("fusion-graph")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"


__all__ = [
    "ChainExhausted",
    "ChainLink",
    "ChatLlamaServer",
    "ContextError",
    "FusionContext",
    "FusionSettings",
    "InvalidInput",
    "LlamaServerUnavailable",
    "MemoryJob",
    "ProviderChain",
    "ProviderConfigError",
    "ProviderRequestError",
    "RouteDecision",
    "RouteRecord",
    "__version__",
    "build_graph",
    "decide_leg",
    "drain",
    "graph",
    "make_workspace_tools",
    "route_history",
    "score_step",
    "sweep",
]
