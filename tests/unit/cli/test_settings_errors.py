"""A wrong operator setting is one line that names the variable and where it came from; typos are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fusion_graph.cli.app import app
from fusion_graph.cli.checks import unknown_variables
from fusion_graph.settings import DEFAULT_SECRET_FILES, FusionSettings
from tests.unit.cli.test_traces import runner


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("FUSION_REQUEST_TIMEOUT", "-1", "must be greater than 0"),
        ("FUSION_SHARED_STATE", "postgress", "'off' or 'postgres'"),
        ("FUSION_PRICE_OVERRIDES", "{bad", "not valid JSON"),
        ("FUSION_CLOUD_MODELS", "[gpt-4o", "not a valid JSON list"),
    ],
)
def test_a_bad_setting_in_the_environment_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, says: str
) -> None:
    monkeypatch.setenv(variable, value)
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output and "errors.pydantic.dev" not in result.output
    assert f"{variable} (from the environment)" in lines[0] and says in lines[0], lines[0]


def test_a_bad_setting_in_dot_env_says_it_came_from_there(tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("FUSION_LOCAL_SLOTS=lots\n", encoding="utf-8")
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert "FUSION_LOCAL_SLOTS (from ./.env)" in line


def test_list_settings_take_plain_comma_separated_items_or_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSION_CLOUD_MODELS", "gpt-4o, gpt-4.1")
    monkeypatch.setenv("FUSION_LOCAL_WORKERS", "http://a:8080,http://b:8080")
    monkeypatch.setenv("FUSION_SECRET_FILES", json.dumps([".env", "*.pem"]))
    settings = FusionSettings()
    assert settings.cloud_models == ("gpt-4o", "gpt-4.1")
    assert settings.local_workers == ("http://a:8080", "http://b:8080")
    assert settings.secret_files == (".env", "*.pem")
    monkeypatch.setenv("FUSION_SECRET_FILES", "[]")
    assert FusionSettings().secret_files == ()  # [] clears the list (the docs' way)
    monkeypatch.setenv("FUSION_SECRET_FILES", "")
    assert FusionSettings().secret_files == DEFAULT_SECRET_FILES  # empty means the default, as everywhere


def test_a_misspelt_variable_is_named_with_the_one_meant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FUSION_CLOUD_SHAR", "50")
    (tmp_path / ".env").write_text("FUSION_LOCAL_BASEURL=http://x/v1\n", encoding="utf-8")
    result = runner.invoke(app, ["doctor", "--json", "--timeout", "0.5"])
    [row] = [c for c in json.loads(result.stdout)["checks"] if c["name"] == "FUSION_* names"]
    assert row["status"] == "warn"
    assert "rename FUSION_CLOUD_SHAR to FUSION_CLOUD_SHARE" in row["fix"]
    assert "rename FUSION_LOCAL_BASEURL to FUSION_LOCAL_BASE_URL" in row["fix"]
    assert unknown_variables(["FUSION_TRACES_DIR", "FUSION_CLOUD_SHARE", "PATH"]) == []
    # run says it once, before anything runs
    run = runner.invoke(app, ["run", "hi", "--workspace", str(tmp_path), "--context", '{"mode": "local"}'])
    notes = [line for line in run.stderr.splitlines() if "is not a fusion-graph setting" in line]
    assert len(notes) == 2 and "did you mean FUSION_CLOUD_SHARE?" in notes[0]
