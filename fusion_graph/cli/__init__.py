"""The ``fusion-graph`` command line, one module per command (``run``, ``traces``, ``report``)."""

from fusion_graph.cli.app import app

__all__ = ["app"]
