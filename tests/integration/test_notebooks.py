"""Every notebook's code runs top to bottom against the current package.

Cells run in one event loop with top-level ``await`` allowed, as in Jupyter.
The notebooks read the shared traces (``../shared/data/traces``): without them
the notebook tests skip, and a separate test checks that each notebook then
fails loudly instead of inventing data.
"""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))
TRACES = Path(__file__).parents[3] / "shared" / "data" / "traces"
#: The variable a notebook reads to find the traces (its default is ../../shared/data/traces).
TRACES_ENV = "FUSION_TRACES_DIR"

#: What each notebook must print when it ran through: its own result, not just any output.
EXPECTED_OUTPUT = {
    "route_replay.ipynb": ["cloud_share= 30 h=10", "flips="],
    "quickstart.ipynb": ["route log", "calibrated dial on unseen trajectories", "target 0.30 -> achieved"],
}


async def run_notebook(path: Path, namespace: dict[str, object]) -> None:
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert cells, f"{path.name} has no code"
    for cell in cells:
        code = compile("".join(cell["source"]), path.name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(code, namespace)
        if inspect.iscoroutine(result):
            await result


def test_every_notebook_has_expectations() -> None:
    assert sorted(EXPECTED_OUTPUT) == [p.name for p in NOTEBOOKS]


@pytest.mark.skipif(not TRACES.is_dir(), reason=f"the notebooks replay the shared traces ({TRACES})")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
async def test_notebook_runs(
    path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(path.parent)
    await run_notebook(path, {"__name__": "__notebook__"})
    out = capsys.readouterr().out
    for expected in EXPECTED_OUTPUT[path.name]:
        assert expected in out, f"{path.name} did not print {expected!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
async def test_notebook_fails_loudly_without_traces(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(path.parent)
    monkeypatch.setenv(TRACES_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=r"shared traces .*missing"):
        await run_notebook(path, {"__name__": "__notebook__"})
