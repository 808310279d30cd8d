"""``python -m fusion_graph``: the ``fusion-graph`` command line."""

from fusion_graph.cli import app

app(prog_name="fusion-graph")
