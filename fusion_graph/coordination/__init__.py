"""What the worker processes of one deployment share, and which slot a thread gets.

- ``shared_state``: slot leases and home boxes, provider cooldowns, memory job claims and thread
  runs in the deployment's Postgres (``shared_state="postgres"``), through one guarded path
- ``slot_leases``: the pure rule of which (box, slot) a thread gets from a pool's leases, and
  ``LocalLeases``, the same rule on this process's own table
"""
