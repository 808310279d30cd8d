"""Fusion routing for agents built with LangChain's ``create_agent``: one middleware on the same core.

- ``fusion_routing``: ``FusionRoutingMiddleware``, each model call of the agent scored, routed to the
  local or the cloud model, placed on the thread's llama-server slot, walked along the provider
  chain on failure and recorded, as the graph does
"""

from fusion_graph.middleware.fusion_routing import FusionRoutingMiddleware, FusionRoutingState

__all__ = ["FusionRoutingMiddleware", "FusionRoutingState"]
