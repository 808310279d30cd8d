"""Relative paths applied lexically: ``.`` and ``..`` resolved without touching the filesystem."""

from __future__ import annotations


def lexical_parts(path: str) -> list[str] | None:
    """The components of relative ``path`` with ``.`` and ``..`` applied; ``None`` if it climbs above.

    Pure string work (it may run on an event loop): what the names are on disk,
    symlinks included, is for the caller's descriptor walk to find out.
    """
    parts: list[str] = []
    for name in path.split("/"):
        if name in ("", "."):
            continue
        if name != "..":
            parts.append(name)
        elif parts:
            parts.pop()
        else:
            return None
    return parts
