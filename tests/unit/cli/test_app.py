"""The ``fusion-graph`` entry point: ``--version``, ``--help`` as a process, and lazy command modules."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusion_graph import __version__
from fusion_graph.cli.app import app
from tests.unit.cli.test_traces import runner

CLI = Path(__file__).resolve().parents[3] / "fusion_graph" / "cli"
#: Command modules that import only the standard library, typer, rich and each other at import time,
#: so ``--help`` does not load LangGraph, LangChain or the provider SDKs.
LAZY_MODULES = (
    "agreement.py",
    "app.py",
    "calibrate.py",
    "calibrate_labels.py",
    "checks.py",
    "common.py",
    "demo.py",
    "doctor/__init__.py",
    "doctor/checkpoints.py",
    "doctor/cloud.py",
    "doctor/command.py",
    "doctor/gateway.py",
    "doctor/llama.py",
    "doctor/props.py",
    "doctor/rows.py",
    "doctor/workspace.py",
    "label.py",
    "live.py",
    "prices.py",
    "replay.py",
    "report.py",
    "run.py",
    "stores.py",
    "tables.py",
    "trace_options.py",
)
ALLOWED_TOP_LEVEL = {"typer", "rich", "fusion_graph"}
#: Package modules the command modules may import at import time.
LIGHT_MODULES = {
    "fusion_graph.redact",
    "fusion_graph.errors",
    "fusion_graph.routing.records",
    "fusion_graph.routing.rule",
    "fusion_graph.routing.score",
}


def test_version_prints_the_package_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"fusion-graph {__version__}\n"


def test_help_as_a_process_lists_the_commands() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fusion_graph", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "100"},
    )
    assert done.returncode == 0, done.stderr
    assert "Usage: fusion-graph" in done.stdout and "--version" in done.stdout
    for command in ("demo", "run", "replay", "calibrate", "label", "report"):
        assert f" {command} " in done.stdout


def module_level_imports(path: Path) -> set[str]:
    """Modules imported at import time (outside functions and ``if TYPE_CHECKING:``)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for child in ast.walk(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                break
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names.add(child.module)
    return names


@pytest.mark.parametrize("name", LAZY_MODULES)
def test_command_modules_import_heavy_dependencies_only_when_a_command_runs(name: str) -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for module in module_level_imports(CLI / name):
        top = module.split(".")[0]
        assert top in stdlib or top in ALLOWED_TOP_LEVEL, f"{name} imports {module} at import time"
        if top == "fusion_graph":
            # these need the standard library only (records: and typing_extensions)
            light = module.startswith("fusion_graph.cli") or module in LIGHT_MODULES
            assert light, f"{name} imports {module} at import time"


def test_help_loads_no_graph_runtime() -> None:
    """``--help`` imports neither LangGraph nor LangChain (what made it take seconds)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fusion_graph", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    loaded = {
        line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")
    }
    assert not {m for m in loaded if m.split(".")[0] in {"langgraph", "langchain_core", "openai", "httpx"}}


def test_the_cli_default_pace_is_the_calibrations() -> None:
    from fusion_graph.cli import calibrate
    from fusion_graph.replay import calibration

    assert calibrate.CALIBRATED_PACE_SLACK == calibration.CALIBRATED_PACE_SLACK


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [("FUSION_CLOUD_SHARE", "abc", "valid integer"), ("FUSION_MAX_STEPS", "0", "between 1 and 1000")],
)
@pytest.mark.parametrize("command", [["replay"], ["run", "hi"], ["report"], ["doctor"]])
def test_a_bad_run_default_in_the_environment_is_one_line_naming_it(
    variable: str, value: str, says: str, command: list[str], tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_")} | {variable: value}
    done = subprocess.run(
        [sys.executable, "-m", "fusion_graph", *command],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and variable in lines[0] and says in lines[0] and "Traceback" not in done.stderr


@pytest.mark.parametrize("command", ["run", "replay", "calibrate", "label", "report", "doctor"])
def test_help_shows_flags_as_flags_and_fits_80_columns(command: str) -> None:
    from typer.testing import CliRunner

    from fusion_graph.cli.app import app

    shown = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert shown.exit_code == 0, shown.output
    assert "<bool>" not in shown.stdout  # a flag takes no value
    assert max(len(line) for line in shown.stdout.splitlines()) <= 80
    (flag,) = [line.split() for line in shown.stdout.splitlines() if line.split()[:1] == ["--json"]]
    assert not flag[1].startswith("<"), flag
