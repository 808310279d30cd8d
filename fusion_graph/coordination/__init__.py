"""What the worker processes of one deployment share, and which slot a thread gets and when.

- ``shared_state``: what the deployment's workers share in its Postgres (``shared_state="postgres"``):
  ``SharedState``, the runner every operation goes through (one loop thread, pool and guard), which
  holds one object per concern, each in a module below
- ``shared_leases``: slot leases and home boxes (``SlotLeases``)
- ``shared_health``: provider cooldowns, pushed with ``NOTIFY`` (``ProviderHealth``)
- ``shared_jobs``: memory job claims (``JobClaims``)
- ``shared_locks``: slot turns and thread run locks, Postgres advisory locks (``AdvisoryLocks``)
- ``shared_base``: what the concerns all use (``SharedStateUnavailable``, keys, the ``Runner`` they reach)
- ``slot_leases``: the pure rule of which (box, slot) a thread gets from a pool's leases, and
  ``LocalLeases``, the same rule on this process's own table
- ``slot_turns``: one request at a time on a slot (``SlotTurns``, this process's turns), and why
"""
