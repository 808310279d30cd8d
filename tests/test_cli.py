"""The ``fusion-graph`` CLI: replay, calibrate, report, and run's fail-fast checks and live table."""

from __future__ import annotations

import json
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
from typer.testing import CliRunner

from fusion_graph.cli import run as cli_run
from fusion_graph.cli.app import app
from fusion_graph.cli.run import StepTable
from fusion_graph.context import FusionContext
from fusion_graph.settings import FusionSettings
from tests.fakes import ai_calls, call, scripted

runner = CliRunner()


@pytest.fixture
def dollar_prices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator prices the default cloud model at $1 in / $2 out per million tokens."""
    monkeypatch.setenv("FUSION_PRICE_OVERRIDES", json.dumps({"gpt-4o-mini": [1.0, 2.0, None]}))


def tool_call(call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "read", "arguments": "{}"}}


def write_tiny_traces(path: Path) -> Path:
    """Three conversations: 2 steps (plan + 1), 1 step (plan only), 2 turns of 2 steps each."""
    a = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call("a1")]},
        {"role": "tool", "tool_call_id": "a1", "content": "ok"},
        {"role": "assistant", "content": "done"},
    ]
    b = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    c = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call("c1")]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "assistant", "content": "first done"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "", "tool_calls": [tool_call("c2")]},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"},
        {"role": "assistant", "content": "second done"},
    ]
    records = [
        {"id": "a", "messages": a, "reward": 1},
        {"id": "b", "messages": b},
        {"id": "c", "messages": c},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def write_varied_traces(path: Path, count: int = 20) -> Path:
    """``count`` single-turn tool loops of 2-6 steps with tool output of varied size."""
    lines = []
    for index in range(count):
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {index}"}]
        for step in range(2 + index % 5):
            messages.append(
                {"role": "assistant", "content": "", "tool_calls": [tool_call(f"t{index}-{step}")]}
            )
            size = 40 * ((index * 7 + step * 13) % 23 + 1)
            messages.append({"role": "tool", "tool_call_id": f"t{index}-{step}", "content": "y" * size})
        messages.append({"role": "assistant", "content": "finished"})
        lines.append(json.dumps({"id": f"v{index}", "messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def invoke_json(*args: str) -> dict[str, Any]:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


# --------------------------------------------------------------------------- replay


def test_replay_json_counts_steps_legs_and_switches(tmp_path: Path, dollar_prices: None) -> None:
    traces = write_tiny_traces(tmp_path / "tiny.jsonl")
    out = invoke_json("replay", str(traces), "--cloud-share", "30", "--json")
    # Plans go cloud (cloud_share > 0); each continuation scores far below the stay bar 60.
    assert [[s["leg"] for s in t["steps"]] for t in out["trajectories"]] == [
        ["cloud", "local"],
        ["cloud"],
        ["cloud", "local", "cloud", "local"],
    ]
    assert (out["steps"], out["cloud_steps"], out["continuation_steps"], out["switches"]) == (7, 4, 3, 4)
    assert out["cloud_fraction"] == round(4 / 7, 4)
    assert out["continuation_cloud_fraction"] == 0.0
    first = out["trajectories"][0]
    assert [s["step"] for s in first["steps"]] == [0, 1]
    assert [s["threshold"] for s in first["steps"]] == [None, 60]
    assert set(first["steps"][1]["breakdown"]) == {
        "context_pressure",
        "turn_depth",
        "transient_notice",
        "tail_growth",
    }
    assert (first["id"], first["reward"]) == ("a", 1.0)
    # Cost: cloud steps' estimated tokens at the overridden $1 / $2 per million; local is free.
    rows = [s for t in out["trajectories"] for s in t["steps"]]
    expected_all = sum(s["prompt_tokens"] * 1.0 + s["completion_tokens"] * 2.0 for s in rows) / 1e6
    expected = (
        sum(s["prompt_tokens"] * 1.0 + s["completion_tokens"] * 2.0 for s in rows if s["leg"] == "cloud")
        / 1e6
    )
    assert out["cost_usd"] == pytest.approx(expected)
    assert out["all_cloud_cost_usd"] == pytest.approx(expected_all)
    assert 0 < out["cost_usd"] < out["all_cloud_cost_usd"]


@pytest.mark.parametrize(("share", "cloud_steps"), [(0, 0), (100, 7)])
def test_replay_at_the_ends_of_the_dial(tmp_path: Path, share: int, cloud_steps: int) -> None:
    traces = write_tiny_traces(tmp_path / "tiny.jsonl")
    out = invoke_json("replay", str(traces), "--cloud-share", str(share), "--json")
    assert out["cloud_steps"] == cloud_steps
    assert out["switches"] == 0
    assert out["continuation_cloud_fraction"] == (1.0 if share else 0.0)
    if share == 0:
        assert out["cost_usd"] == 0.0
    else:
        assert out["cost_usd"] == pytest.approx(out["all_cloud_cost_usd"])


def test_replay_prints_a_table_without_json(tmp_path: Path) -> None:
    traces = write_tiny_traces(tmp_path / "tiny.jsonl")
    result = runner.invoke(app, ["replay", str(traces)])
    assert result.exit_code == 0, result.output
    assert "tiny" in result.stdout and "cloud_share=30" in result.stdout
    assert "0.57" in result.stdout  # 4 of 7 steps on cloud


def test_replay_plot_writes_a_png(tmp_path: Path) -> None:
    traces = write_tiny_traces(tmp_path / "tiny.jsonl")
    target = tmp_path / "timelines.png"
    result = runner.invoke(app, ["replay", str(traces), "--plot", str(target), "--json"])
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)  # --plot keeps stdout clean JSON
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert target.stat().st_size > 5000


def test_replay_of_a_missing_path_fails_with_the_path(tmp_path: Path) -> None:
    result = runner.invoke(app, ["replay", str(tmp_path / "nowhere")])
    assert result.exit_code == 2
    assert "trace path not found" in result.stderr
    assert "nowhere" in result.stderr


def test_replay_rejects_an_invalid_context(tmp_path: Path) -> None:
    traces = write_tiny_traces(tmp_path / "tiny.jsonl")
    result = runner.invoke(app, ["replay", str(traces), "--context", '{"cloud_share": 150}'])
    assert result.exit_code == 2
    assert "between 0 and 100" in result.stderr


# --------------------------------------------------------------------------- calibrate


def test_calibrate_hits_the_target_and_replay_agrees(tmp_path: Path) -> None:
    traces = write_varied_traces(tmp_path / "varied.jsonl")
    out = invoke_json(
        "calibrate", str(traces), "--target-cloud-fraction", "0.3", "--json", "--context", '{"max_steps": 30}'
    )
    assert out["target"] == 0.3
    assert out["continuation_steps"] == sum(2 + i % 5 for i in range(20))
    # Paced, each conversation holds the nearest whole step to 30 % of its 2-6 steps (0.6 -> 1,
    # 0.9 -> 1, 1.2 -> 1, 1.5 -> 1 or 2, 1.8 -> 2): 0.3 plus what that rounding adds up to.
    assert 0.3 <= out["achieved"] <= 0.35
    context = out["context"]
    assert (context["cloud_share"], context["hysteresis"], context["max_steps"]) == (30, 10, 30)
    assert len(context["score_quantiles"]) == 101
    assert context["pace_slack"] == 0.5  # paced by default: a table alone does not transfer
    FusionContext(**context)  # a valid run context
    replayed = invoke_json("replay", str(traces), "--json", "--context", json.dumps(context))
    assert replayed["continuation_cloud_fraction"] == out["achieved"]
    # --save writes the same context to a file that --context accepts.
    saved = tmp_path / "calibrated.json"
    args = ["calibrate", str(traces), "--target-cloud-fraction", "0.3", "--save", str(saved)]
    result = runner.invoke(app, [*args, "--context", '{"max_steps": 30}'])
    assert result.exit_code == 0, result.output
    assert "achieved" in result.stdout
    assert json.loads(saved.read_text()) == context
    from_file = invoke_json("replay", str(traces), "--json", "--context", str(saved))
    assert from_file["continuation_cloud_fraction"] == out["achieved"]
    # The same table at another share means that share.
    other = invoke_json(
        "replay", str(traces), "--json", "--context", json.dumps({**context, "cloud_share": 60})
    )
    assert abs(other["continuation_cloud_fraction"] - 0.6) <= 0.06


def test_calibrate_paces_unless_told_not_to(tmp_path: Path) -> None:
    traces = str(write_varied_traces(tmp_path / "varied.jsonl"))
    target = ["--target-cloud-fraction", "0.3", "--json"]
    table_only = invoke_json("calibrate", traces, *target, "--pace-slack", "0")["context"]
    assert table_only["pace_slack"] is None
    from_context = invoke_json("calibrate", traces, *target, "--context", '{"pace_slack": 2}')["context"]
    assert from_context["pace_slack"] == 2
    assert table_only["score_quantiles"] == from_context["score_quantiles"]  # the pace is not in the fit
    result = runner.invoke(app, ["calibrate", traces, *target, "--pace-slack", "0.3"])
    assert result.exit_code == 2
    assert "between 0.5 and 100" in result.stderr and "--pace-slack 0" in result.stderr


def test_calibrate_refuses_a_target_outside_0_1(tmp_path: Path) -> None:
    traces = write_varied_traces(tmp_path / "varied.jsonl")
    result = runner.invoke(app, ["calibrate", str(traces), "--target-cloud-fraction", "1.5"])
    assert result.exit_code == 2
    assert "between 0 and 1" in result.stderr


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
    common = ["--workspace", str(tmp_path), "--db", str(db), "--thread", "t1"]
    first = runner.invoke(app, ["run", "read my notes", *common])
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


def test_report_of_a_missing_database_says_so(tmp_path: Path) -> None:
    result = runner.invoke(app, ["report", "--db", str(tmp_path / "none.sqlite")])
    assert result.exit_code == 2
    assert "no checkpoint database" in result.stderr
    assert not (tmp_path / "none.sqlite").exists()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.mark.parametrize("mode", ["fusion", "local"])
def test_run_without_a_cloud_key_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # The default chain builds both legs, so even a local-only run needs the key.
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
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


def test_an_operator_setting_in_the_run_context_is_refused(tmp_path: Path) -> None:
    traces = write_tiny_traces(tmp_path / "tiny.jsonl")
    result = runner.invoke(app, ["replay", str(traces), "--context", '{"local_base_url": "http://x/v1"}'])
    assert result.exit_code == 2
    assert "operator setting" in result.stderr and "FUSION_LOCAL_BASE_URL" in result.stderr


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
    assert "12 / 60" in pending and "back to local" in pending
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
    assert "cloud (routed local)" in text
    assert "cloud:gpt-4o-mini" in text and "1234" in text and "1000" in text and "$0.000123" in text
    assert len(steps.rows) == 2
    assert [key[1] for key in steps.rows] == [1, 0]
