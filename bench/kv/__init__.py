"""The KV-cache reuse benchmark: recorded trajectories replayed against real llama-servers.

``python -m bench.kv.reuse`` is the entry point (``--gateway``: two boxes behind
an smg gateway, in ``gateway``; ``--workers``: worker processes, in ``workers`` and
``workers_results``; both replay the threads of ``threads``); ``plan`` routes each
step, ``server`` sizes and starts the servers, ``replay`` runs the variants,
``results`` and ``report`` summarise them. See bench/README.md.
"""
