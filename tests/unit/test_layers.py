"""The package's import contracts (pyproject.toml ``[tool.importlinter]``) hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_layers_only_import_downwards_and_the_core_stays_pure() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 kept, 0 broken" in done.stdout


def test_the_top_of_the_package_is_grouped_by_subsystem() -> None:
    """At most 12 modules directly in ``fusion_graph/``; the rest live in a subpackage that names them."""
    top = sorted(path.name for path in (ROOT / "fusion_graph").glob("*.py"))
    assert len(top) <= 12, top
