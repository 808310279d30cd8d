"""What the worker processes of one deployment share, and which slot a thread gets and when.

- ``shared_state``: what the deployment's workers share in its Postgres (``shared_state="postgres"``):
  ``SharedState``, the runner every operation goes through (one loop thread, pool and guard), which
  holds one object per concern: ``shared_leases`` (slot leases and home boxes), ``shared_health``
  (provider cooldowns), ``shared_jobs`` (memory job claims) and ``shared_locks`` (slot turns and
  thread runs); ``shared_base`` holds what they all use (``SharedStateUnavailable``, keys, ``Runner``)
- ``slot_leases``: the pure rule of which (box, slot) a thread gets from a pool's leases, and
  ``LocalLeases``, the same rule on this process's own table
- ``slot_turns``: one request at a time on a slot (``SlotTurns``, this process's turns), and why
"""
