"""Built-in workspace file tools: the mechanical read -> edit chains the router keeps local.

Every path is resolved against a workspace root and must stay inside it:
absolute paths, ``..`` escapes and symlinks that lead outside are refused
with a tool error the model can read. File I/O runs in a worker thread so the
event loop never blocks (``langgraph dev`` rejects blocking calls).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from langchain_core.tools import BaseTool, ToolException, tool
from langgraph.runtime import Runtime, get_runtime

from fusion_graph.context import FusionContext, ensure_context

MAX_READ_CHARS = 60_000
MAX_LIST_ENTRIES = 500


class WorkspaceError(ToolException):
    """A path or edit the workspace tools refuse; the message says why."""


def resolve_in_workspace(root: Path, path: str) -> Path:
    """Resolve ``path`` inside ``root`` or raise ``WorkspaceError``."""
    if not path or not path.strip():
        raise WorkspaceError("path is empty; give a path relative to the workspace root")
    candidate = Path(path)
    if candidate.is_absolute():
        raise WorkspaceError(f"absolute path {path!r} refused: give a path relative to the workspace root")
    base = root.resolve()
    target = (base / candidate).resolve()
    if target != base and not target.is_relative_to(base):
        raise WorkspaceError(f"path {path!r} leaves the workspace and was refused")
    return target


def _runtime_root() -> Path:
    """The workspace root of the current graph run (``FusionContext.workspace_root``)."""
    # Outside any runnable ``get_config`` raises; inside a plain ``tool.ainvoke``
    # (no graph) there is a config but no runtime in it, so ``get_runtime`` gives None.
    try:
        runtime: Runtime[FusionContext] | None = get_runtime(FusionContext)
    except RuntimeError:
        runtime = None
    if runtime is None:
        raise WorkspaceError(
            "no workspace root: run this tool inside the graph or build it with "
            "make_workspace_tools(root=...)"
        )
    return Path(ensure_context(runtime.context).workspace_root)


def _read(root: Path, path: str, start_line: int, end_line: int | None) -> str:
    target = resolve_in_workspace(root, path)
    if not target.is_file():
        raise WorkspaceError(f"{path!r} is not a file in the workspace")
    if start_line < 1 or (end_line is not None and end_line < start_line):
        raise WorkspaceError("line range must satisfy 1 <= start_line <= end_line")
    lines = target.read_text(encoding="utf-8", errors="replace").splitlines()
    chosen = lines[start_line - 1 : end_line]
    numbered = "\n".join(f"{start_line + i:>6}  {line}" for i, line in enumerate(chosen))
    if len(numbered) > MAX_READ_CHARS:
        numbered = numbered[:MAX_READ_CHARS] + "\n... (truncated; read a smaller line range)"
    return numbered or f"(no lines in range {start_line}-{end_line or len(lines)}; file has {len(lines)})"


def _list(root: Path, path: str) -> str:
    target = resolve_in_workspace(root, path)
    if not target.is_dir():
        raise WorkspaceError(f"{path!r} is not a directory in the workspace")
    entries = sorted(target.iterdir(), key=lambda p: (not p.is_dir(), p.name))
    shown = [f"{p.name}/" if p.is_dir() else p.name for p in entries[:MAX_LIST_ENTRIES]]
    if len(entries) > MAX_LIST_ENTRIES:
        shown.append(f"... ({len(entries) - MAX_LIST_ENTRIES} more)")
    return "\n".join(shown) or "(empty directory)"


def _replace(root: Path, path: str, old: str, new: str, count: int) -> str:
    target = resolve_in_workspace(root, path)
    if not target.is_file():
        raise WorkspaceError(f"{path!r} is not a file in the workspace")
    if not old:
        raise WorkspaceError("old text is empty; give the exact text to replace")
    text = target.read_text(encoding="utf-8")
    found = text.count(old)
    if found == 0:
        raise WorkspaceError(f"old text not found in {path!r}; read the file and copy the text exactly")
    if count > 0 and found != count:
        raise WorkspaceError(
            f"old text occurs {found} times in {path!r} but count={count}; "
            "include more context to make it unique, or pass count=0 to replace all"
        )
    target.write_text(text.replace(old, new), encoding="utf-8")
    return f"replaced {found} occurrence(s) in {path}"


def make_workspace_tools(root: str | Path | None = None) -> list[BaseTool]:
    """The built-in tools, confined to ``root`` (or to the run's ``workspace_root`` when ``None``)."""

    def base() -> Path:
        return Path(root) if root is not None else _runtime_root()

    @tool(parse_docstring=True)
    async def read_file(path: str, start_line: int = 1, end_line: int | None = None) -> str:
        """Read a text file of the workspace, with line numbers.

        Args:
            path: File path relative to the workspace root.
            start_line: First line to return (1-based).
            end_line: Last line to return (inclusive); omit for the end of the file.
        """
        return await asyncio.to_thread(_read, base(), path, start_line, end_line)

    @tool(parse_docstring=True)
    async def list_dir(path: str = ".") -> str:
        """List a directory of the workspace (directories end with '/').

        Args:
            path: Directory path relative to the workspace root.
        """
        return await asyncio.to_thread(_list, base(), path)

    @tool(parse_docstring=True)
    async def replace_in_file(path: str, old: str, new: str, count: int = 1) -> str:
        """Replace exact text in a workspace file.

        Args:
            path: File path relative to the workspace root.
            old: The exact text to replace.
            new: The replacement text.
            count: How many occurrences are expected (0 replaces all of them).
        """
        return await asyncio.to_thread(_replace, base(), path, old, new, count)

    return [read_file, list_dir, replace_in_file]


#: The default tools, resolved against each run's ``workspace_root``.
TOOLS: list[BaseTool] = make_workspace_tools()
