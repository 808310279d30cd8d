"""Built-in workspace file tools: the mechanical read -> edit chains the router keeps local.

Every path is taken relative to a workspace root and walked without following
symlinks (see ``workspace_fs``): absolute paths, ``..`` escapes, symlinks and
hard-linked files are refused with a tool error the model can read. Edits
change only the replaced bytes (line endings, BOM, non-UTF-8 bytes and the
file mode stay) and land atomically. File I/O runs in a worker thread so the
event loop never blocks (``langgraph dev`` rejects blocking calls).
"""

from __future__ import annotations

import asyncio
import fnmatch
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from langchain_core.tools import BaseTool, tool
from langgraph.runtime import Runtime, get_runtime

from fusion_graph.context import FusionContext, ensure_context
from fusion_graph.settings import FusionSettings, workspace_subpath
from fusion_graph.tools.files import (
    WorkspaceError,
    WorkspaceRoot,
    decode_line,
    iter_lines,
    open_dir,
    open_file,
    read_limited,
    scan_dir,
    split_relative,
    write_atomic,
)

__all__ = [
    "MAX_EDIT_BYTES",
    "MAX_LIST_ENTRIES",
    "MAX_READ_CHARS",
    "TOOLS",
    "WorkspaceError",
    "make_workspace_tools",
    "resolve_in_workspace",
]

MAX_READ_CHARS = 60_000
MAX_LIST_ENTRIES = 500
#: replace_in_file holds the whole file (and its edited copy) in memory.
MAX_EDIT_BYTES = 16 * 1024 * 1024
# A UTF-8 character is at most 4 bytes, so this many bytes of a line always fill the output.
_LINE_CAP_BYTES = 4 * MAX_READ_CHARS


def resolve_in_workspace(root: Path, path: str) -> Path:
    """Resolve ``path`` inside ``root`` or raise ``WorkspaceError``.

    A path-based pre-check for callers; the tools themselves do not trust it
    (a symlink can change after it) and walk the path by descriptors instead.
    """
    parts = split_relative(path)
    base = root.resolve()
    target = base.joinpath(*parts).resolve()
    if target != base and not target.is_relative_to(base):
        raise WorkspaceError(f"path {path!r} leaves the workspace and was refused")
    return target


def _runtime_root(settings: FusionSettings | None) -> WorkspaceRoot:
    """The workspace root of the current graph run: the operator's, as the run's context narrows it."""
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
    context = ensure_context(runtime.context)
    operator = settings if settings is not None else _process_settings()
    base = Path(operator.workspace_root)
    if context.workspace_root is None:
        return WorkspaceRoot(base)
    return WorkspaceRoot(base, workspace_subpath(operator.workspace_root, context.workspace_root))


@functools.cache
def _process_settings() -> FusionSettings:
    """The operator settings of this process (read once), for tools built without settings."""
    return FusionSettings()


def secret_match(root: WorkspaceRoot, path: str, patterns: Sequence[str]) -> str | None:
    """The ``secret_files`` pattern that ``path`` (under ``root``) matches, or ``None``.

    A pattern matches one path component (``fnmatch``); one ending in ``/``
    matches a directory on the way (``.git/``: everything inside git's internals).
    """
    parts = [*root.sub, *split_relative(path)]
    for pattern in patterns:
        if pattern.endswith("/"):
            if any(fnmatch.fnmatchcase(part, pattern[:-1]) for part in parts[:-1]) or (
                parts and fnmatch.fnmatchcase(parts[-1], pattern[:-1])
            ):
                return pattern
        elif parts and fnmatch.fnmatchcase(parts[-1], pattern):
            return pattern
    return None


def _refuse_secret(root: WorkspaceRoot, path: str, settings: FusionSettings | None) -> None:
    patterns = (settings if settings is not None else _process_settings()).secret_files
    pattern = secret_match(root, path, patterns)
    if pattern is not None:
        raise WorkspaceError(
            f"{path!r} matches the secret-file pattern {pattern!r}: the workspace tools do not read, "
            "list or edit secret files (the operator's FUSION_SECRET_FILES lists them)"
        )


def _json_safe(text: str) -> str:
    """``text`` without lone surrogates, which would break the next model request."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _read(root: WorkspaceRoot, path: str, start_line: int, end_line: int | None) -> str:
    if start_line < 1 or (end_line is not None and end_line < start_line):
        raise WorkspaceError("line range must satisfy 1 <= start_line <= end_line")
    shown: list[str] = []
    used = total = offset = 0
    all_utf8 = True
    with open_file(root, path) as opened:
        size = opened.stat.st_size
        for number, line in enumerate(iter_lines(opened.file, _LINE_CAP_BYTES), start=1):
            total, offset = number, offset + line.size
            if number < start_line:
                continue
            text, utf8 = decode_line(line, first=number == 1)
            entry = f"{number:>6}  {text}"
            all_utf8 = all_utf8 and utf8
            if used + len(entry) > MAX_READ_CHARS:
                if shown:
                    left = max(size - offset + line.size, 0)
                    note = f"output limit reached before line {number}; read on with start_line={number}"
                else:
                    shown.append(entry[:MAX_READ_CHARS])
                    left = max(size - offset, 0)
                    note = f"line {number} was cut; read on with start_line={number + 1}"
                shown.append(f"... (cut at {MAX_READ_CHARS} characters: {note}; {left} bytes follow)")
                break
            shown.append(entry)
            used += len(entry) + 1
            if number == end_line:
                break
    if not shown:
        return f"(no lines in range {start_line}-{end_line or total}; file has {total})"
    if not all_utf8:
        shown.append("(not valid UTF-8: odd bytes are shown as \\xNN; only ASCII text can be replaced here)")
    return "\n".join(shown)


def _list(root: WorkspaceRoot, path: str) -> str:
    with open_dir(root, path) as fd:
        shown, total = scan_dir(fd, MAX_LIST_ENTRIES)
    if total > len(shown):
        shown.append(f"... ({total - len(shown)} more; list a subdirectory to narrow it down)")
    return "\n".join(shown) or "(empty directory)"


def _encode(name: str, text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise WorkspaceError(f"{name} text contains lone surrogates; send plain Unicode text") from None


def _newline_variants(data: bytes, old: str, new: str) -> list[tuple[bytes, bytes]]:
    """``(old, new)`` pairs to try, in the file's own line endings first."""
    crlf = data.count(b"\r\n")
    lone_lf = data.count(b"\n") - crlf
    styles: list[str | None] = [None]
    if crlf:
        styles = ["\r\n"] if not lone_lf else [None, "\r\n", "\n"]
    elif lone_lf:
        styles = [None, "\n"]
    pairs: list[tuple[bytes, bytes]] = []
    for style in styles:
        o, n = (old, new) if style is None else (_with_newlines(old, style), _with_newlines(new, style))
        pair = (_encode("old", o), _encode("new", n))
        if pair not in pairs:
            pairs.append(pair)
    return pairs


def _with_newlines(text: str, newline: str) -> str:
    return text.replace("\r\n", "\n").replace("\n", newline)


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def apply_replacement(data: bytes, path: str, old: str, new: str, count: int) -> tuple[bytes, int]:
    """``data`` with ``old`` replaced by ``new`` (every other byte kept) and how often it was found."""
    if not _is_utf8(data) and not (old.isascii() and new.isascii()):
        raise WorkspaceError(
            f"{path!r} is not valid UTF-8 (perhaps latin-1); only ASCII old and new text can be "
            "replaced in it without changing its other bytes"
        )
    pairs = _newline_variants(data, old, new)
    old_bytes, new_bytes = next((pair for pair in pairs if pair[0] in data), pairs[0])
    found = data.count(old_bytes)
    if not found:
        raise WorkspaceError(f"old text not found in {path!r}; read the file and copy the text exactly")
    if count > 0 and found != count:
        raise WorkspaceError(
            f"old text occurs {found} times in {path!r} but count={count}; "
            "include more context to make it unique, or pass count=0 to replace all"
        )
    return data.replace(old_bytes, new_bytes), found


def _replace(root: WorkspaceRoot, path: str, old: str, new: str, count: int) -> str:
    if not old:
        raise WorkspaceError("old text is empty; give the exact text to replace")
    if count < 0:
        raise WorkspaceError(f"count must be 0 (replace every occurrence) or more, got {count}")
    _encode("old", old)
    _encode("new", new)
    with open_file(root, path, for_edit=True) as opened:  # holds the edit lock: edits queue here
        data = read_limited(opened, MAX_EDIT_BYTES, path)
        if already_applied(data, old, new):
            return f"already applied: {path} already has the new text and not the old (no change made)"
        updated, found = apply_replacement(data, path, old, new, count)
        if updated != data:
            write_atomic(opened, updated, path)
    return f"replaced {found} occurrence(s) in {path}"


def already_applied(data: bytes, old: str, new: str) -> bool:
    """Whether an edit's result is already in ``data``: ``new`` is there, and ``old`` only inside it.

    A tool call that ran, and runs again on resume (LangGraph runs a task at
    least once), then reports its edit as applied instead of failing or editing twice.
    """
    if not new or old == new:
        return False
    for old_bytes, new_bytes in _newline_variants(data, old, new):
        if new_bytes in data and old_bytes not in data.replace(new_bytes, b""):
            return True
    return False


def make_workspace_tools(
    root: str | Path | None = None, *, settings: FusionSettings | None = None
) -> list[BaseTool]:
    """The built-in tools, confined to ``root``.

    Without ``root`` each run gets the operator's ``workspace_root`` (from
    ``settings``, else the process's ``FusionSettings``), narrowed by the run
    context's ``workspace_root`` when it names a directory inside it.
    """

    def _guarded(run: Callable[..., str], where: WorkspaceRoot, path: str, *args: Any) -> str:
        """``run`` unless ``path`` is a secret file (checked in the worker thread: settings may read .env)."""
        _refuse_secret(where, path, settings)
        return run(where, path, *args)

    def base() -> WorkspaceRoot:
        return WorkspaceRoot(Path(root)) if root is not None else _runtime_root(settings)

    @tool(parse_docstring=True)
    async def read_file(path: str, start_line: int = 1, end_line: int | None = None) -> str:
        """Read a text file of the workspace, with line numbers.

        Args:
            path: File path relative to the workspace root.
            start_line: First line to return (1-based).
            end_line: Last line to return (inclusive); omit for the end of the file.
        """
        return _json_safe(await asyncio.to_thread(_guarded, _read, base(), path, start_line, end_line))

    @tool(parse_docstring=True)
    async def list_dir(path: str = ".") -> str:
        """List a directory of the workspace (directories end with '/', symlinks with '@').

        Args:
            path: Directory path relative to the workspace root.
        """
        return _json_safe(await asyncio.to_thread(_guarded, _list, base(), path))

    @tool(parse_docstring=True)
    async def replace_in_file(path: str, old: str, new: str, count: int = 1) -> str:
        """Replace exact text in a workspace file.

        Args:
            path: File path relative to the workspace root.
            old: The exact text to replace.
            new: The replacement text.
            count: How many occurrences are expected (0 replaces all of them; never negative).
        """
        return _json_safe(await asyncio.to_thread(_guarded, _replace, base(), path, old, new, count))

    return [read_file, list_dir, replace_in_file]


#: The default tools, resolved against each run's ``workspace_root``.
TOOLS: list[BaseTool] = make_workspace_tools()
