"""``fusion-graph doctor``: each check's rows, through the command and as pure functions.

Servers are loopback fakes (``FakeOpenAI``); a real llama-server is in
tests/integration/test_doctor_llama.py.
"""

from __future__ import annotations

import json
import re
import sqlite3
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.testing import Result

import fusion_graph.cli.doctor.llama as module
from fusion_graph.cli.doctor import Check, doctor
from fusion_graph.cli.doctor.checkpoints import postgres_check, redact_url, shared_state_check, sqlite_check
from fusion_graph.cli.doctor.cloud import FoundKey, cloud_models_check
from fusion_graph.cli.doctor.props import (
    cache_checks,
    jinja_check,
    props_checks,
    template_check,
    window_check,
)
from fusion_graph.providers import llama_server
from fusion_graph.providers.llama_server import ServerProps
from fusion_graph.settings import FusionSettings
from fusion_graph_testing import free_port
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.unit.cli.test_traces import runner

#: The command alone, as the lead will register it (``app.command()(doctor)``).
app = typer.Typer()
app.command()(doctor)

#: A key no scrub rule would catch by its shape: only doctor's own hiding keeps it out.
KEY = "hunter2-plain-secret"


def invoke(*args: str) -> Result:
    return runner.invoke(app, list(args))


def rows(result: Result) -> dict[str, dict[str, str]]:
    """The ``--json`` report's checks by name (``ok`` must match the exit code)."""
    data: dict[str, Any] = json.loads(result.stdout)
    assert data["ok"] is (result.exit_code == 0), result.output
    return {check["name"]: check for check in data["checks"]}


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test runs in an empty directory (its own .env, workspace and default --db), no key set."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    return tmp_path


@pytest.fixture
def cloud(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOpenAI]:
    """The cloud endpoint: a fake on loopback listing one model, ``fake``."""
    with FakeOpenAI() as fake:
        monkeypatch.setenv("FUSION_CLOUD_BASE_URL", fake.base_url)
        monkeypatch.setenv("FUSION_CLOUD_MODEL", "fake")
        yield fake


@pytest.fixture
def not_llama(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOpenAI]:
    """The local endpoint: an OpenAI-compatible server that is not llama-server (/props answers 404)."""
    with FakeOpenAI() as fake:
        monkeypatch.setenv("FUSION_LOCAL_BASE_URL", fake.base_url)
        yield fake


@pytest.fixture
def nothing_local(monkeypatch: pytest.MonkeyPatch) -> str:
    """The local endpoint: a loopback port nobody listens on."""
    url = f"http://127.0.0.1:{free_port()}/v1"
    monkeypatch.setenv("FUSION_LOCAL_BASE_URL", url)
    return url


# --------------------------------------------------------------------------- cloud key


def test_key_in_dotenv_is_reported_by_name_and_never_printed(
    in_tmp: Path, cloud: FakeOpenAI, not_llama: FakeOpenAI
) -> None:
    (in_tmp / ".env").write_text(f"FUSION_CLOUD_API_KEY={KEY}\n")
    for args in ([], ["--json"]):
        result = invoke(*args)
        assert KEY not in result.stdout + result.stderr
        assert "hunter" not in result.stdout + result.stderr
    check = rows(invoke("--json"))["cloud key"]
    assert check["status"] == "ok"
    assert "FUSION_CLOUD_API_KEY" in check["detail"] and ".env" in check["detail"]


def test_openai_key_only_in_dotenv_is_found_as_the_cli_reads_it(
    in_tmp: Path, cloud: FakeOpenAI, not_llama: FakeOpenAI
) -> None:
    (in_tmp / ".env").write_text(f"OPENAI_API_KEY={KEY}\n")
    result = invoke("--json")
    assert KEY not in result.stdout + result.stderr
    checks = rows(result)
    assert checks["cloud key"]["status"] == "ok"
    assert "OPENAI_API_KEY" in checks["cloud key"]["detail"] and "./.env" in checks["cloud key"]["detail"]
    assert checks["cloud endpoint"]["status"] == "ok"  # the key was still tried against the endpoint
    assert cloud.requests == []  # GET /models only: nothing generated without --live


def test_key_in_environment_is_ok(
    monkeypatch: pytest.MonkeyPatch, cloud: FakeOpenAI, not_llama: FakeOpenAI
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    result = invoke()
    assert KEY not in result.stdout + result.stderr
    assert "OPENAI_API_KEY is set (in the environment)" in result.stdout


def test_missing_key_fails_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, not_llama: FakeOpenAI
) -> None:
    result = invoke("--json")
    assert result.exit_code == 1
    checks = rows(result)
    assert checks["cloud key"]["status"] == "fail"
    assert "export OPENAI_API_KEY=..." in checks["cloud key"]["fix"]
    assert checks["cloud endpoint"]["status"] == "warn"  # skipped without a key

    monkeypatch.setenv("FUSION_CLOUD_API_KEY_ENV", "ACME_KEY")
    check = rows(invoke("--json"))["cloud key"]
    assert "ACME_KEY" in check["detail"] and "export ACME_KEY=..." in check["fix"]


# --------------------------------------------------------------------------- cloud endpoint


def test_cloud_key_refused_by_models_endpoint() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers["Authorization"] == f"Bearer {KEY}"
        return httpx.Response(401, json={"error": {"message": "Incorrect API key provided"}})

    client = httpx.Client(transport=httpx.MockTransport(answer))
    check = cloud_models_check(
        FusionSettings(), FoundKey("OPENAI_API_KEY", "environment", True, KEY), client, "http://h/v1"
    )
    assert check.status == "fail" and "key refused" in check.detail
    assert "OPENAI_API_KEY" in check.fix


def test_cloud_model_missing_from_the_list_warns() -> None:
    client = httpx.Client(
        transport=httpx.MockTransport(lambda r: httpx.Response(200, json={"data": [{"id": "a"}]}))
    )
    key = FoundKey("OPENAI_API_KEY", "environment", True, KEY)
    check = cloud_models_check(FusionSettings(cloud_model="gpt-x"), key, client, "http://h/v1")
    assert check.status == "warn" and "gpt-x" in check.detail


def test_live_sends_one_token_and_hides_an_echoed_key(
    monkeypatch: pytest.MonkeyPatch, cloud: FakeOpenAI, not_llama: FakeOpenAI
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    result = invoke("--live", "--json")
    assert rows(result)["cloud completion"]["status"] == "ok"
    assert cloud.requests[-1]["max_completion_tokens"] == 1
    assert cloud.requests[-1]["model"] == "fake"

    echo = json.dumps({"error": {"message": f"Incorrect API key provided: {KEY}"}}).encode()
    cloud.script([Reply(status=401, raw=echo)])
    result = invoke("--live", "--json")
    assert result.exit_code == 1
    assert KEY not in result.stdout + result.stderr
    check = rows(result)["cloud completion"]
    assert check["status"] == "fail" and "key refused" in check["detail"] and "[REDACTED]" in check["detail"]


def test_unreachable_cloud_fails(monkeypatch: pytest.MonkeyPatch, not_llama: FakeOpenAI) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("FUSION_CLOUD_BASE_URL", f"http://127.0.0.1:{free_port()}/v1")
    check = rows(invoke("--json"))["cloud endpoint"]
    assert check["status"] == "fail" and "cannot reach" in check["detail"]


# --------------------------------------------------------------------------- llama-server


def test_local_server_not_reachable_fails_with_the_url(nothing_local: str) -> None:
    result = invoke()
    assert result.exit_code == 1
    assert nothing_local in result.stdout
    check = rows(invoke("--json"))["llama-server"]
    assert check["status"] == "fail"
    assert nothing_local in check["detail"]
    assert "llama-server -m MODEL.gguf --jinja -np 4" in check["fix"]


def test_openai_compatible_server_is_reported_as_not_llama_server(
    monkeypatch: pytest.MonkeyPatch, cloud: FakeOpenAI, not_llama: FakeOpenAI
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    result = invoke()
    assert re.search(r"│ llama-server\s+│ warn", result.stdout), result.stdout
    result = invoke("--json")
    check = rows(result)["llama-server"]
    assert check["status"] == "warn"
    assert "not llama-server" in check["detail"] and "no slot affinity" in check["detail"]
    assert result.exit_code == 0  # warnings only: the set-up runs
    assert "slots" not in rows(result)


def props(total: int = 4, window: int | None = 8192) -> ServerProps:
    return ServerProps(total, window)


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


CAPS_TOOLS = {"chat_template_caps": {"supports_tools": True, "supports_parallel_tool_calls": True}}


def test_props_of_a_well_started_server_pass() -> None:
    checks = by_name(props_checks(props(), CAPS_TOOLS, (200, ""), FusionSettings(), 4096))
    assert [checks[n].status for n in ("slots", "slot window", "tool calling", "chat template")] == ["ok"] * 4
    assert checks["not in /props"].status == "info"
    assert "--kv-unified" in checks["not in /props"].detail


def test_window_under_twice_the_completion_budget_fails() -> None:
    check = window_check(props(4, 4096), FusionSettings(), 4096)
    assert check.status == "fail"
    assert "4096" in check.detail and "8192" in check.fix and "-c 131072" in check.fix
    assert window_check(props(4, 8192), FusionSettings(), 4096).status == "ok"
    assert window_check(props(4, None), FusionSettings(), 4096).status == "warn"
    too_big = window_check(props(4, 8192), FusionSettings(local_window_tokens=16384), 1024)
    assert too_big.status == "fail" and "FUSION_LOCAL_WINDOW_TOKENS=16384" in too_big.detail


def test_slot_counts() -> None:
    one = by_name(props_checks(props(1), CAPS_TOOLS, (200, ""), FusionSettings(), 1024))["slots"]
    assert one.status == "warn" and "reflection slot" in one.detail and "-np" in one.fix
    more = by_name(props_checks(props(2), CAPS_TOOLS, (200, ""), FusionSettings(local_slots=4), 1024))
    assert more["slots"].status == "fail"
    fewer = by_name(props_checks(props(4), CAPS_TOOLS, (200, ""), FusionSettings(local_slots=2), 1024))
    assert fewer["slots"].status == "warn"


def test_jinja_probe() -> None:
    refused = jinja_check(500, "tools param requires --jinja flag")
    assert refused.status == "fail" and "--jinja" in refused.detail and "--jinja" in refused.fix
    assert jinja_check(200, "").status == "ok"
    assert jinja_check(404, "not found").status == "info"
    assert jinja_check(None, "ReadTimeout").status == "warn"


def test_template_caps() -> None:
    assert template_check(CAPS_TOOLS).status == "ok"
    plain = template_check({"chat_template_caps": {"supports_tools": False}})
    assert plain.status == "warn" and "--chat-template-file" in plain.fix
    assert template_check({}).status == "info"


def test_kv_unified_checked_only_when_props_say_it() -> None:
    unified = by_name(cache_checks({"kv_unified": True}))
    assert unified["kv cache"].status == "warn"
    assert "--kv-unified," not in unified["not in /props"].detail
    assert by_name(cache_checks({"kv_unified": False}))["kv cache"].status == "ok"
    assert "kv cache" not in by_name(cache_checks({}))


def test_the_flags_props_cannot_show_are_named_with_the_crowd_fix_and_a_hidden_slots_endpoint_warned() -> (
    None
):
    unsaid = by_name(cache_checks({}))["not in /props"]
    assert "--slot-prompt-similarity" in unsaid.detail and "--cache-ram" in unsaid.detail
    assert "-sps 1" in unsaid.fix and "warms empty slots itself" in unsaid.fix
    hidden = by_name(cache_checks({"endpoint_slots": False}))["slots endpoint"]
    assert hidden.status == "warn" and "--no-slots" in hidden.fix
    assert "slots endpoint" not in by_name(cache_checks({"endpoint_slots": True}))


# --------------------------------------------------------------------------- workspace


def test_missing_workspace_fails(monkeypatch: pytest.MonkeyPatch, in_tmp: Path, nothing_local: str) -> None:
    monkeypatch.setenv("FUSION_WORKSPACE_ROOT", str(in_tmp / "nope"))
    check = rows(invoke("--json"))["workspace"]
    assert check["status"] == "fail" and "does not exist" in check["detail"]
    assert "FUSION_WORKSPACE_ROOT" in check["detail"]


def test_dotenv_in_workspace_must_be_a_secret_file(
    monkeypatch: pytest.MonkeyPatch, in_tmp: Path, nothing_local: str
) -> None:
    workspace = in_tmp / "ws"
    workspace.mkdir()
    (workspace / ".env").write_text("X=1\n")
    assert rows(invoke("--json", "--workspace", str(workspace)))["workspace secrets"]["status"] == "ok"
    monkeypatch.setenv("FUSION_SECRET_FILES", "[]")
    check = rows(invoke("--json", "--workspace", str(workspace)))["workspace secrets"]
    assert check["status"] == "warn" and ".env" in check["detail"]


# --------------------------------------------------------------------------- checkpoint database


def test_sqlite_database(in_tmp: Path) -> None:
    fresh = sqlite_check(in_tmp / "new" / "threads.sqlite")
    assert fresh.status == "ok" and "does not exist yet" in fresh.detail
    good = in_tmp / "good.sqlite"
    with sqlite3.connect(good) as connection:
        connection.execute("CREATE TABLE t (x)")
    connection.close()
    assert sqlite_check(good).status == "ok" and "schema_version 1" in sqlite_check(good).detail
    junk = in_tmp / "junk.sqlite"
    junk.write_bytes(b"this is not a database, just text that is long enough" * 4)
    bad = sqlite_check(junk)
    assert bad.status == "fail" and "does not open as SQLite" in bad.detail
    blocked = in_tmp / "file"
    blocked.write_text("")
    assert sqlite_check(blocked / "threads.sqlite").status == "fail"


def test_db_option_reaches_the_check(in_tmp: Path, nothing_local: str) -> None:
    (in_tmp / "junk.sqlite").write_text("not sqlite" * 20)
    check = rows(invoke("--json", "--db", "junk.sqlite"))["checkpoint db"]
    assert check["status"] == "fail"


def test_postgres(monkeypatch: pytest.MonkeyPatch) -> None:
    assert postgres_check("mysql://x", timeout=1).status == "fail"
    url = f"postgresql://user:pa55word@127.0.0.1:{free_port()}/db"
    refused = postgres_check(url, timeout=1)
    assert refused.status == "fail" and "pa55word" not in refused.detail and "[REDACTED]" in refused.detail
    monkeypatch.setitem(sys.modules, "psycopg", None)
    missing = postgres_check(url, timeout=1)
    assert missing.status == "fail" and "psycopg" in missing.detail and "pip install" in missing.fix


def test_shared_state_check(monkeypatch: pytest.MonkeyPatch) -> None:
    unnamed = shared_state_check(None, timeout=1)
    assert unnamed.status == "fail" and "FUSION_SHARED_STATE_URL" in unnamed.fix
    wrong = shared_state_check("mysql://u:secret@h/d", timeout=1)
    assert wrong.status == "fail" and "'mysql'" in wrong.detail and "secret" not in wrong.detail
    url = f"postgresql://user:pa55word@127.0.0.1:{free_port()}/db"
    refused = shared_state_check(url, timeout=1)
    assert refused.status == "fail" and "pa55word" not in refused.detail and "[REDACTED]" in refused.detail
    assert refused.detail.endswith("every worker places in-process")
    monkeypatch.setitem(sys.modules, "psycopg_pool", None)
    missing = shared_state_check(url, timeout=1)
    assert missing.status == "fail" and "psycopg_pool" in missing.detail and "pip install" in missing.fix


def test_redact_url() -> None:
    assert redact_url("postgresql://u:p@h:5/d") == "postgresql://u:[REDACTED]@h:5/d"
    assert redact_url("postgresql://h/d") == "postgresql://h/d"


# --------------------------------------------------------------------------- the command


@pytest.mark.parametrize("has_key", [True, False])
def test_json_ok_matches_exit_code(
    monkeypatch: pytest.MonkeyPatch, cloud: FakeOpenAI, not_llama: FakeOpenAI, has_key: bool
) -> None:
    if has_key:
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
    result = invoke("--json")
    data = json.loads(result.stdout)
    assert data["ok"] is has_key and result.exit_code == (0 if has_key else 1)
    assert all(set(c) == {"name", "status", "detail", "fix"} for c in data["checks"])
    assert {c["status"] for c in data["checks"]} <= {"ok", "warn", "fail", "info"}


def test_table_lists_every_check_and_a_verdict(monkeypatch: pytest.MonkeyPatch, nothing_local: str) -> None:
    result = invoke()
    for name in ("cloud key", "cloud endpoint", "llama-server", "workspace", "checkpoint db"):
        assert name in result.stdout
    assert "not ready: 2 failed" in result.stdout


def test_bad_context_is_a_usage_error() -> None:
    result = invoke("--context", '{"mode": "nonsense"}')
    assert result.exit_code == 2 and "error" in result.stderr


def test_context_budget_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real: Callable[..., list[Check]] = props_checks

    def spy(*args: Any, **kwargs: Any) -> list[Check]:
        seen.append(args[4])
        return real(*args, **kwargs)

    async def fetch(base_url: str, *, timeout: float) -> ServerProps:
        return props()

    monkeypatch.setattr(module, "props_checks", spy)
    monkeypatch.setattr(llama_server, "fetch_props", fetch)
    monkeypatch.setattr(module, "_raw_props", lambda client, root: {})
    monkeypatch.setattr(module, "_tools_probe", lambda client, root: (200, ""))
    invoke("--context", '{"max_completion_tokens": 1234}')
    assert seen == [1234]


# --------------------------------------------------------------------------- a gateway over boxes


def box_props(slots: int) -> dict[str, Any]:
    return {"total_slots": slots, "model_alias": "fake", "default_generation_settings": {"n_ctx": 8192}}


@pytest.mark.parametrize(("second_slots", "agree"), [(4, "ok"), (3, "fail")])
def test_a_gateway_is_checked_through_its_boxes_and_they_must_agree(
    cloud: FakeOpenAI, monkeypatch: pytest.MonkeyPatch, second_slots: int, agree: str
) -> None:
    with FakeOpenAI() as gateway, FakeOpenAI() as box_1, FakeOpenAI() as box_2:
        box_1.props, box_2.props = box_props(4), box_props(second_slots)
        monkeypatch.setenv("FUSION_LOCAL_BASE_URL", gateway.base_url)
        monkeypatch.setenv("FUSION_LOCAL_MODEL", "fake")
        workers = [box.base_url.removesuffix("/v1") for box in (box_1, box_2)]
        monkeypatch.setenv("FUSION_LOCAL_WORKERS", json.dumps(workers))
        found = rows(invoke("--json"))
    assert found["box 1: llama-server"]["status"] == "ok"
    assert found["box 2: llama-server"]["status"] == "ok"
    assert found["boxes agree"]["status"] == agree
    assert found["gateway"]["status"] == "ok" and "x-fusion-thread" in found["gateway"]["detail"]
    assert "llama-server" not in found  # the gateway itself is not taken for a llama-server


def test_a_gateway_that_does_not_serve_local_model_fails_with_the_alias_to_set(
    cloud: FakeOpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    with FakeOpenAI() as gateway, FakeOpenAI() as box:
        box.props = box_props(4)
        monkeypatch.setenv("FUSION_LOCAL_BASE_URL", gateway.base_url)
        monkeypatch.setenv("FUSION_LOCAL_WORKERS", json.dumps([box.base_url]))
        result = invoke("--json")
    found = rows(result)
    assert result.exit_code == 1
    assert found["gateway"]["status"] == "fail" and "--alias local" in found["gateway"]["fix"]


# --------------------------------------------------------------------------- shared state


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (None, "no database is named"),
        ("postgress://fusion:pw-x1@127.0.0.1:5432/db", "scheme is 'postgress'"),
        ("dead", "cannot connect to"),
    ],
)
def test_a_shared_state_database_that_cannot_serve_is_a_failed_row_with_its_fix(
    monkeypatch: pytest.MonkeyPatch, nothing_local: str, url: str | None, says: str
) -> None:
    monkeypatch.setenv("FUSION_SHARED_STATE", "postgres")
    monkeypatch.delenv("DATABASE_URI", raising=False)
    if url == "dead":
        url = f"postgresql://fusion:pw-x1@127.0.0.1:{free_port()}/db"
    if url is not None:
        monkeypatch.setenv("FUSION_SHARED_STATE_URL", url)
    result = invoke("--json", "--timeout", "1")
    assert result.exit_code == 1, result.output
    row = rows(result)["shared state"]
    assert row["status"] == "fail" and says in row["detail"], row
    assert "FUSION_SHARED_STATE_URL" in row["fix"] or "FUSION_SHARED_STATE_URL" in row["detail"]
    assert "pw-x1" not in result.output


def test_without_shared_state_doctor_has_no_shared_state_row(nothing_local: str) -> None:
    assert "shared state" not in rows(invoke("--json", "--timeout", "1"))


def test_the_postgres_version_reads_as_postgres_prints_it() -> None:
    from fusion_graph.cli.doctor.checkpoints import postgres_version

    assert postgres_version(150018) == "15.18"
    assert postgres_version(160002) == "16.2"
    assert postgres_version(90624) == "9.6.24"


def test_a_local_only_context_needs_no_cloud_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fusion_graph.cli.doctor.cloud import cloud_key_check

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    said = cloud_key_check(FusionSettings(), None, local_only=True)
    assert said.status == "info" and "not needed" in said.detail and "OPENAI_API_KEY" in said.fix
    assert cloud_key_check(FusionSettings(), None).status == "fail"  # fusion mode builds the cloud leg
