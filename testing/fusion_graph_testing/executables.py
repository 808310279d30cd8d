"""Finding the executables the harness starts (``smg``, ``langhost``, ``redis-server``, ``llama-server``).

Every lookup follows one rule: ``$X_BIN`` (an explicit choice) wins, and when it
names no executable file the lookup fails instead of falling back, so a typo in
the variable is reported rather than silently replaced; otherwise the candidates
are tried in the order given. Nothing is installed or built here.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def is_executable(path: Path) -> bool:
    """Whether ``path`` is a file this process may execute (a directory or a plain file is not)."""
    return path.is_file() and os.access(path, os.X_OK)


def find_executable(env_var: str, *candidates: Path | str) -> Path | None:
    """``$env_var`` when set (None if it is not an executable file), else the first candidate found.

    A ``Path`` candidate counts when it is executable (:func:`is_executable`); a ``str``
    candidate is a command name looked up on ``PATH`` with ``shutil.which``. Each
    finder states its own order with these, so all of them treat ``$X_BIN`` alike.
    """
    explicit = os.environ.get(env_var)
    if explicit:
        path = Path(explicit).expanduser()
        return path if is_executable(path) else None
    for candidate in candidates:
        if isinstance(candidate, str):
            on_path = shutil.which(candidate)
            if on_path:
                return Path(on_path)
        elif is_executable(candidate):
            return candidate
    return None


def bad_explicit(env_var: str) -> str | None:
    """Why ``$env_var`` failed a lookup when it is set (None when it is not): the one wording for all."""
    explicit = os.environ.get(env_var)
    if explicit:
        return f"{env_var}={explicit} is not an executable file; fix or unset it"
    return None


def require_executable(found: Path | None, env_var: str, error: type[Exception], missing: str) -> Path:
    """``found``, or ``error`` saying what is wrong: ``$env_var`` names no executable, else ``missing``.

    ``found`` is the finder's answer for ``env_var``; the ``ensure_*`` functions raise with it,
    so a bad ``$X_BIN`` reads the same whichever executable it is.
    """
    if found is not None:
        return found
    raise error(bad_explicit(env_var) or missing)
