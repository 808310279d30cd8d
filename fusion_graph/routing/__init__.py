"""When a step goes to cloud: the score, the rule (with its budget and fit bounds), trouble, the records.

Pure functions and plain types with no graph runtime, HTTP client or provider
SDK (an import contract checks it), low in the package's layers (only the
errors, prompts, redaction and internals sit below), so the graph, replay,
calibration and the CLI all decide a step with this code.

- ``score``: a step's signals, their points (the four terms, and the trouble terms when on) and
  the ``RouteDecision`` a route hands on
- ``rule``: when a step goes to cloud (threshold, hysteresis, the plan rule, the paced dial, the
  escalation latch), the cloud budget per turn and per thread, and the fit bounds of each
  provider's window: changing when a step goes to cloud is an edit here
- ``trouble``: the trouble signals of a turn (tool errors, no progress, progress events)
- ``records``: step kinds, ``RouteRecord`` and the totals over records (the route log)
"""
