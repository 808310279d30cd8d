"""Every notebook's code runs top to bottom against the current package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(
    path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(path.parent)
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert cells, f"{path.name} has no code"
    namespace: dict[str, object] = {"__name__": "__notebook__"}
    for cell in cells:
        exec(compile("".join(cell["source"]), f"{path.name}", "exec"), namespace)
    assert "cloud_share=" in capsys.readouterr().out
