"""Every notebook runs top to bottom in a real Jupyter kernel (nbclient), against the current package.

Each notebook is executed as Jupyter would, in its own directory, by a kernel
of this interpreter: a kernel spec written to a temporary ``JUPYTER_PATH``, so
no kernel needs installing first and no other ``python3`` kernel can stand in.
Its figures must come out as images (``image/png``), and it must print its own
results. As a clone has them, the notebooks replay the bundled sample traces;
``FUSION_TRACES_DIR`` points them at others (a relative one read from the
repository root, not the kernel's ``notebooks/``), and one naming a directory
without traces stops each notebook with an error that names the variable.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from fusion_graph.replay.traces import SAMPLE_NAME, TRACES_ENV
from tests.plugins.requires import service_missing

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))
REPO = Path(__file__).parents[2]
KERNEL = "fusion-graph-tests"

#: What each notebook must print when it ran through: its own result, not just any output.
EXPECTED_OUTPUT = {
    "route_replay.ipynb": ["cloud_share= 30 h=10", "flips="],
    "quickstart.ipynb": [
        "route log",
        "calibrated dial on unseen trajectories",
        "target 0.30 -> achieved",
        "of all steps",
        "plans (step 0 of each turn) run on cloud whenever cloud_share > 0",
    ],
}


@pytest.fixture
def kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernel spec that runs this interpreter (with this package), found first on ``JUPYTER_PATH``."""
    try:
        import ipykernel  # noqa: F401
        import nbclient  # noqa: F401
    except ImportError as error:
        service_missing(f"the notebook tests need {error.name}", fix="pip install -e '.[dev]'")
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    # Not ipykernel's inline default: a notebook's figures come out as images only if it sets the backend.
    monkeypatch.setenv("MPLBACKEND", "Agg")
    return KERNEL


def execute(path: Path, kernel: str) -> Any:
    """Run every cell of ``path`` in ``kernel``, from the notebook's directory, as Jupyter does."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)  # type: ignore[no-untyped-call]
    client = NotebookClient(
        notebook, timeout=600, kernel_name=kernel, resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    return notebook


def outputs(notebook: Any) -> list[dict[str, Any]]:
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]


def test_every_notebook_has_expectations() -> None:
    assert sorted(EXPECTED_OUTPUT) == [p.name for p in NOTEBOOKS]


def printed(notebook: Any) -> str:
    """What the notebook printed: print() as streams, rich tables as displays with a plain-text form."""
    return "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in outputs(notebook))


def assert_ran_through(path: Path, notebook: Any) -> str:
    found = outputs(notebook)
    assert not [o for o in found if o["output_type"] == "error"]
    images = [o for o in found if "image/png" in o.get("data", {})]
    assert images, f"{path.name} drew no image/png output (is the inline backend set?)"
    text = printed(notebook)
    for expected in EXPECTED_OUTPUT[path.name]:
        assert expected in text, f"{path.name} did not print {expected!r}"
    return text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_from_a_clone_on_the_bundled_sample(
    path: Path, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TRACES_ENV, raising=False)
    text = assert_ran_through(path, execute(path, kernel))
    assert f"traces: the bundled sample ({SAMPLE_NAME})" in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_a_relative_traces_directory_is_read_from_the_repository_root(
    path: Path, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Named as from the root, where the command was typed; the kernel starts in notebooks/.
    monkeypatch.setenv(TRACES_ENV, SAMPLE_NAME)
    text = assert_ran_through(path, execute(path, kernel))
    assert f"{(REPO / SAMPLE_NAME).resolve()} (from {TRACES_ENV}, read from the repository root" in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_fails_loudly_when_the_variable_names_no_traces(
    path: Path, kernel: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nbclient.exceptions import CellExecutionError

    monkeypatch.setenv(TRACES_ENV, str(tmp_path / "missing"))
    with pytest.raises(CellExecutionError) as failed:
        execute(path, kernel)
    assert failed.value.ename == "FileNotFoundError"
    assert f"the traces in {TRACES_ENV} are missing" in failed.value.evalue
    assert str(tmp_path / "missing") in failed.value.evalue and "bundled" in failed.value.evalue
