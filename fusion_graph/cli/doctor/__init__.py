"""``fusion-graph doctor``: check an operator's set-up, one row per check, and say how to fix each.

Checks, in order: the cloud key (by variable name, never its value), the cloud
endpoint (``GET /models``; ``--live`` adds a one-token completion) and the
cloud model's price, llama-server (``GET /props``: slots, per-slot window
against the completion budget and the first prompt, the chat template's tool
support, and ``POST /apply-template`` with a tool to see whether ``--jinja`` is
on; ``--live`` adds its measured tokens/s against ``request_timeout``), or a
gateway over several, the workspace, and the checkpoint database.

- ``rows``: the ``Check`` row and the wording the checks share
- ``cloud``: the key, the endpoint, the price
- ``props``: what ``/props`` and the tools probe say (pure)
- ``llama``: reaching llama-server
- ``speed``: ``--live``: its tokens/s, and whether a full answer fits ``request_timeout``
- ``gateway``: a gateway over several llama-servers
- ``workspace``: the directory the tools use
- ``checkpoints``: the store ``run`` writes
- ``command``: the command itself, and the table
"""

from fusion_graph.cli.doctor.command import doctor
from fusion_graph.cli.doctor.rows import Check

__all__ = ["Check", "doctor"]
