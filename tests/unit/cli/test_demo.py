"""``fusion-graph demo``: a recorded conversation played live through the real graph, no key, no server."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, ToolMessage

from fusion_graph.cli.app import app
from fusion_graph.cli.demo import DEMO_CONVERSATION
from fusion_graph.replay.playback import END_OF_RECORDING, RecordedScript, recorded_tools
from fusion_graph.replay.traces import SAMPLE_TRACES, RecordedTrajectory, load_trajectories
from fusion_graph_testing import LlamaServer
from tests.unit.cli.test_traces import runner, write_tiny_traces

NARROW = {"COLUMNS": "80"}


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(autouse=True)
def fresh_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """What a newcomer has: no cloud key, no FUSION_* setting, no .env, no llama-server at the default URL."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    for name in list(os.environ):
        if name.startswith("FUSION_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    # Were anything to ask the configured llama-server, it would find nobody there.
    monkeypatch.setenv("FUSION_LOCAL_BASE_URL", f"http://127.0.0.1:{closed_port()}/v1")


def sample(conversation: str = DEMO_CONVERSATION) -> RecordedTrajectory:
    return next(t for t in load_trajectories([SAMPLE_TRACES]) if t.id == conversation)


def demo_json(*args: str) -> dict[str, Any]:
    result = runner.invoke(app, ["demo", *args, "--json"], env=NARROW)
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def test_demo_routes_the_sample_to_both_legs_and_prints_the_table_at_80_columns() -> None:
    result = runner.invoke(app, ["demo"], env=NARROW)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, result.stdout
    rows = [line.split() for line in lines if line.split()[:1] and line.split()[0].isdigit()]
    assert {row[2] for row in rows if row[1] == "step"} == {"cloud", "local"}, result.stdout
    assert any(line.startswith("  terms: pressure") for line in lines), "each step's score terms are shown"
    assert "answered, per provider" in result.stdout and "routed to cloud:" in result.stdout
    recorded = [m for m in sample().messages if isinstance(m, AIMessage)]
    assert recorded[-1].text in result.stdout, "the recorded final answer closes the turn"


def test_demo_json_has_every_recorded_step_routed_and_priced_by_the_graph() -> None:
    data = demo_json()
    records = data["route_log"]
    recorded = [m for m in sample().messages if isinstance(m, AIMessage)]
    assert data["conversation"] == DEMO_CONVERSATION
    assert [(r["step"], r["kind"]) for r in records] == [
        (i, "plan" if i == 0 else "step") for i in range(len(recorded))
    ]
    continuation = [r for r in records if r["kind"] == "step"]
    assert {r["routed_leg"] for r in continuation} == {"cloud", "local"}
    # Nothing fell over: each step was answered on the leg the router chose, and the score decided it.
    assert all(r["leg"] == r["routed_leg"] and r["provider"] for r in records)
    assert all((r["score"] >= r["threshold"]) == (r["routed_leg"] == "cloud") for r in continuation)
    assert data["answer"] == recorded[-1].text
    totals = data["totals"]
    assert totals["cloud"]["inferences"] + totals["local"]["inferences"] == len(recorded)
    assert totals["cloud"]["cost_usd"] > 0, "the cloud steps are priced at the cloud model's price"
    assert all(r["prompt_tokens"] > 0 and r["completion_tokens"] > 0 for r in records)
    share = data["cloud_share"]
    assert 0 < share["cloud_continuation_steps"] < share["continuation_steps"]


def test_demo_cloud_share_zero_keeps_every_step_local() -> None:
    data = demo_json("--cloud-share", "0")
    assert {r["routed_leg"] for r in data["route_log"]} == {"local"}


def test_demo_plays_a_picked_conversation_of_a_trace_file_turn_by_turn(tmp_path: Path) -> None:
    traces = write_tiny_traces(tmp_path / "mine.jsonl")
    by_id = demo_json("--trace", str(traces), "--conversation", "c")
    assert [(r["turn"], r["step"]) for r in by_id["route_log"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert by_id["answer"] == "second done"
    by_index = demo_json("--trace", str(traces), "--conversation", "2")
    assert by_index["conversation"] == "c"
    first = demo_json("--trace", str(traces))
    assert first["conversation"] == "a" and first["answer"] == "done"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--trace", "no/such/traces.jsonl"], "trace path not found: no/such/traces.jsonl"),
        (["--trace", "notes.jsonl"], "notes.jsonl:1: not JSON"),
        (["--conversation", "nobody"], "--conversation 'nobody' is neither an id nor an index"),
        (["--context", '{"cloud_share": 101}'], "cloud_share"),
    ],
)
def test_demo_bad_input_is_one_line_and_exit_2(args: list[str], said: str) -> None:
    Path("notes.jsonl").write_text("not a trace\n", encoding="utf-8")  # in the test's own directory
    result = runner.invoke(app, ["demo", *args])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert said in result.stderr


def test_demo_local_url_with_no_server_there_fails_before_playing() -> None:
    url = f"http://127.0.0.1:{closed_port()}/v1"
    result = runner.invoke(app, ["demo", "--local-url", url])
    assert result.exit_code == 2, result.output
    assert f"llama-server is not reachable at --local-url {url}" in result.stderr
    assert result.stdout == ""


async def test_recorded_tools_answer_each_call_id_with_its_recorded_output() -> None:
    trajectory = sample()
    script = RecordedScript.of(trajectory)
    tools = {tool.name: tool for tool in recorded_tools(script)}
    assert sorted(tools) == ["edit_file", "read_file", "run_tests", "search"]
    recorded = [m for m in trajectory.messages if isinstance(m, ToolMessage)]
    calls = [c for m in trajectory.messages if isinstance(m, AIMessage) for c in m.tool_calls]
    for call, output in reversed(list(zip(calls, recorded, strict=True))):  # any order: by call id
        answer = await tools[call["name"]].ainvoke({**call, "type": "tool_call"})
        assert isinstance(answer, ToolMessage)
        assert (answer.tool_call_id, answer.content) == (output.tool_call_id, output.content)


def test_the_script_hands_out_a_turns_answers_then_closes_it() -> None:
    script = RecordedScript.of(sample("desk-1"))
    assert len(script.turns) == 2
    script.start(script.turns[0])
    first = [script.next_answer() for _ in script.turns[0].answers]
    assert first == script.turns[0].answers
    assert script.next_answer().text == END_OF_RECORDING, "a step past the recording ends the turn"


@pytest.mark.llama
def test_demo_local_url_prefills_local_steps_on_a_real_llama_server(llama_server: LlamaServer) -> None:
    data = demo_json("--local-url", llama_server.openai_base_url)
    local = [r for r in data["route_log"] if r["leg"] == "local"]
    assert len(local) >= 2 and all(r["kind"] == "step" for r in local)
    # The server's own counts: what it processed, and what its prefix cache already held.
    assert all(r["processed_tokens"] is not None and r["prompt_tokens"] > 0 for r in local)
    first, later = local[0], local[1:]
    assert any(r["cached_tokens"] > 0 for r in later), local
    assert all(r["slot"] == first["slot"] is not None for r in later), "one slot holds the conversation"
    recorded = [m for m in sample().messages if isinstance(m, AIMessage)]
    assert data["answer"] == recorded[-1].text, "the recording answers, not the tiny model"
