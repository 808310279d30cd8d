"""A key put in ``FUSION_CLOUD_API_KEY_ENV`` (the variable's *name*) is never printed, by any command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from langchain_core.language_models import BaseChatModel
from typer.testing import Result

from fusion_graph.cli import run as cli_run
from fusion_graph.cli.app import app
from fusion_graph.cli.checks import key_variable
from fusion_graph.context import FusionContext
from fusion_graph.settings import FusionSettings
from fusion_graph_testing import free_port
from tests.plugins.fakes import scripted
from tests.unit.cli.test_traces import runner

#: What a user pasted into FUSION_CLOUD_API_KEY_ENV: a key, not a variable name.
PASTED = "sk-proj-Zq8vX2mN4pL7rT1wK9sB3dF6hJ0cY5uE"


@pytest.fixture(autouse=True)
def key_in_the_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("FUSION_CLOUD_API_KEY_ENV", PASTED)
    monkeypatch.setenv("FUSION_LOCAL_BASE_URL", f"http://127.0.0.1:{free_port()}/v1")
    monkeypatch.setenv("FUSION_CLOUD_BASE_URL", f"http://127.0.0.1:{free_port()}/v1")


def shown(result: Result) -> str:
    """All a command printed (a table's cells read as text); the pasted key must be in none of it."""
    text = result.stdout + result.stderr
    assert PASTED not in text and PASTED[8:24] not in text, text
    return " ".join(cell_text(text).split())


def cell_text(output: str) -> str:
    """A doctor table's last column as running text (its wrapped lines joined); other lines as they are."""
    lines = [line.split("│")[-2] if line.count("│") >= 2 else line for line in output.splitlines()]
    return " ".join(lines)


def test_a_key_shaped_setting_is_not_a_variable_name() -> None:
    assert key_variable(FusionSettings(cloud_api_key_env="OPENAI_API_KEY")) == "OPENAI_API_KEY"
    assert key_variable(FusionSettings(cloud_api_key_env="acme_gateway_key")) == "acme_gateway_key"
    assert key_variable(FusionSettings(cloud_api_key_env=PASTED)) is None
    assert key_variable(FusionSettings(cloud_api_key_env="aB3xK9mQ2vL7pR4tW8nZ1cF6hJ0sY5uE")) is None


def test_run_refuses_without_printing_it(tmp_path: Path) -> None:
    result = runner.invoke(app, ["run", "hi", "--workspace", str(tmp_path)])
    assert result.exit_code == 2
    text = shown(result)
    assert "FUSION_CLOUD_API_KEY_ENV holds what looks like a key, not a variable name" in text
    assert "export" not in text


def test_run_with_the_key_set_elsewhere_notes_it_without_printing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FUSION_CLOUD_API_KEY", "the-real-key-is-here")

    async def models(context: FusionContext, settings: FusionSettings) -> tuple[BaseChatModel, BaseChatModel]:
        cli_run.check_cloud_key(settings)  # the real check: the key is found
        return scripted("cloudfake", ["hello"]), scripted("localfake", [])

    monkeypatch.setattr(cli_run, "MODELS", models)
    args = ["run", "hi", "--workspace", str(tmp_path), "--context", '{"sub_runners": "off"}']
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "holds what looks like a key" in shown(result) and "hello" in result.stdout
    as_json = runner.invoke(app, [*args, "--json"])
    assert as_json.exit_code == 0 and json.loads(as_json.stdout)["answer"] == "hello"
    shown(as_json)


@pytest.mark.parametrize("extra", [[], ["--json"], ["--live"]])
def test_doctor_says_what_the_setting_holds_without_printing_it(extra: list[str]) -> None:
    result = runner.invoke(app, ["doctor", "--timeout", "1", *extra])
    assert result.exit_code == 1
    text = shown(result)
    assert "holds what looks like a key, not a variable name" in text and "export" not in text
    if extra == ["--json"]:
        check = {c["name"]: c for c in json.loads(result.stdout)["checks"]}["cloud key"]
        assert check["status"] == "fail" and "FUSION_CLOUD_API_KEY" in check["fix"]


def test_doctor_with_the_key_set_elsewhere_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSION_CLOUD_API_KEY", "the-real-key-is-here")
    result = runner.invoke(app, ["doctor", "--json", "--timeout", "1"])
    check = {c["name"]: c for c in json.loads(result.stdout)["checks"]}["cloud key"]
    assert check["status"] == "warn" and "FUSION_CLOUD_API_KEY is set" in check["detail"]
    shown(result)


async def test_report_does_not_print_it(tmp_path: Path) -> None:
    db = tmp_path / "threads.sqlite"
    await cli_run.run_task(
        "hi",
        context=FusionContext(mode="cloud", sub_runners="off"),
        settings=FusionSettings(cloud_model="cloudfake", workspace_root=str(tmp_path)),
        db=db,
        models=(scripted("cloudfake", ["ok"]), scripted("localfake", [])),
    )
    for args in ([], ["--json"]):
        result = runner.invoke(app, ["report", "--db", str(db), *args])
        assert result.exit_code == 0, result.output
        shown(result)
