"""fusion-graph: a LangGraph agent that routes each step to a cloud or a local (llama-server) model."""

from fusion_graph.chain import ChainLink, ProviderChain
from fusion_graph.context import FusionContext
from fusion_graph.graph import build_graph, graph
from fusion_graph.llama import ChatLlamaServer
from fusion_graph.memory import MemoryJob
from fusion_graph.nodes import InvalidInput
from fusion_graph.replay import route_history
from fusion_graph.resolver import ProviderResolver
from fusion_graph.routing import (
    Leg,
    Mode,
    Pace,
    RouteDecision,
    StepScore,
    StepSignals,
    decide_leg,
    score_step,
)
from fusion_graph.serial import FusionGraph
from fusion_graph.settings import ContextError, FusionSettings
from fusion_graph.slots import SlotPool
from fusion_graph.state import InputState, RouteRecord, State
from fusion_graph.tools import TOOLS, make_workspace_tools

__all__ = [
    "TOOLS",
    "ChainLink",
    "ChatLlamaServer",
    "ContextError",
    "FusionContext",
    "FusionGraph",
    "FusionSettings",
    "InputState",
    "InvalidInput",
    "Leg",
    "MemoryJob",
    "Mode",
    "Pace",
    "ProviderChain",
    "ProviderResolver",
    "RouteDecision",
    "RouteRecord",
    "SlotPool",
    "State",
    "StepScore",
    "StepSignals",
    "build_graph",
    "decide_leg",
    "graph",
    "make_workspace_tools",
    "route_history",
    "score_step",
]
