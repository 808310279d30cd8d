"""Sizing a step, pure over plain data: token counts, anchored estimates, the fit rule, compaction, the turn.

- ``tokens``: the default token estimator (character classes) and prompt estimates
- ``estimate``: a leg's estimate anchored on what its server last reported
- ``fit``: which links' windows can hold a step, and the conversation budget
- ``compaction``: make a conversation fit when no window can hold it
- ``turn``: the turn in progress in graph state, its next step's signals and where it goes
- ``history_memo``: folds over a growing history, remembered, so a step pays for its new messages
"""
