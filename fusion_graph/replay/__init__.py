"""Routing on recorded traffic: replay a conversation, load traces, calibrate the dial, plot.

- ``history``: route a recorded conversation exactly as the graph does
- ``traces``: recorded trajectories (OpenAI chat format): where they are, loading, step prices;
  ``sample_traces/``, a small synthetic set for a first run
- ``replayed``: route recorded trajectories with the graph's routing, and price each step
- ``resynthesis``: what ``resynthesize="local_replies"`` would add to a replay
- ``summary``: what replays add up to (the ``replay --json`` object)
- ``shares``: recorded scores re-routed under any dial, and the shares of steps and cost it gives
- ``calibration``: fit the dial on recorded trajectories
- ``evaluation``: measure a calibration on held-out trajectories (halves, rank statistics)
- ``labels``: offline labels (did the local model take the recorded action?): the steps to ask,
  the lines written and read back, shadow checks as labels
- ``labelling``: ask the local model each recorded step through the graph's ``ask``, a label each
- ``disagreement``: fit the dial on labels, to send the steps the local model gets wrong to cloud
- ``plot``: timelines, a summary of many trajectories, calibration curves (needs the ``plot`` extra)
- ``label_plot``: recall of disagreeing steps against the share on cloud, per dial (``plot`` extra)
- ``playback``: scripted models and tools that play a recording live through the graph (``demo``)
"""

from fusion_graph.replay.history import ReplayedStep, route_history

__all__ = ["ReplayedStep", "route_history"]
