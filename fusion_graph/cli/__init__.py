"""The ``fusion-graph`` command line: a module per command (``run``, ``report``, ``doctor``...)."""

from fusion_graph.cli.app import app

__all__ = ["app"]
