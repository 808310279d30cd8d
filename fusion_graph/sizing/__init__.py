"""Sizing a step, pure over plain data: the turn with its token counts, and compaction.

The fit rule (which windows can hold a step) is part of the cloud rule,
``fusion_graph.routing.rule``; the I/O around these functions (asking a server
to count, reading its window) is the step's ``Sizer`` in ``fusion_graph.nodes.step``.

- ``turn``: the turn in progress in graph state, its next step's signals and where it goes; token
  counts (character classes), prompt estimates anchored on what each leg's server last reported,
  and the history memo, so a step pays for its new messages only
- ``compaction``: make a conversation fit when no window can hold it
"""
