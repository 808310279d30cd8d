"""The tools side: built-in workspace tools, their file I/O, the batch rules and output caps.

- ``workspace``: ``read_file``/``list_dir``/``replace_in_file`` confined to the workspace
- ``files``: fd-relative, no-follow file I/O under them
- ``batch``: validation of a tool batch before anything runs (pure)
- ``output_cap``: a long tool result keeps its head and tail, marked
"""

from fusion_graph.tools.files import WorkspaceError
from fusion_graph.tools.workspace import make_workspace_tools

__all__ = ["WorkspaceError", "make_workspace_tools"]
