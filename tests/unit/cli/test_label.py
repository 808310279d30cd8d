"""``fusion-graph label`` against a scripted local server, and ``calibrate --labels`` on what it writes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fusion_graph.cli import label as label_cli
from fusion_graph.cli.app import app
from fusion_graph.context import ensure_context
from fusion_graph.replay import labelling
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from fusion_graph_testing.llama_server import free_port
from tests.unit.cli.test_traces import runner
from tests.unit.replay.test_labels import error_failures

#: What llama-server's ``GET /props`` says: 3 slots (2 for conversations, 1 reserved), 8,192 tokens each.
PROPS = {"total_slots": 3, "default_generation_settings": {"n_ctx": 8192}}


def calls(step: int, trajectory: int) -> dict[str, Any]:
    return {
        "id": f"c{trajectory}-{step}",
        "type": "function",
        "function": {"name": "lookup", "arguments": json.dumps({"key": f"k{step}"})},
    }


def write_traces(path: Path, count: int = 4, steps: int = 3, system: str = "You look things up.") -> Path:
    """``count`` conversations: a task, ``steps`` lookups with their results, then a reply."""
    records = []
    for index in range(count):
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"task {index}"},
        ]
        for step in range(steps):
            messages.append({"role": "assistant", "content": "", "tool_calls": [calls(step, index)]})
            messages.append({"role": "tool", "tool_call_id": f"c{index}-{step}", "content": f"value {step}"})
        messages.append({"role": "assistant", "content": "done"})
        records.append({"id": f"t{index}", "messages": messages})
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def where(body: dict[str, Any]) -> tuple[str, int]:
    """The trajectory (its task) and the step a request asks: how many answers its history holds."""
    messages = body["messages"]
    task = next(m["content"] for m in messages if m["role"] == "user")
    return task.removeprefix("task "), sum(m["role"] == "assistant" for m in messages)


#: The steps the scripted local model gets right: (trajectory, step) as the traces number them.
CHOSEN = {("0", 0), ("0", 3), ("1", 1), ("2", 2), ("3", 0), ("3", 1)}


def scripted(body: dict[str, Any]) -> Reply:
    """The recorded action on the chosen steps; elsewhere another lookup, or a reply where one was due."""
    trajectory, step = where(body)
    right = (trajectory, step) in CHOSEN
    if step == 3:  # the recorded answer is the reply "done"
        return (
            Reply(content="all done") if right else Reply(content="", tool_calls=[("lookup", {"key": "?"})])
        )
    key = f"k{step}" if right else "wrong"
    return Reply(content="", tool_calls=[("lookup", {"key": key})])


@pytest.fixture
def local(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeOpenAI]:
    """A scripted llama-server stand-in as the operator's local endpoint."""
    with FakeOpenAI(scripted) as fake:
        fake.props = PROPS
        monkeypatch.setenv("FUSION_LOCAL_BASE_URL", fake.base_url)
        yield fake


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def label(*args: str) -> Any:
    return runner.invoke(app, ["label", *args], env={"COLUMNS": "80"})


def test_label_writes_exactly_the_steps_the_local_model_gets_right(local: FakeOpenAI, tmp_path: Path) -> None:
    traces, out = write_traces(tmp_path / "traces.jsonl"), tmp_path / "labels.jsonl"
    result = label(str(traces), "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    written = lines(out)
    assert len(written) == len(local.requests) == 16  # one line and one question per step
    agreeing = {
        (line["trajectory"].removeprefix("t"), line["position"] // 2 - 1)
        for line in written
        if line["agrees"]
    }
    assert agreeing == CHOSEN
    assert all(line["agrees"] is False for line in written if not line["agrees"])
    summary = json.loads(result.stdout)
    assert (summary["asked"], summary["agree"], summary["disagree"], summary["left"]) == (16, 6, 10, 0)
    assert summary["concurrency"] == 2 and summary["local_window"] == 8192  # from /props, one slot reserved
    first = next(line for line in written if (line["line"], line["position"]) == (1, 2))
    assert first["trajectory"] == "t0"
    assert first["recorded_action"] == first["local_action"] == {"tools": [["lookup", '{"key": "k0"}']]}
    assert first["turn"] == 0 and first["step"] == 0 and isinstance(first["score"], int)
    for body in local.requests:  # the graph's request: temperature 0, the budget, the thread's slot
        assert body["temperature"] == 0 and body["max_completion_tokens"] == label_cli.DEFAULT_MAX_TOKENS
        assert body["messages"][0] == {"role": "system", "content": "You look things up."}
        assert "tools" not in body  # the records carry no schemas
    slots: dict[str, set[int]] = {}
    for body in local.requests:
        slots.setdefault(where(body)[0], set()).add(body["id_slot"])
    assert all(len(used) == 1 for used in slots.values())  # each trajectory on one slot: its cache kept


def test_a_stopped_run_resumes_without_asking_the_written_steps_again(
    local: FakeOpenAI, tmp_path: Path
) -> None:
    traces, out = write_traces(tmp_path / "traces.jsonl"), tmp_path / "labels.jsonl"
    first = label(str(traces), "--out", str(out), "--limit", "5", "--json")
    assert first.exit_code == 0, first.output
    assert len(lines(out)) == len(local.requests) == 5
    assert json.loads(first.stdout)["left"] == 11
    asked = {where(body) for body in local.requests}
    rest = label(str(traces), "--out", str(out), "--json")
    assert rest.exit_code == 0, rest.output
    assert len(local.requests) == 16  # only the 11 not written were asked
    assert not asked & {where(body) for body in local.requests[5:]}
    assert json.loads(rest.stdout)["labelled_before"] == 5
    keys = [(line["line"], line["position"]) for line in lines(out)]
    assert len(keys) == len(set(keys)) == 16
    done = label(str(traces), "--out", str(out), "--json")
    assert json.loads(done.stdout)["asked"] == 0 and len(local.requests) == 16


def test_a_line_cut_short_by_a_kill_is_dropped_and_its_step_asked_again(
    local: FakeOpenAI, tmp_path: Path
) -> None:
    traces, out = write_traces(tmp_path / "traces.jsonl", count=1), tmp_path / "labels.jsonl"
    assert label(str(traces), "--out", str(out), "--limit", "2").exit_code == 0
    whole = out.read_text(encoding="utf-8")
    out.write_text(whole + whole.splitlines()[0][:40], encoding="utf-8")  # killed while writing a third
    result = label(str(traces), "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["asked"] == 2 and len(local.requests) == 4
    assert [line["position"] for line in lines(out)] == [2, 4, 6, 8]  # every line whole, none twice


def test_tools_inferred_from_the_calls_are_bound_to_each_question(local: FakeOpenAI, tmp_path: Path) -> None:
    traces, out = write_traces(tmp_path / "traces.jsonl", count=1), tmp_path / "labels.jsonl"
    result = label(str(traces), "--out", str(out), "--tools", "inferred")
    assert result.exit_code == 0, result.output
    [tool] = local.requests[0]["tools"]
    assert tool["function"]["name"] == "lookup"
    assert tool["function"]["parameters"]["properties"] == {"key": {"type": "string"}}
    assert label(str(traces), "--out", str(out), "--tools", "guessed").exit_code == 2


def test_an_unanswered_step_is_written_with_its_error_scrubbed(
    local: FakeOpenAI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "sk-proj-" + "Q7xLm2Vr9TzK4pWb8NcYd3HfJ6gAe5Us"
    refused = json.dumps({"error": {"message": f"template error near {secret}", "type": "invalid"}})

    def reply(body: dict[str, Any]) -> Reply:
        if where(body) == ("0", 1):
            return Reply(status=400, raw=refused.encode())
        return scripted(body)

    local.script(reply)
    traces, out = write_traces(tmp_path / "traces.jsonl", count=1), tmp_path / "labels.jsonl"
    result = label(str(traces), "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    written = {line["position"]: line for line in lines(out)}
    failed = written[4]
    assert failed["agrees"] is None and failed["local_action"] is None
    assert "bad_request" in failed["error"] and secret not in failed["error"]
    assert [written[p]["agrees"] for p in (2, 6, 8)] == [True, False, True]  # the rest labelled as usual
    assert json.loads(result.stdout)["no_answer"] == 1
    before = len(local.requests)
    again = label(str(traces), "--out", str(out), "--retry-errors", "--json")
    assert json.loads(again.stdout)["asked"] == 1 and len(local.requests) == before + 1


def test_a_step_that_does_not_fit_the_local_window_is_not_sent(local: FakeOpenAI, tmp_path: Path) -> None:
    local.props = {"total_slots": 2, "default_generation_settings": {"n_ctx": 600}}
    long_prompt = "You look things up, carefully and in order. " * 60  # about 500 tokens
    traces = write_traces(tmp_path / "traces.jsonl", count=1, system=long_prompt)
    out = tmp_path / "labels.jsonl"
    result = label(str(traces), "--out", str(out), "--max-tokens", "400")
    assert result.exit_code == 0, result.output
    written = lines(out)
    assert len(written) == 4 and local.requests == []  # prompt + 300 (half the window) > 600 on every step
    assert all(line["agrees"] is None and "> local window 600" in line["error"] for line in written)


def test_an_unreachable_local_server_stops_the_run_with_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    monkeypatch.setenv("FUSION_LOCAL_BASE_URL", url)
    traces, out = write_traces(tmp_path / "traces.jsonl", count=1), tmp_path / "labels.jsonl"
    result = label(str(traces), "--out", str(out))
    assert result.exit_code == 2
    assert "stopped answering after 0 step(s)" in result.stderr and url in result.stderr
    assert "run the same command again" in result.stderr
    assert not out.exists() or lines(out) == []


def wait_for(condition: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    """Wait until ``condition`` holds (a bound on a hang, not a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def test_ctrl_c_keeps_every_written_step_and_the_same_command_goes_on(
    local: FakeOpenAI, tmp_path: Path
) -> None:
    traces, out = write_traces(tmp_path / "traces.jsonl", count=2), tmp_path / "labels.jsonl"
    held = threading.Event()

    def hold_the_fourth(body: dict[str, Any]) -> Reply:
        reply = scripted(body)
        if len(local.requests) == 4:
            reply.hold = held
        return reply

    local.script(hold_the_fourth)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_")}
    env["FUSION_LOCAL_BASE_URL"] = local.base_url
    command = [
        sys.executable,
        "-m",
        "fusion_graph",
        "label",
        str(traces),
        "--out",
        str(out),
        "--concurrency",
        "1",
    ]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(local.requests) == 4, "the fourth question")
        wait_for(lambda: out.is_file() and len(lines(out)) == 3, "three written labels")
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        held.set()
        if process.poll() is None:
            process.kill()
    assert process.returncode == label_cli.INTERRUPTED, stderr
    assert "interrupted: 3 step(s) labelled this run" in stderr and "run the same command again" in stderr
    assert len(lines(out)) == 3
    local.script(scripted)
    rest = label(str(traces), "--out", str(out), "--json")
    assert rest.exit_code == 0, rest.output
    assert len(local.requests) == 4 + 5  # the 5 steps not written, the one cut off among them
    assert len(lines(out)) == 8


def test_the_cli_default_budget_is_the_labellings() -> None:
    assert label_cli.DEFAULT_MAX_TOKENS == labelling.DEFAULT_MAX_TOKENS


# --- calibrate --labels ------------------------------------------------------------------------------


def label_file(path: Path) -> Path:
    """Labels where the local model fails exactly on the steps after a tool error (a fifth of them)."""
    rows = [
        {
            "trace": label.trace,
            "line": label.line,
            "trajectory": label.trajectory,
            "position": label.position,
            "turn": label.turn,
            "step": label.step,
            "signals": dict(vars(label.signals)),
            "agrees": label.agrees,
        }
        for trajectory in error_failures()
        for label in trajectory
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_calibrate_on_labels_sends_the_failing_steps_to_cloud_within_the_share(tmp_path: Path) -> None:
    labels, saved, plot = (
        label_file(tmp_path / "labels.jsonl"),
        tmp_path / "ctx.json",
        tmp_path / "recall.png",
    )
    args = ["calibrate", "--labels", str(labels), "--target-cloud-fraction", "0.2", "--trouble-signals"]
    result = runner.invoke(app, [*args, "--json", "--save", str(saved), "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    chosen = found["chosen"]
    assert chosen["recall"] == 1.0 and chosen["share"] <= 0.2 and found["disagreeing"] == 16
    assert chosen["trouble_signals"] and chosen["trouble_weights"]["error_severity"] >= 50
    comparison = found["comparison"]
    assert set(comparison) == {"chosen", "seed", "paced", "random"}
    assert comparison["seed"]["recall"] < 0.5  # the four terms do not see the errors
    assert comparison["random"]["recall"] == comparison["random"]["share"] == chosen["share"]
    assert comparison["paced"]["pace_slack"] == 0.5
    assert len(found["candidates"]) == 20
    context = ensure_context(json.loads(saved.read_text()))
    assert context.trouble_weights == chosen["trouble_weights"]
    assert context.cloud_share == chosen["cloud_share"]
    assert context.score_quantiles is not None and context.pace_slack == 0.5
    assert plot.read_bytes().startswith(b"\x89PNG")
    table = runner.invoke(app, args, env={"COLUMNS": "80"})
    assert table.exit_code == 0, table.output
    rows = table.stdout.split("run context")[0]
    assert all(len(line) <= 80 for line in rows.splitlines())
    for row in (
        "chosen: calibrated table, trouble",
        "seed score, design rule",
        "chosen, paced 0.5",
        "random",
    ):
        assert row in rows
    assert "16/16" in rows  # every failing step caught


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--of", "all"], "continuation steps"),
        (["--turn-budget", "1"], "labels are not priced"),
        (["TRACES"], "either TRACES or --labels"),
    ],
)
def test_calibrate_on_labels_refuses_what_labels_cannot_answer(
    extra: list[str], says: str, tmp_path: Path
) -> None:
    labels = label_file(tmp_path / "labels.jsonl")
    extra = [str(tmp_path) if item == "TRACES" else item for item in extra]
    result = runner.invoke(
        app, ["calibrate", *extra, "--labels", str(labels), "--target-cloud-fraction", "0.2"]
    )
    assert result.exit_code == 2 and says in result.stderr


def test_calibrate_on_a_missing_labels_file_says_how_to_write_one(tmp_path: Path) -> None:
    missing = tmp_path / "none.jsonl"
    result = runner.invoke(app, ["calibrate", "--labels", str(missing), "--target-cloud-fraction", "0.2"])
    assert result.exit_code == 2 and "fusion-graph label" in result.stderr


async def test_calibrate_on_a_thread_stores_shadow_checks(tmp_path: Path) -> None:
    from langchain_openai import ChatOpenAI
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    from fusion_graph import FusionContext, FusionSettings, build_graph
    from fusion_graph.providers.llama_server import ChatLlamaServer
    from tests.plugins.fakes import user_input
    from tests.plugins.served import lookup
    from tests.unit.test_shadow import tool_results

    def cloud_reply(body: dict[str, Any]) -> Reply:
        if tool_results(body) == 0:
            return Reply(content="", tool_calls=[("lookup", {"key": "a"})])
        return Reply(content="", tool_calls=[("lookup", {"key": "z"})])  # never what the local leg does

    db = tmp_path / "threads.sqlite"
    shadowed = FusionContext(cloud_share=10, shadow_share=1.0, sub_runners="off")
    with FakeOpenAI(cloud_reply) as cloud, FakeOpenAI([Reply(content="local answer")]) as local:
        async with AsyncSqliteSaver.from_conn_string(str(db)) as saver:
            graph = build_graph(
                cloud_model=ChatOpenAI(model="c", base_url=cloud.base_url, api_key="x", max_retries=0),
                local_model=ChatLlamaServer(model="l", base_url=local.base_url, api_key="x", max_retries=0),
                tools=[lookup],
                checkpointer=saver,
                settings=FusionSettings(local_slots=2),
            )
            config: Any = {"configurable": {"thread_id": "t"}}
            for text in ("look it up", "and again", "bye"):
                await graph.ainvoke(user_input(text), config, context=shadowed)
    report = json.loads(runner.invoke(app, ["report", "--db", str(db), "--json"]).stdout)["shadow"]
    args = ["calibrate", "--labels-from-db", str(db), "--target-cloud-fraction", "0.5", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    assert found["labelled"] == report["checked"] >= 2  # one label per shadow check that answered
    assert found["disagreeing"] == report["checked"] - report["agree"]
    assert found["chosen"]["share"] <= 0.5 and found["labels"] == f"shadow checks in {db}"
    missing = runner.invoke(app, ["calibrate", "--labels-from-db", str(tmp_path / "no.sqlite"), *args[3:5]])
    assert missing.exit_code == 2 and "no checkpoint database" in missing.stderr


def test_the_rate_counts_this_runs_steps_over_its_whole_time() -> None:
    from rich.progress import Progress

    from fusion_graph.cli.label import RateColumn

    now = [0.0]
    display = Progress(get_time=lambda: now[0])
    task_id = display.add_task("labelling", total=100, completed=40, resumed=40)
    task = display.tasks[0]
    assert str(RateColumn().render(task)) == "-"  # nothing labelled yet
    now[0] = 42.0
    display.update(task_id, advance=1)
    now[0] = 44.0
    display.update(task_id, advance=1)
    display.update(task_id, advance=1)  # two answers a moment apart after a long one
    assert str(RateColumn().render(task)) == "15 s/step"  # 3 steps in 44 s, not rich's burst speed
    now[0] = 50.0
    display.update(task_id, advance=7)
    assert str(RateColumn().render(task)) == "0.20 steps/s"
