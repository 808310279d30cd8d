"""fusion-graph: a LangGraph agent that routes each step to a cloud or a local (llama-server) model.

What users call or catch is here; each subpackage exports the rest
(``fusion_graph.providers``, ``fusion_graph.memory``, ``fusion_graph.replay``, ...).
Names are imported on first use, so ``fusion-graph --help`` and tools that
only need one subpackage start fast. ``graph`` is the default graph that
``langgraph.json`` serves (``fusion_graph/agent.py:graph``), built from the
``FUSION_*`` environment on first use.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fusion_graph.agent import build_graph
    from fusion_graph.context import FusionContext
    from fusion_graph.errors import (
        ChainExhausted,
        ContextError,
        FusionError,
        InvalidInput,
        LlamaServerUnavailable,
        ProviderConfigError,
        ProviderRequestError,
    )
    from fusion_graph.memory import MemoryJob, drain, sweep
    from fusion_graph.providers.chain import ProviderChain
    from fusion_graph.providers.llama_server import ChatLlamaServer
    from fusion_graph.providers.models import Provider
    from fusion_graph.replay import route_history
    from fusion_graph.routing.records import RouteRecord
    from fusion_graph.routing.rule import decide_leg
    from fusion_graph.routing.score import RouteDecision, score_step
    from fusion_graph.run_queue import FusionGraph
    from fusion_graph.settings import FusionSettings
    from fusion_graph.tools import make_workspace_tools

    graph: FusionGraph

try:
    __version__ = version("fusion-graph")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

#: Where each public name lives.
_EXPORTS = {
    "ChainExhausted": "fusion_graph.errors",
    "Provider": "fusion_graph.providers.models",
    "ChatLlamaServer": "fusion_graph.providers.llama_server",
    "ContextError": "fusion_graph.errors",
    "FusionError": "fusion_graph.errors",
    "FusionContext": "fusion_graph.context",
    "FusionSettings": "fusion_graph.settings",
    "InvalidInput": "fusion_graph.errors",
    "LlamaServerUnavailable": "fusion_graph.errors",
    "MemoryJob": "fusion_graph.memory",
    "ProviderChain": "fusion_graph.providers.chain",
    "ProviderConfigError": "fusion_graph.errors",
    "ProviderRequestError": "fusion_graph.errors",
    "RouteDecision": "fusion_graph.routing.score",
    "RouteRecord": "fusion_graph.routing.records",
    "build_graph": "fusion_graph.agent",
    "decide_leg": "fusion_graph.routing.rule",
    "drain": "fusion_graph.memory",
    "make_workspace_tools": "fusion_graph.tools",
    "route_history": "fusion_graph.replay",
    "score_step": "fusion_graph.routing.score",
    "sweep": "fusion_graph.memory",
}


def __getattr__(name: str) -> Any:
    """Import a public name on first use (see ``_EXPORTS``)."""
    if name == "graph":  # the compiled default graph, built on first use (not cached: the module keeps it)
        return importlib.import_module("fusion_graph.agent").graph
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module 'fusion_graph' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "ChainExhausted",
    "ChatLlamaServer",
    "ContextError",
    "FusionContext",
    "FusionError",
    "FusionSettings",
    "InvalidInput",
    "LlamaServerUnavailable",
    "MemoryJob",
    "Provider",
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
