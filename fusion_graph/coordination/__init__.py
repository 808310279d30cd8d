"""What the worker processes of one deployment share, and which slot a thread gets and when.

- ``shared_state``: slot leases and home boxes, slot turns, provider cooldowns, memory job claims
  and thread runs in the deployment's Postgres (``shared_state="postgres"``), through one guarded path
- ``slot_leases``: the pure rule of which (box, slot) a thread gets from a pool's leases, and
  ``LocalLeases``, the same rule on this process's own table
- ``slot_turns``: one request at a time on a slot (``SlotTurns``, this process's turns), and why
"""
