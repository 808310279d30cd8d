"""Generated docs and deployment files: ``.env.example`` and the README table, what git and docker ignore."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fusion_graph.cli.docs import config_rows, env_example, env_value
from fusion_graph.context import FusionContext
from fusion_graph.settings import ENV_PREFIX, FusionSettings

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
SETTING = re.compile(rf"^# ({ENV_PREFIX}[A-Z0-9_]+)=(.*)$")


def settings(text: str) -> dict[str, str]:
    """``FUSION_*`` name -> the value shown, from the commented-out setting lines."""
    found = (SETTING.match(line) for line in text.splitlines())
    return {match[1]: match[2] for match in found if match}


def test_the_committed_env_example_is_generated_from_the_code() -> None:
    committed = (ROOT / ".env.example").read_text(encoding="utf-8")
    assert committed == env_example(), ".env.example is stale: run `python -m fusion_graph.cli.docs`"


def test_the_env_example_lists_every_setting_once_and_the_key_unset() -> None:
    text = env_example()
    names = [match[1] for match in (SETTING.match(line) for line in text.splitlines()) if match]
    assert sorted(names) == sorted(row[4] for row in config_rows())
    assert len(names) == len(set(names))
    operator = {ENV_PREFIX + name.upper() for name in FusionSettings.model_fields}
    assert operator | set(FusionContext().env_names.values()) == set(names)
    assert "\nOPENAI_API_KEY=\n" in text, "the key variable is listed, empty"
    assert [line for line in text.splitlines() if line and not line.startswith("#")] == ["OPENAI_API_KEY="]


def test_each_shown_operator_value_reads_back_as_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    shown = settings(env_example())
    fields = {ENV_PREFIX + name.upper(): name for name in FusionSettings.model_fields}
    operator = {name: value for name, value in shown.items() if name in fields and value}
    assert {"FUSION_LOCAL_PRICE_PER_MTOK", "FUSION_PRICE_OVERRIDES", "FUSION_REQUEST_TIMEOUT"} <= set(
        operator
    )
    for name, value in operator.items():
        monkeypatch.setenv(name, value)
    assert FusionSettings() == FusionSettings.model_construct()


def test_each_shown_run_default_reads_back_as_the_default() -> None:
    shown = settings(env_example())
    names = set(FusionContext().env_names.values())
    run = {name: value for name, value in shown.items() if name in names and value}
    assert {"FUSION_MODE", "FUSION_CLOUD_SHARE"} <= set(run)
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)} | run
    code = (
        "from fusion_graph.context import DEFAULTS, ENV_KEYS, FusionContext; c = FusionContext(); "
        "print(all(getattr(c, n) == DEFAULTS[k] for n, k in ENV_KEYS.items()))"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stderr[-2000:]


def test_env_values() -> None:
    assert env_value(True) == "true"
    assert env_value((0.0, 0.5)) == "[0.0, 0.5]"
    assert env_value({}) == "{}"
    assert env_value(None) == ""
    assert env_value("x" * 100) == "", "the system prompt is not repeated"


# --------------------------------------------------------------------------- ignore files

SECRETS = [".env", ".env.production", ".env.local"]
KEPT = [".env.example", "fusion_graph/agent.py", "pyproject.toml", "README.md", "langgraph.json"]


@pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout"
)
@pytest.mark.parametrize(("path", "ignored"), [(p, True) for p in SECRETS] + [(p, False) for p in KEPT])
def test_git_ignores_env_files_but_not_the_example(path: str, ignored: bool) -> None:
    result = subprocess.run(
        ["git", "check-ignore", "--no-index", "-q", path], cwd=ROOT, capture_output=True, check=False
    )
    assert result.returncode in (0, 1), result.stderr
    assert (result.returncode == 0) is ignored


def docker_ignored(path: str, patterns: list[str]) -> bool:
    """Docker's ``.dockerignore`` rules, closely enough for these paths: the last match wins."""
    ignored = False
    for raw in patterns:
        negate, pattern = raw.startswith("!"), raw.removeprefix("!")
        candidates = [pattern, pattern.removeprefix("**/")]
        parts = path.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        tails = ["/".join(parts[i:]) for i in range(len(parts))] if pattern.startswith("**/") else []
        if any(fnmatch.fnmatchcase(p, c) for p in prefixes + tails for c in candidates):
            ignored = not negate
    return ignored


@pytest.mark.parametrize(
    ("path", "ignored"),
    [(p, True) for p in SECRETS]
    + [
        ("deploy/.env", True),
        (".git/HEAD", True),
        (".venv/bin/python", True),
        ("fusion_graph/__pycache__/graph.cpython-311.pyc", True),
        ("bench/results/kv.json", True),
        ("models/tiny.gguf", True),
        ("tiny.gguf", True),
        (".langgraph_api/store.pckl", True),
        (".mypy_cache/x", True),
    ]
    + [(p, False) for p in KEPT],
)
def test_docker_build_context_leaves_out_secrets_and_local_state(path: str, ignored: bool) -> None:
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert docker_ignored(path, patterns) is ignored


# --------------------------------------------------------------------------- the README table


def test_readme_table_is_generated_from_the_context() -> None:
    from fusion_graph.cli.docs import render_readme_table

    text = README.read_text(encoding="utf-8")
    assert render_readme_table(text) == text, (
        "README table is stale: run `python -m fusion_graph.cli.docs README.md`"
    )
