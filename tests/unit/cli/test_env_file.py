"""``cp .env.example .env`` with the key exported: nothing the template sets blanks it.

The template leaves the key's line commented out (``langgraph dev`` loads
``.env`` over the environment), the graph reads the key from the environment
first and from ``.env`` only when it is not set there, and ``doctor`` warns
about an empty key line a user wrote themselves. Uncommented as written, the
template configures every command: an empty value means the default, from
``.env`` and the environment alike.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from dotenv import dotenv_values

from fusion_graph.cli.app import app
from fusion_graph.context import context_defaults
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


def uncommented_template() -> str:
    """``.env.example`` with every ``# FUSION_...=`` line uncommented, as a newcomer edits it."""
    text = (ROOT / ".env.example").read_text(encoding="utf-8")
    return re.sub(r"(?m)^# (FUSION_[A-Z0-9_]+=)", r"\1", text)


def doctor_verdict() -> dict[str, str]:
    """``doctor --json``'s checks by name; it must get past the configuration to write them."""
    result = runner.invoke(app, ["doctor", "--json", "--timeout", "1"])
    assert result.exit_code != 2, result.output  # 2: a setting or run default was refused
    return {check["name"]: check["status"] for check in json.loads(result.stdout)["checks"]}


def test_the_template_uncommented_as_written_configures_every_command(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text(uncommented_template(), encoding="utf-8")
    values = dotenv_values(tmp_path / ".env")
    blank = {"FUSION_METRICS_PORT", "FUSION_TURN_CLOUD_BUDGET_USD", "FUSION_CONVERSATION_MAX_TOKENS"}
    assert blank <= {name for name, value in values.items() if value == ""}, "the template left them set"
    settings = FusionSettings()  # empty means the default, never a parse error
    assert (settings.metrics_port, settings.turn_cloud_budget_usd, settings.thread_cloud_budget_usd) == (
        None,
        None,
        None,
    )
    assert settings.local_routing_header == "x-fusion-thread"
    assert doctor_verdict()["cloud key"] == "ok"


def test_the_template_values_as_environment_variables_configure_every_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kept = {"FUSION_LOCAL_BASE_URL", "FUSION_CLOUD_BASE_URL"}  # the fixture's servers
    values = dotenv_values(stream=io.StringIO(uncommented_template()))
    for name, value in values.items():
        if name.startswith("FUSION_") and name not in kept:
            monkeypatch.setenv(name, value or "")
    assert os.environ["FUSION_CONVERSATION_MAX_TOKENS"] == "" and os.environ["FUSION_CLOUD_SHARE"] == "30"
    assert FusionSettings().metrics_port is None
    assert context_defaults()["cloud_share"] == 30 and "conversation_max_tokens" not in context_defaults()
    assert doctor_verdict()["cloud key"] == "ok"


def test_an_empty_value_means_the_default_and_off_turns_a_header_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSION_LOCAL_ROUTING_HEADER", "")
    monkeypatch.setenv("FUSION_LOCAL_WORKER_HEADER", "off")
    monkeypatch.setenv("FUSION_CLOUD_SHARE", "")
    settings = FusionSettings()
    assert (settings.local_routing_header, settings.local_worker_header) == ("x-fusion-thread", "")
    assert context_defaults() == {}
    replayed = runner.invoke(app, ["replay"])
    assert replayed.exit_code == 0, replayed.output
    assert "replay at cloud_share=30" in replayed.output
