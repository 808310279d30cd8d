"""The graph's nodes, one module per concern.

- ``step``: a step from decision to answer: the routing edge (or the ``route`` node that joins a
  batch), the ``Sizer``, the ``plan``, ``local``, ``cloud`` and ``repair`` nodes, and the edge after them
- ``tools``: the batch rules, one ``Send`` per tool call, and LangGraph's ``ToolNode`` for one call
  with the graph's hook (sampling records, scrub, output cap)
- ``memory``: recall into a new turn and the memory jobs after a reply
- ``synthesis``: cloud re-writes a turn's final reply when the local leg wrote it (and the edge after)
- ``shadow``: the cloud leg asked beside a share of local steps, to record whether it acts alike
- ``ends``: ``step_limit``, ``give_up`` and ``unavailable`` (every provider down)
"""

from fusion_graph.context import memory_on
from fusion_graph.errors import InvalidInput
from fusion_graph.nodes.ends import give_up, step_limit, unavailable
from fusion_graph.nodes.memory import MemoryNodes
from fusion_graph.nodes.step import AFTER_TOOLS, Destination, InferenceNodes, RouteNode, after_model
from fusion_graph.nodes.synthesis import SynthesisNode, after_synthesis, wants_synthesis
from fusion_graph.nodes.tools import sends, tools_node

__all__ = [
    "AFTER_TOOLS",
    "Destination",
    "InferenceNodes",
    "InvalidInput",
    "MemoryNodes",
    "RouteNode",
    "SynthesisNode",
    "after_model",
    "after_synthesis",
    "give_up",
    "memory_on",
    "sends",
    "step_limit",
    "tools_node",
    "unavailable",
    "wants_synthesis",
]
