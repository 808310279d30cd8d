"""``cp .env.example .env`` with the key exported: nothing the template sets blanks it.

The template leaves the key's line commented out (``langgraph dev`` loads
``.env`` over the environment), the graph reads the key from the environment
first and from ``.env`` only when it is not set there, and ``doctor`` warns
about an empty key line a user wrote themselves.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from dotenv import dotenv_values

from fusion_graph.cli.app import app
from fusion_graph.providers.models import build_cloud_model
from fusion_graph.settings import FusionSettings
from fusion_graph_testing import free_port
from tests.unit.cli.test_traces import runner

ROOT = Path(__file__).resolve().parents[3]
EXPORTED = "exported-key-0123456789"


@pytest.fixture(autouse=True)
def in_a_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPENAI_API_KEY", EXPORTED)
    monkeypatch.setenv("FUSION_LOCAL_BASE_URL", f"http://127.0.0.1:{free_port()}/v1")
    monkeypatch.setenv("FUSION_CLOUD_BASE_URL", f"http://127.0.0.1:{free_port()}/v1")


def key_checks(result_stdout: str) -> dict[str, dict[str, str]]:
    return {c["name"]: c for c in json.loads(result_stdout)["checks"] if c["name"].startswith("cloud key")}


def test_the_template_copied_to_env_sets_no_variable_at_all(tmp_path: Path) -> None:
    shutil.copy(ROOT / ".env.example", tmp_path / ".env")
    # Every line is a comment: nothing to load over the environment.
    assert dotenv_values(tmp_path / ".env") == {}
    key = FusionSettings().api_key()
    assert key is not None and key.get_secret_value() == EXPORTED
    checks = key_checks(runner.invoke(app, ["doctor", "--json", "--timeout", "1"]).stdout)
    assert checks["cloud key"]["status"] == "ok" and "OPENAI_API_KEY is set" in checks["cloud key"]["detail"]
    assert "cloud key in .env" not in checks


def test_an_empty_key_line_never_hides_the_exported_key_and_doctor_says_what_it_would_do(
    tmp_path: Path,
) -> None:
    (tmp_path / ".env").write_text("OPENAI_API_KEY=\n", encoding="utf-8")
    key = FusionSettings().api_key()
    assert key is not None and key.get_secret_value() == EXPORTED
    build_cloud_model(FusionSettings())  # builds with it (no "needs an API key" refusal)
    checks = key_checks(runner.invoke(app, ["doctor", "--json", "--timeout", "1"]).stdout)
    blank = checks["cloud key in .env"]
    assert blank["status"] == "warn" and "blank" in blank["detail"] and "# OPENAI_API_KEY=" in blank["fix"]


def test_a_key_only_in_env_is_read_from_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY")
    (tmp_path / ".env").write_text("OPENAI_API_KEY=from-the-env-file-0123\n", encoding="utf-8")
    key = FusionSettings().api_key()
    assert key is not None and key.get_secret_value() == "from-the-env-file-0123"
    build_cloud_model(FusionSettings())  # builds with it (no "needs an API key" refusal)
