"""Routing on recorded traffic: replay a conversation, load traces, calibrate the dial, plot.

- ``history``: route a recorded conversation exactly as the graph does
- ``traces``: recorded trajectories (OpenAI chat format): load, replay, summarise
- ``calibration``: fit the dial on recorded trajectories
- ``plot``: timelines, a summary of many trajectories, calibration curves (needs the ``plot`` extra)
"""

from fusion_graph.replay.history import ReplayedStep, route_history

__all__ = ["ReplayedStep", "route_history"]
