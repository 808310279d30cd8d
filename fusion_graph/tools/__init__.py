"""The built-in workspace tools and their file I/O.

How any tool call is checked, dispatched and capped is the ``tools`` node's
work (``fusion_graph.nodes.tools``), whichever tools the graph was given.

- ``workspace``: ``read_file``/``list_dir``/``replace_in_file`` confined to the workspace
- ``files``: fd-relative, no-follow file I/O under them
"""

from fusion_graph.tools.files import WorkspaceError
from fusion_graph.tools.workspace import make_workspace_tools

__all__ = ["WorkspaceError", "make_workspace_tools"]
