"""``fusion-graph replay`` and ``calibrate``: trace replays, the calibrated dial, run context checks."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fusion_graph.cli.app import app
from fusion_graph.context import FusionContext
from fusion_graph.replay.traces import SAMPLE_NAME, SAMPLE_TRACES, TRACES_ENV

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


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ([], "a summary of 20 trajectories written to"),
        (["--plot-limit", "3"], "timelines of 3 trajectories (the first 3 of 20: --plot-limit 3) written to"),
        (["--plot-limit", "16"], "timelines of 16 trajectories (the first 16 of 20: --plot-limit 16)"),
    ],
)
def test_replay_plot_says_what_it_drew_and_what_it_left_out(
    tmp_path: Path, extra: list[str], said: str
) -> None:
    traces = write_varied_traces(tmp_path / "varied.jsonl", count=20)
    target = tmp_path / "plot.png"
    result = runner.invoke(app, ["replay", str(traces), "--plot", str(target), *extra])
    assert result.exit_code == 0, result.output
    assert said in " ".join(result.stdout.split())
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


def test_an_operator_setting_in_the_run_context_is_refused(tmp_path: Path) -> None:
    traces = write_tiny_traces(tmp_path / "tiny.jsonl")
    result = runner.invoke(app, ["replay", str(traces), "--context", '{"local_base_url": "http://x/v1"}'])
    assert result.exit_code == 2
    assert "operator setting" in result.stderr and "FUSION_LOCAL_BASE_URL" in result.stderr


# --------------------------------------------------------------------------- both shares, plans, targets


PLANS_NOTE = "plans (step 0 of each turn) run on cloud whenever cloud_share > 0"


def test_replay_shows_both_shares_and_why_they_differ(tmp_path: Path) -> None:
    traces = write_tiny_traces(tmp_path / "tiny.jsonl")
    result = runner.invoke(app, ["replay", str(traces), "--cloud-share", "30"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "cloud" in out and "all" in out and "cont." in out and "plans" in out
    assert (
        "on cloud: 0.57 of all steps (4 of 7), 0.00 of continuation steps (0 of 3, the steps after each "
        "turn's plan)"
    ) in out
    assert f"note: {PLANS_NOTE}: 4 of 7 steps are plans, 4 of them on cloud here, so at least 0.57" in out
    data = invoke_json("replay", str(traces), "--cloud-share", "30", "--json")
    assert (data["plan_steps"], data["plan_cloud_steps"], data["continuation_cloud_steps"]) == (4, 4, 0)
    assert data["note"].startswith(f"{PLANS_NOTE}: 4 of 7 steps")
    assert data["paced_steps"] == 0


def test_replay_counts_the_steps_the_pace_forced(tmp_path: Path) -> None:
    traces = write_varied_traces(tmp_path / "varied.jsonl")
    context = json.dumps({"cloud_share": 30, "pace_slack": 0.5, "max_steps": 30})
    data = invoke_json("replay", str(traces), "--json", "--context", context)
    paced = [s for t in data["trajectories"] for s in t["steps"] if s["paced"]]
    assert data["paced_steps"] == len(paced) > 0
    assert all("paced to" in s["reason"] for s in paced)
    result = runner.invoke(app, ["replay", str(traces), "--context", context])
    assert "paced within 0.5 steps" in result.stdout and "paced" in result.stdout


def test_replay_plot_of_many_trajectories_is_a_summary(tmp_path: Path) -> None:
    traces = write_varied_traces(tmp_path / "varied.jsonl", count=40)
    target = tmp_path / "summary.png"
    result = runner.invoke(app, ["replay", str(traces), "--plot", str(target), "--plot-limit", "40"])
    assert result.exit_code == 0, result.output
    assert f"summary of 40 trajectories written to {target}" in result.stdout
    width, height = png_size(target)
    assert height < 4000 and width < 2000


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_calibrate_shows_both_shares_and_the_plan_note(tmp_path: Path) -> None:
    traces = str(write_varied_traces(tmp_path / "varied.jsonl"))
    args = ["calibrate", traces, "--target-cloud-fraction", "0.3", "--context", '{"max_steps": 30}']
    out = invoke_json(*args, "--json")
    assert out["of"] == "continuation"
    assert out["achieved"] == out["continuation_cloud_fraction"]
    assert (out["steps"], out["plan_steps"], out["continuation_steps"]) == (100, 20, 80)
    # 20 plans on cloud plus the continuation share of 80 steps.
    assert out["cloud_fraction"] == round((20 + out["continuation_cloud_fraction"] * 80) / 100, 4)
    assert out["note"].startswith(f"{PLANS_NOTE}: 20 of 100 steps are plans")
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "target 0.300 of continuation steps" in result.stdout
    assert f"note: {PLANS_NOTE}: 20 of 100 steps" in result.stdout
    assert f"{out['cloud_fraction']:.3f}" in result.stdout and f"{out['achieved']:.3f}" in result.stdout


def test_calibrate_can_target_the_share_of_all_steps(tmp_path: Path) -> None:
    traces = str(write_varied_traces(tmp_path / "varied.jsonl"))
    out = invoke_json(
        "calibrate",
        traces,
        "--target-cloud-fraction",
        "0.5",
        "--of",
        "all",
        "--json",
        "--context",
        '{"max_steps": 30}',
    )
    assert out["of"] == "all"
    assert out["achieved"] == out["cloud_fraction"]
    assert abs(out["achieved"] - 0.5) <= 0.05
    assert out["continuation_cloud_fraction"] < out["cloud_fraction"]
    replayed = invoke_json("replay", traces, "--json", "--context", json.dumps(out["context"]))
    assert replayed["cloud_fraction"] == out["achieved"]  # the graph's routing agrees


def test_an_all_steps_target_below_what_plans_send_fails_with_the_numbers(tmp_path: Path) -> None:
    traces = str(write_varied_traces(tmp_path / "varied.jsonl"))
    result = runner.invoke(app, ["calibrate", traces, "--target-cloud-fraction", "0.1", "--of", "all"])
    assert result.exit_code == 2
    message = " ".join(result.stderr.split())
    assert "no cloud_share gives 0.10 of all steps" in message
    assert "Plans (step 0 of each turn) run on cloud whenever cloud_share > 0: 20 of 100 steps" in message
    assert "at least 0.20" in message and "--of continuation" in message


def test_calibrate_can_target_cost(tmp_path: Path, dollar_prices: None) -> None:
    traces = str(write_varied_traces(tmp_path / "varied.jsonl"))
    out = invoke_json(
        "calibrate", traces, "--target-cost-fraction", "0.6", "--json", "--context", '{"max_steps": 30}'
    )
    assert out["of"] == "cost"
    assert out["achieved"] == out["cost_fraction"]
    assert abs(out["achieved"] - 0.6) <= 0.05
    replayed = invoke_json("replay", traces, "--json", "--context", json.dumps(out["context"]))
    assert replayed["cost_usd"] / replayed["all_cloud_cost_usd"] == pytest.approx(out["achieved"], abs=1e-4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give one target"),
        (["--target-cloud-fraction", "0.2", "--target-cost-fraction", "0.2"], "give one target"),
        (["--target-cost-fraction", "0.2", "--of", "all"], "--of applies to --target-cloud-fraction"),
        (["--target-cloud-fraction", "0.2", "--of", "tokens"], "--of must be 'all' or 'continuation'"),
        (["--target-cost-fraction", "1.2"], "target cost fraction must be between 0 and 1"),
    ],
)
def test_calibrate_target_options_are_checked(tmp_path: Path, args: list[str], message: str) -> None:
    traces = str(write_varied_traces(tmp_path / "varied.jsonl"))
    result = runner.invoke(app, ["calibrate", traces, *args])
    assert result.exit_code == 2
    assert message in " ".join(result.stderr.split())


def test_calibrate_plot_draws_target_against_both_shares(tmp_path: Path) -> None:
    traces = str(write_varied_traces(tmp_path / "varied.jsonl"))
    target = tmp_path / "calibration.png"
    result = runner.invoke(
        app, ["calibrate", traces, "--target-cloud-fraction", "0.3", "--plot", str(target)]
    )
    assert result.exit_code == 0, result.output
    assert f"calibration curve written to {target}" in result.stdout
    width, height = png_size(target)
    assert 800 < width < 2000 and height < 800


# --------------------------------------------------------------------------- 80 columns


def at_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Render as an 80-column terminal does: rich reads the width from COLUMNS, prints no colour codes."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("TERM", "dumb")


def tables_of(out: str, first_sentence: str) -> str:
    """The tables a command printed: what comes before its first sentence (sentences soft-wrap)."""
    assert f"\n{first_sentence}" in out, out
    return out.split(f"\n{first_sentence}")[0]


def assert_fits_with_whole_numbers(out: str, numbers: list[str]) -> None:
    """Every line fits 80 columns, and each number stands whole (not cut to ``8…``, not split)."""
    from rich.cells import cell_len

    assert all(cell_len(line) <= 80 for line in out.splitlines()), out
    assert "…" not in out, out
    for number in numbers:
        assert re.search(rf"(?<![\w.$]){re.escape(number)}(?![\w.])", out), f"{number} not whole in:\n{out}"


def write_many_steps(path: Path) -> Path:
    """A family of 200 tool loops (over 800 steps: three-digit counts) under a long file name."""
    return write_varied_traces(path / "a-family-of-recorded-coding-agent-runs.jsonl", count=200)


def test_replay_reads_at_80_columns_with_every_number_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dollar_prices: None
) -> None:
    long = write_many_steps(tmp_path)
    tiny = write_tiny_traces(tmp_path / "tiny.jsonl")
    context = ["--context", '{"cloud_share": 30, "pace_slack": 0.5, "max_steps": 30}']
    at_80_columns(monkeypatch)
    rows = {
        name: invoke_json("replay", str(path), "--json", *context)
        for name, path in (("long", long), ("tiny", tiny))
    }
    rows["all"] = invoke_json("replay", str(tmp_path), "--json", *context)
    result = runner.invoke(app, ["replay", str(tmp_path), *context])
    assert result.exit_code == 0, result.output
    numbers = []
    for row in rows.values():
        numbers += [str(len(row["trajectories"])), str(row["steps"]), str(row["plan_steps"])]
        numbers += [str(row["continuation_steps"]), str(row["paced_steps"]), str(row["switches"])]
        numbers += [f"{row['cloud_fraction']:.2f}", f"{row['continuation_cloud_fraction']:.2f}"]
        numbers += [f"${row['cost_usd']:.4f}", f"${row['all_cloud_cost_usd']:.4f}"]
    assert rows["all"]["steps"] > 800
    assert_fits_with_whole_numbers(tables_of(result.stdout, "on cloud:"), numbers)
    assert "a-family-of-" in result.stdout  # the traces column keeps its width (it wraps the rest)


def test_calibrate_reads_at_80_columns_with_every_number_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dollar_prices: None
) -> None:
    traces = str(write_many_steps(tmp_path))
    args = ["calibrate", traces, "--target-cloud-fraction", "0.3", "--context", '{"max_steps": 30}']
    at_80_columns(monkeypatch)
    out = invoke_json(*args, "--json")
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    numbers = ["200", str(out["steps"]), str(out["plan_steps"]), str(out["continuation_steps"])]
    numbers += [str(out["context"]["cloud_share"]), f"{out['achieved']:.3f}", f"{out['cloud_fraction']:.3f}"]
    numbers += [f"{out['continuation_cloud_fraction']:.3f}", f"{out['cost_fraction']:.2f}"]
    assert out["steps"] > 800
    assert_fits_with_whole_numbers(tables_of(result.stdout, "note:"), numbers)


# --------------------------------------------------------------------------- the bundled sample


def test_replay_and_calibrate_run_on_the_bundled_sample_without_paths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(TRACES_ENV, raising=False)
    result = runner.invoke(app, ["replay", "--json"])
    assert result.exit_code == 0, result.output
    assert "bundled sample" in result.stderr and SAMPLE_NAME in result.stderr
    assert json.loads(result.stdout) == invoke_json("replay", str(SAMPLE_TRACES), "--json")
    shown = runner.invoke(app, ["replay"])
    assert "coding-agent" in shown.stdout and "travel-desk" in shown.stdout
    calibrated = runner.invoke(app, ["calibrate", "--target-cloud-fraction", "0.3", "--json"])
    assert calibrated.exit_code == 0, calibrated.output
    assert abs(json.loads(calibrated.stdout)["achieved"] - 0.3) <= 0.1


def test_without_paths_the_traces_come_from_the_variable_when_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_tiny_traces(tmp_path / "tiny.jsonl")
    monkeypatch.setenv(TRACES_ENV, str(tmp_path))
    result = runner.invoke(app, ["replay", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["steps"] == 7
    assert TRACES_ENV in result.stderr


def test_missing_traces_name_the_variable_and_the_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = runner.invoke(app, ["calibrate", str(tmp_path / "nowhere"), "--target-cloud-fraction", "0.3"])
    assert result.exit_code == 2
    message = " ".join(result.stderr.split())
    assert "trace path not found" in message and "nowhere" in message
    assert TRACES_ENV in message and SAMPLE_NAME in message
    monkeypatch.setenv(TRACES_ENV, str(tmp_path / "gone"))
    unset = runner.invoke(app, ["replay"])
    assert unset.exit_code == 2
    assert "gone" in unset.stderr and TRACES_ENV in " ".join(unset.stderr.split())


def test_the_help_names_the_default_traces() -> None:
    for command in ("replay", "calibrate"):
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0, result.output
        text = " ".join(result.stdout.replace("│", " ").split())
        assert TRACES_ENV in text and SAMPLE_NAME in text, text


def test_a_file_that_is_no_trace_is_named_as_given_with_the_format(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# not a trace\n")
    result = runner.invoke(app, ["replay", str(readme)])
    assert result.exit_code == 2
    said = " ".join(result.stderr.split())
    assert f"{readme}:1: not JSON" in said and "README:1" not in said
    assert "a trace file is JSONL" in said


def test_a_value_after_a_flag_is_named_as_one() -> None:
    result = runner.invoke(app, ["replay", "--json", "true"])
    assert result.exit_code == 2
    said = " ".join(result.stderr.split())
    assert "trace path not found: true (flags such as --json take no value)" in said
