"""Doctor's workspace rows: a readable (and writable) directory, and no ``.env`` the file tools could read."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fusion_graph.cli.doctor.rows import Check

if TYPE_CHECKING:
    from fusion_graph.settings import FusionSettings


def workspace_checks(settings: FusionSettings, source: str) -> list[Check]:
    """``workspace_root`` is a readable directory; a ``.env`` inside it is a ``secret_files`` match."""
    root = Path(settings.workspace_root)
    shown = (
        f"{root} ({source})" if str(root) == str(root.resolve()) else f"{root} = {root.resolve()} ({source})"
    )
    fix = "set FUSION_WORKSPACE_ROOT (or `fusion-graph run --workspace`) to the project directory"
    if not root.exists():
        return [Check("workspace", "fail", f"{shown} does not exist", fix)]
    if not root.is_dir():
        return [Check("workspace", "fail", f"{shown} is not a directory", fix)]
    if not os.access(root, os.R_OK | os.X_OK):
        return [Check("workspace", "fail", f"{shown} is not readable", f"chmod u+rx {root}, or {fix}")]
    checks = [
        Check("workspace", "ok", f"{shown} is a readable, writable directory")
        if os.access(root, os.W_OK)
        else Check(
            "workspace",
            "warn",
            f"{shown} is readable but not writable: the edit tools will fail",
            f"chmod u+w {root}",
        )
    ]
    return [*checks, _dotenv_secret_check(root, settings.secret_files)]


def _dotenv_secret_check(root: Path, patterns: Sequence[str]) -> Check:
    """``.env`` files at the workspace's top level must match a ``secret_files`` pattern."""
    from fusion_graph.tools.files import WorkspaceRoot
    from fusion_graph.tools.workspace import secret_match

    try:
        names = sorted(p.name for p in root.iterdir() if p.name == ".env" or p.name.startswith(".env."))
    except OSError as error:
        return Check("workspace secrets", "warn", f"cannot list {root}: {error.strerror}")
    exposed = [n for n in names if secret_match(WorkspaceRoot(root), n, patterns) is None]
    if exposed:
        return Check(
            "workspace secrets",
            "warn",
            f"{', '.join(exposed)} in the workspace and not covered by secret_files: the file tools "
            "can read it (and send it to the model)",
            'add ".env" and ".env.*" to FUSION_SECRET_FILES (unset it for the defaults)',
        )
    if names:
        return Check("workspace secrets", "ok", f"{', '.join(names)} covered by secret_files (top level)")
    return Check("workspace secrets", "ok", "no .env at the workspace's top level")
