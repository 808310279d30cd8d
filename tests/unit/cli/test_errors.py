"""The CLI ends bad input with one line that names the fix, exit code 2, and no traceback."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from langchain_core.language_models import BaseChatModel

from fusion_graph.cli import run as cli_run
from fusion_graph.cli.app import app
from fusion_graph.context import FusionContext
from fusion_graph.settings import FusionSettings
from tests.plugins.fakes import scripted
from tests.unit.cli.test_traces import runner


@pytest.fixture(autouse=True)
def no_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    async def models(context: FusionContext, settings: FusionSettings) -> tuple[BaseChatModel, BaseChatModel]:
        return scripted("cloud", ["done"]), scripted("local", ["done"])

    monkeypatch.setattr(cli_run, "MODELS", models)


def one_line_error(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    assert "Traceback" not in output
    assert lines and lines[0].startswith("error:"), output
    return " ".join(lines)


def test_a_postgres_value_that_is_not_a_url(tmp_path: Path) -> None:
    result = runner.invoke(app, ["run", "task", "--workspace", str(tmp_path), "--postgres", "not-a-url"])
    assert result.exit_code == 2
    assert "is not a postgresql://user:password@host:port/db URL" in one_line_error(result.stderr)


def test_a_db_that_is_not_sqlite(tmp_path: Path) -> None:
    db = tmp_path / "threads.sqlite"
    db.write_bytes(b"this is not a database" * 100)
    result = runner.invoke(app, ["run", "task", "--workspace", str(tmp_path), "--db", str(db)])
    assert result.exit_code == 2
    assert f"--db {db} cannot be used" in one_line_error(result.stderr)
    report = runner.invoke(app, ["report", "--db", str(db)])
    assert report.exit_code == 2 and "cannot be used" in one_line_error(report.stderr)


def test_a_db_under_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    result = runner.invoke(
        app, ["run", "task", "--workspace", str(tmp_path), "--db", str(blocker / "t.sqlite")]
    )
    assert result.exit_code == 2
    assert "cannot be used" in one_line_error(result.stderr)


def test_report_of_a_missing_db(tmp_path: Path) -> None:
    result = runner.invoke(app, ["report", "--db", str(tmp_path / "none.sqlite")])
    assert result.exit_code == 2 and "no checkpoint database at" in one_line_error(result.stderr)


def test_as_a_process_the_error_is_one_line_on_stderr(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fusion_graph", "report", "--db", str(tmp_path / "none.sqlite")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 2
    assert "no checkpoint database at" in one_line_error(done.stderr) and "Traceback" not in done.stderr


def test_a_provider_echoing_the_key_never_reaches_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json as json_module

    from langchain_openai import ChatOpenAI

    from fusion_graph_testing.fake_openai import FakeOpenAI, Reply

    key = "sk-cli-" + "secretvalue" * 3
    body = {"error": {"message": f"Invalid parameter for key {key}", "type": "invalid_request_error"}}
    with FakeOpenAI([Reply(status=400, raw=json_module.dumps(body).encode())]) as cloud:

        async def models(
            context: FusionContext, settings: FusionSettings
        ) -> tuple[BaseChatModel, BaseChatModel]:
            echoing = ChatOpenAI(model="gpt-4o-mini", base_url=cloud.base_url, api_key=key, max_retries=0)
            return echoing, scripted("local", ["never"])

        monkeypatch.setattr(cli_run, "MODELS", models)
        result = runner.invoke(
            app,
            [
                "run",
                "plan it",
                "--workspace",
                str(tmp_path),
                "--db",
                str(tmp_path / "t.sqlite"),
                "--new-thread",
            ],
        )
    assert result.exit_code == 2
    assert key not in result.stderr + result.stdout
    assert "ProviderRequestError" in result.stderr or "refused the request" in result.stderr
    assert "[REDACTED]" in result.stderr
    assert key.encode() not in (tmp_path / "t.sqlite").read_bytes()


HEAVY = {"langgraph", "langchain_core", "langchain_openai", "openai", "httpx"}


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (["report", "--db", "{tmp}/none.sqlite"], "no checkpoint database at"),
        (["run", "task", "--workspace", "{tmp}", "--postgres", "not-a-url"], "is not a postgresql://"),
        (
            ["run", "task", "--workspace", "{tmp}", "--db", "{tmp}/empty.sqlite", "--thread", "nope"],
            "no checkpoint",
        ),
        (["run", "task", "--workspace", "{tmp}", "--db", "{tmp}"], "cannot be used"),
        (["run", "task", "--workspace", "{tmp}", "--db", "{tmp}/junk.sqlite"], "cannot be used"),
    ],
)
def test_bad_input_is_refused_before_langgraph_or_a_client_loads(
    tmp_path: Path, command: list[str], says: str
) -> None:
    """Cheap checks first: a wrong path, URL or thread costs no import of the graph runtime or SDKs."""
    sqlite3.connect(tmp_path / "empty.sqlite").close()
    (tmp_path / "junk.sqlite").write_bytes(b"not a database" * 100)
    env = {key: value for key, value in os.environ.items() if key != "OPENAI_API_KEY"}
    done = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "fusion_graph",
            *(a.format(tmp=tmp_path) for a in command),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "COLUMNS": "200", "FUSION_LOCAL_BASE_URL": "http://127.0.0.1:9/v1"},
    )
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert says in one_line_error("\n".join(errors))
    loaded = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
    assert not loaded & HEAVY, loaded & HEAVY
