"""``fusion-graph doctor`` against real llama-servers: one that takes tools, one started ``--no-jinja``.

This llama-server build (llama-cpp-python 0.3.36) turns Jinja on by default, so
leaving ``--jinja`` out changes nothing: the bad server is started with
``--no-jinja`` (on a build without that flag, Jinja is off unless asked for).
Its ``/props`` is the same either way (``chat_template_caps`` describes the
template, not the engine); doctor tells them apart by ``POST /apply-template``
with a tool. The good server renders tools with the Qwen2.5 template.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import Result

from fusion_graph.cli.doctor import doctor
from fusion_graph_testing import LlamaServer, supports_flag, write_chat_template
from fusion_graph_testing.fake_openai import FakeOpenAI
from tests.unit.cli.test_traces import runner

pytestmark = pytest.mark.llama

#: Half the tiny model's 4096-token slots, so the window check passes too.
CONTEXT = json.dumps({"max_completion_tokens": 2048})

app = typer.Typer()
app.command()(doctor)


@pytest.fixture(scope="module")
def tools_server(
    llama_server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """``--jinja`` and a template that renders tools."""
    workdir = tmp_path_factory.mktemp("doctor-good")
    template = write_chat_template(workdir)
    with LlamaServer(
        tiny_model,
        binary=llama_server_bin,
        jinja=True,
        extra_args=["--chat-template-file", str(template)],
        log_path=workdir / "server.log",
    ) as server:
        yield server


@pytest.fixture(scope="module")
def no_jinja_server(
    llama_server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """Jinja off: llama-server refuses any request with tools."""
    workdir = tmp_path_factory.mktemp("doctor-bad")
    off = ["--no-jinja"] if supports_flag(llama_server_bin, "--no-jinja") else []
    with LlamaServer(
        tiny_model, binary=llama_server_bin, jinja=False, extra_args=off, log_path=workdir / "server.log"
    ) as server:
        yield server


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A key, a cloud fake, an empty workspace; the test points FUSION_LOCAL_BASE_URL at its server."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPENAI_API_KEY", "doctor-test-key")
    monkeypatch.setenv("FUSION_WORKSPACE_ROOT", str(tmp_path))
    with FakeOpenAI() as cloud:
        monkeypatch.setenv("FUSION_CLOUD_BASE_URL", cloud.base_url)
        monkeypatch.setenv("FUSION_CLOUD_MODEL", "fake")
        yield


def report(server: LlamaServer, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[Result, dict[str, Any]]:
    """The plain report and the ``--json`` one (``ok`` checked against the exit code)."""
    monkeypatch.setenv("FUSION_LOCAL_BASE_URL", server.openai_base_url)
    plain = runner.invoke(app, ["--context", CONTEXT, *args])
    print(plain.stdout)  # the table, for `pytest -s`
    result = runner.invoke(app, ["--context", CONTEXT, "--json", *args])
    data: dict[str, Any] = json.loads(result.stdout)
    assert data["ok"] is (result.exit_code == 0) is (plain.exit_code == 0), result.stdout
    return plain, {c["name"]: c for c in data["checks"]}


def test_server_with_jinja_and_a_tools_template_passes(
    tools_server: LlamaServer, setup: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, checks = report(tools_server, monkeypatch)
    assert plain.exit_code == 0, plain.stdout
    assert checks["tool calling"]["status"] == "ok"
    assert checks["chat template"]["status"] == "ok"
    assert checks["llama-server"]["status"] == "ok"
    assert checks["slots"]["status"] == "ok" and "4 slots" in checks["slots"]["detail"]
    assert checks["slot window"]["status"] == "ok" and "4096" in checks["slot window"]["detail"]
    assert "2048 left for prompts" in checks["slot window"]["detail"]  # beside the 2048-token budget
    assert "renders tools" in checks["chat template"]["detail"]  # and the probe tool reached the prompt
    assert checks["not in /props"]["status"] == "info"
    assert "doctor-test-key" not in plain.stdout


def test_server_without_jinja_fails_naming_the_flag(
    no_jinja_server: LlamaServer, setup: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, checks = report(no_jinja_server, monkeypatch)
    assert plain.exit_code == 1
    tools = checks["tool calling"]
    assert tools["status"] == "fail"
    assert "--jinja" in tools["detail"] and "--jinja" in tools["fix"]
    assert "--jinja" in plain.stdout
    assert checks["llama-server"]["status"] == "ok"  # reachable, and llama-server: only tools fail


def test_default_budget_needs_a_bigger_window(
    tools_server: LlamaServer, setup: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FUSION_LOCAL_BASE_URL", tools_server.openai_base_url)
    result = runner.invoke(app, ["--json"])  # max_completion_tokens 4096 against 4096-token slots
    check = {c["name"]: c for c in json.loads(result.stdout)["checks"]}["slot window"]
    assert result.exit_code == 1 and check["status"] == "fail"
    assert "at least 8192 tokens" in check["fix"] and "-c 131072" in check["fix"]
