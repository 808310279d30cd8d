"""``fusion-graph run``: a streamed turn, the checks before it, and the live step table."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from rich.console import Console

from fusion_graph.cli import run as cli_run
from fusion_graph.cli.app import app
from fusion_graph.cli.run import StepTable
from fusion_graph.context import FusionContext
from fusion_graph.settings import FusionSettings
from tests.plugins.fakes import ai_calls, call, scripted
from tests.unit.cli.test_traces import invoke_json, runner

# --------------------------------------------------------------------------- run + report


def usage(prompt: int, completion: int, cached: int | None = None) -> UsageMetadata:
    data = UsageMetadata(input_tokens=prompt, output_tokens=completion, total_tokens=prompt + completion)
    if cached is not None:
        data["input_token_details"] = InputTokenDetails(cache_read=cached)
    return data


@pytest.fixture
def scripted_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[BaseChatModel, BaseChatModel]]]:
    """Each ``fusion-graph run`` takes the next (cloud, local) pair of scripted models."""
    pairs: list[tuple[BaseChatModel, BaseChatModel]] = []

    async def models(context: FusionContext, settings: FusionSettings) -> tuple[BaseChatModel, BaseChatModel]:
        return pairs.pop(0)

    monkeypatch.setattr(cli_run, "MODELS", models)
    yield pairs
    assert not pairs, "every scripted run was used"


def test_run_streams_a_turn_persists_the_thread_and_report_prices_it(
    tmp_path: Path, scripted_runs: list[tuple[BaseChatModel, BaseChatModel]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The operator's settings: the cloud model and its price ($1 in, $2 out, $0.5 cached per million).
    monkeypatch.setenv("FUSION_CLOUD_MODEL", "cloudfake")
    monkeypatch.setenv("FUSION_PRICE_OVERRIDES", json.dumps({"cloudfake": [1.0, 2.0, 0.5]}))
    (tmp_path / "notes.txt").write_text("remember the milk\n")
    plan = ai_calls(call("read_file", {"path": "notes.txt"}, "r1"))
    plan.usage_metadata = usage(1000, 100)
    scripted_runs.append(
        (
            scripted("cloudfake", [plan]),
            scripted("localfake", [AIMessage("done", usage_metadata=usage(2000, 50, cached=1500))]),
        )
    )
    scripted_runs.append(
        (
            scripted("cloudfake", [AIMessage("again", usage_metadata=usage(3000, 10))]),
            scripted("localfake", []),
        )
    )
    db = tmp_path / "threads.sqlite"
    # Memory jobs off: this test counts the turn's own inferences (memory runs: test_run_memory.py).
    off = json.dumps({"sub_runners": "off"})
    common = ["--workspace", str(tmp_path), "--db", str(db), "--thread", "t1", "--context", off]
    # t1 has no checkpoint yet: --new-thread starts it (an unknown --thread alone is refused).
    first = runner.invoke(app, ["run", "read my notes", *common, "--new-thread"])
    assert first.exit_code == 0, first.output
    assert "done" in first.stdout
    assert "cloud:cloudfake" in first.stdout and "local:localfake" in first.stdout
    assert "$0.001200" in first.stdout  # the plan: 1000 in + 100 out at $1 / $2 per million
    assert "--thread t1" in first.stdout
    second = runner.invoke(app, ["run", "once more", *common])
    assert second.exit_code == 0, second.output
    assert "again" in second.stdout

    report = invoke_json("report", "--db", str(db), "--json")
    row = report["threads"]["t1"]
    assert (row["turns"], row["inferences"], row["cloud_inferences"], row["local_inferences"]) == (2, 3, 2, 1)
    assert (row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"]) == (6000, 1500, 160)
    assert row["cost_usd"] == pytest.approx((1000 + 200 + 3000 + 20) / 1e6)
    # The local step's tokens at cloud prices: 500 uncached + 1500 cached at $0.5 + 50 out at $2.
    assert row["all_cloud_cost_usd"] == pytest.approx(row["cost_usd"] + (500 + 750 + 100) / 1e6)
    assert row["continuation_steps"] == 1 and row["continuation_cloud_fraction"] == 0.0

    table = runner.invoke(app, ["report", "--db", str(db)])
    assert table.exit_code == 0, table.output
    assert "t1" in table.stdout and "$0.005570" in table.stdout


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.parametrize("mode", ["fusion", "cloud"])
def test_run_without_a_cloud_key_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # Every mode but local builds the cloud leg (a local step can fall over to it): it needs the key.
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)  # no .env here
    db = tmp_path / "db"
    context = json.dumps({"mode": mode})
    result = runner.invoke(
        app, ["run", "task", "--workspace", str(tmp_path), "--db", str(db), "--context", context]
    )
    assert result.exit_code == 2
    assert "export OPENAI_API_KEY=" in result.stderr
    assert "FUSION_CLOUD_API_KEY" in result.stderr
    assert not db.exists()


def test_run_with_llama_server_down_names_the_url_and_how_to_start_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    url = f"http://127.0.0.1:{free_port()}/v1"
    monkeypatch.setenv("FUSION_LOCAL_BASE_URL", url)
    result = runner.invoke(app, ["run", "task", "--workspace", str(tmp_path), "--db", str(tmp_path / "db")])
    assert result.exit_code == 2
    assert url in result.stderr
    assert "FUSION_LOCAL_BASE_URL" in result.stderr
    assert "llama-server -m MODEL.gguf" in result.stderr


async def test_cloud_only_runs_skip_the_llama_server_check() -> None:
    assert not cli_run.needs_local(FusionContext(mode="cloud"))
    assert not cli_run.needs_local(FusionContext(cloud_share=100))
    assert cli_run.needs_local(FusionContext(mode="local"))
    assert cli_run.needs_local(FusionContext(cloud_share=99))
    nowhere = FusionSettings(local_base_url=f"http://127.0.0.1:{free_port()}/v1")
    await cli_run.check_local_server(FusionContext(mode="cloud"), nowhere)  # does not raise
    with pytest.raises(typer.Exit):
        await cli_run.check_local_server(FusionContext(mode="fusion"), nowhere)


# --------------------------------------------------------------------------- the live table


def rendered(table: StepTable) -> str:
    console = Console(record=True, width=220)
    console.print(table.render())
    return console.export_text()


def test_live_table_renders_a_recorded_event_stream() -> None:
    steps = StepTable()
    decision = {
        "event": "fusion_route",
        "phase": "decision",
        "turn": 0,
        "step": 1,
        "kind": "step",
        "routed_leg": "local",
        "score": 12,
        "threshold": 60,
        "reason": "score 12 < 60 (T=70 - h=10): back to local",
        "slot": 2,
    }
    steps.apply(decision)
    pending = rendered(steps)
    assert "running" in pending and "local …" in pending
    assert "12/60" in pending and "back to local" in pending
    outcome = {
        **decision,
        "phase": "outcome",
        "leg": "cloud",  # local failed: the chain fell over to cloud
        "provider": "cloud:gpt-4o-mini",
        "prompt_tokens": 1234,
        "cached_tokens": 1000,
        "completion_tokens": 9,
        "cost_usd": 0.000123,
    }
    steps.apply(outcome)
    # An event from before the decision/outcome split has no phase: it is an outcome.
    legacy = {**outcome, "step": 0, "kind": "plan", "leg": "cloud", "routed_leg": "cloud"}
    del legacy["phase"]
    steps.apply(legacy)
    steps.apply({"event": "something_else", "step": 9})
    text = rendered(steps)
    assert "running" not in text
    assert "local → cloud" in text  # routed local, answered by cloud
    assert "cloud:gpt-4o-mini" in text and "1234" in text and "1000" in text and "$0.000123" in text
    assert len(steps.rows) == 2
    assert [key[1] for key in steps.rows] == [1, 0]


# --------------------------------------------------------------------------- the key, threads, --json


def test_a_key_written_in_dot_env_is_honoured_without_exporting_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("OPENAI_API_KEY=sk-from-dotenv\nFUSION_CLOUD_MODEL=cloudfake\n")
    seen: list[FusionSettings] = []

    async def models(context: FusionContext, settings: FusionSettings) -> tuple[BaseChatModel, BaseChatModel]:
        cli_run.check_cloud_key(settings)  # the real check: it must find the key
        seen.append(settings)
        return scripted("cloudfake", ["hello"]), scripted("localfake", [])

    monkeypatch.setattr(cli_run, "MODELS", models)
    result = runner.invoke(app, ["run", "hi", "--workspace", ".", "--context", '{"sub_runners": "off"}'])
    assert result.exit_code == 0, result.output
    assert "export" not in result.stderr and "hello" in result.stdout
    [settings] = seen
    assert settings.cloud_model == "cloudfake"  # FUSION_* names from .env, as before
    key = settings.api_key()
    assert key is not None and key.get_secret_value() == "sk-from-dotenv"
    assert "OPENAI_API_KEY" not in os.environ


@pytest.fixture
def two_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    async def models(context: FusionContext, settings: FusionSettings) -> tuple[BaseChatModel, BaseChatModel]:
        return scripted("cloudfake", ["first"]), scripted("localfake", [])

    monkeypatch.setattr(cli_run, "MODELS", models)


def test_an_unknown_thread_is_refused_unless_new_thread(tmp_path: Path, two_answers: None) -> None:
    db = tmp_path / "t.sqlite"
    common = ["--workspace", str(tmp_path), "--db", str(db), "--context", '{"sub_runners": "off"}']
    refused = runner.invoke(app, ["run", "hi", *common, "--thread", "nope"])
    assert refused.exit_code == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in refused.output
    assert f"thread 'nope' has no checkpoint in {db.resolve()};" in " ".join(lines[0].split())
    assert "--new-thread to start it here" in refused.stderr
    assert refused.stdout == ""  # no empty live table either
    started = runner.invoke(app, ["run", "hi", *common, "--thread", "nope", "--new-thread"])
    assert started.exit_code == 0, started.output
    again = runner.invoke(app, ["run", "hi", *common, "--thread", "nope"])
    assert again.exit_code == 0, again.output


def test_a_thread_begun_in_another_directory_is_found_and_named(
    tmp_path: Path, two_answers: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(project)
    common = ["--workspace", str(project), "--context", '{"sub_runners": "off"}']
    begun = runner.invoke(app, ["run", "hi", *common, "--thread", "t", "--new-thread"])
    assert begun.exit_code == 0, begun.output
    monkeypatch.chdir(elsewhere)  # threads live under the directory a command runs in, not the workspace
    refused = runner.invoke(app, ["run", "again", *common, "--thread", "t"])
    assert refused.exit_code == 2
    said = " ".join(refused.stderr.split())
    assert f"no checkpoint in {(elsewhere / '.fusion-graph' / 'threads.sqlite').resolve()}" in said
    assert "--db's default: .fusion-graph/threads.sqlite under this directory" in said
    found = (project / ".fusion-graph" / "threads.sqlite").resolve()
    assert f"it is in {found}: add --db {found}" in said
    assert "Traceback" not in refused.output and len(refused.stderr.strip().splitlines()) == 1


def test_json_prints_one_object_and_nothing_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSION_CLOUD_MODEL", "cloudfake")
    monkeypatch.setenv("FUSION_PRICE_OVERRIDES", json.dumps({"cloudfake": [1.0, 2.0, 0.5]}))
    (tmp_path / "notes.txt").write_text("milk\n")
    plan = ai_calls(call("read_file", {"path": "notes.txt"}, "r1"))
    plan.usage_metadata = usage(1000, 100)

    async def models(context: FusionContext, settings: FusionSettings) -> tuple[BaseChatModel, BaseChatModel]:
        return scripted("cloudfake", [plan]), scripted(
            "localfake", [AIMessage("milk", usage_metadata=usage(9, 1))]
        )

    monkeypatch.setattr(cli_run, "MODELS", models)
    args = ["run", "read", "--workspace", str(tmp_path), "--db", str(tmp_path / "t.sqlite"), "--json"]
    result = runner.invoke(app, [*args, "--context", '{"sub_runners": "off"}'])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)  # the whole of stdout is one JSON object
    assert {"answer", "thread_id", "route_log", "totals"} <= set(out)
    assert out["answer"] == "milk" and len(out["thread_id"]) == 12
    assert [(r["step"], r["kind"], r["leg"]) for r in out["route_log"]] == [
        (0, "plan", "cloud"),
        (1, "step", "local"),
    ]
    assert out["totals"]["total"]["cost_usd"] == pytest.approx(0.0012)
    assert out["totals"]["by_provider"]["cloud:cloudfake"]["inferences"] == 1
    assert (
        out["cloud_share"]["cloud_fraction"] == 0.5
        and out["cloud_share"]["continuation_cloud_fraction"] == 0.0
    )
    assert out["truncated"] is False


async def test_run_task_streams_events_and_flags_an_answer_cut_at_max_tokens(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("milk\n")
    cut = AIMessage("the notes s", response_metadata={"finish_reason": "length"})
    models = (
        scripted("cloudfake", [ai_calls(call("read_file", {"path": "notes.txt"}, "r1"))]),
        scripted("localfake", [cut]),
    )
    events: list[dict[str, Any]] = []
    ended: list[cli_run.RunResult] = []
    result = await cli_run.run_task(
        "read my notes",
        context=FusionContext(sub_runners="off"),
        settings=FusionSettings(workspace_root=str(tmp_path)),
        db=tmp_path / "t.sqlite",
        models=models,
        on_event=lambda event: events.append(dict(event)),
        on_turn_end=ended.append,
    )
    assert ended == [result]
    assert result.truncated and result.answer == "the notes s" and result.turn == 0
    answers = [e for e in events if e["event"] == "fusion_answer"]
    assert [(e["step"], e["tools"], e["finish_reason"]) for e in answers] == [
        (0, ["read_file"], None),
        (1, [], "length"),
    ]
    phases = [(e["step"], e.get("phase")) for e in events if e["event"] == "fusion_route"]
    assert phases == [(0, "decision"), (0, "outcome"), (1, "decision"), (1, "outcome")]
    steps = StepTable()
    for event in events:
        steps.apply(event)
    text = rendered(steps)
    assert "read_file" in text and "(cut)" in text and "max_tokens" in text


async def test_run_task_streams_the_tokens_of_the_running_step(tmp_path: Path) -> None:
    # Streamed (stream_mode="messages"): a scripted model streams its text word by word.
    events: list[dict[str, Any]] = []
    result = await cli_run.run_task(
        "hi",
        context=FusionContext(sub_runners="off"),
        settings=FusionSettings(workspace_root=str(tmp_path)),
        db=tmp_path / "t.sqlite",
        models=(scripted("cloudfake", ["one two three"]), scripted("localfake", [])),
        on_event=lambda event: events.append(dict(event)),
        stream_tokens=True,
    )
    assert result.answer == "one two three"
    streamed = [e for e in events if e["event"] == "fusion_tokens"]
    assert len(streamed) == 5 and {(e["step"], e["kind"]) for e in streamed} == {(0, "plan")}
    first_outcome = next(i for i, e in enumerate(events) if e.get("phase") == "outcome")
    assert all(events.index(e) < first_outcome for e in streamed)  # while the step ran


@pytest.mark.parametrize("scheme", ["postgress", "postgresql"])
def test_the_shared_state_urls_password_never_reaches_the_output_or_a_log_record(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    two_answers: None,
    scheme: str,
) -> None:
    import logging

    password = "pw-9f3kq"  # short: no key-shaped rule would catch it
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("FUSION_SHARED_STATE", "postgres")
    monkeypatch.setenv("FUSION_SHARED_STATE_URL", f"{scheme}://fusion:{password}@127.0.0.1:{free_port()}/db")
    monkeypatch.setenv("FUSION_SHARED_STATE_TIMEOUT_S", "1")
    caplog.set_level(logging.DEBUG)
    args = ["run", "hi", "--workspace", str(tmp_path), "--db", str(tmp_path / "t.sqlite")]
    result = runner.invoke(app, [*args, "--context", '{"mode": "cloud", "sub_runners": "off"}'])
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert password not in result.output and password not in logged
    if scheme == "postgress":  # a misspelt URL: one line naming the variable, and nothing runs
        assert result.exit_code == 2, result.output
        assert "FUSION_SHARED_STATE_URL" in result.stderr and "Traceback" not in result.output
    else:  # an unreachable database: the turn runs, placed in this process
        assert result.exit_code == 0, result.output
        assert "first" in result.stdout
        assert "the shared state's Postgres" in logged  # it was tried, and the attempt was logged scrubbed


def test_a_local_only_run_needs_no_cloud_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fusion_graph_testing.fake_openai import FakeOpenAI, Reply

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("FUSION_CLOUD_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)  # no .env here
    with FakeOpenAI([Reply(content="local answer")]) as local:
        monkeypatch.setenv("FUSION_LOCAL_BASE_URL", local.base_url)
        monkeypatch.setenv("FUSION_LOCAL_SLOTS", "2")
        args = ["run", "hi", "--workspace", str(tmp_path), "--db", str(tmp_path / "t.sqlite")]
        result = runner.invoke(app, [*args, "--context", '{"mode": "local", "sub_runners": "off"}'])
    assert result.exit_code == 0, result.output
    assert "local answer" in result.stdout and "API key" not in result.output
    assert len(local.requests) == 1
