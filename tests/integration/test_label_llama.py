"""``fusion-graph label`` end to end against a real llama-server (the tiny model), then calibrate on it.

The tiny model's weights are noise, so it rarely takes the recorded action: the
test checks that every step of the bundled sample gets exactly one well-formed
line, asked the way the graph asks (its slots, the tools bound), not what the
model answers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage

from fusion_graph.cli.app import app
from fusion_graph.replay.traces import SAMPLE_TRACES, load_trajectories
from fusion_graph_testing import LlamaServer, write_chat_template
from tests.plugins.llama import N_SLOTS
from tests.unit.cli.test_traces import runner

pytestmark = pytest.mark.llama

KEYS = {
    "trace",
    "line",
    "trajectory",
    "position",
    "turn",
    "step",
    "score",
    "points",
    "breakdown",
    "signals",
    "agrees",
    "recorded_action",
    "local_action",
    "error",
    "provider",
    "completion_tokens",
    "latency_s",
}


@pytest.fixture(scope="module")
def server(
    llama_server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """``--jinja`` with a template that renders tools, ``N_SLOTS`` slots of 4,096 tokens."""
    workdir = tmp_path_factory.mktemp("label-llama")
    template = write_chat_template(workdir)
    with LlamaServer(
        tiny_model,
        binary=llama_server_bin,
        n_slots=N_SLOTS,
        extra_args=["--chat-template-file", str(template)],
        log_path=workdir / "server.log",
    ) as running:
        yield running


def steps_of_the_sample() -> set[tuple[str, int, int]]:
    return {
        (t.file, t.line, position)
        for t in load_trajectories([SAMPLE_TRACES])
        for position, message in enumerate(t.messages)
        if isinstance(message, AIMessage)
    }


def test_label_writes_one_line_per_step_of_the_sample_and_calibrate_reads_them(
    server: LlamaServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FUSION_LOCAL_BASE_URL", server.openai_base_url)
    out = tmp_path / "labels.jsonl"
    args = ["label", str(SAMPLE_TRACES), "--out", str(out), "--tools", "inferred", "--max-tokens", "48"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    lines: list[dict[str, Any]] = [json.loads(line) for line in out.read_text().splitlines()]
    expected = steps_of_the_sample()
    assert {(line["trace"], line["line"], line["position"]) for line in lines} == expected
    assert len(lines) == len(expected) == summary["asked"] == summary["steps"]
    assert summary["concurrency"] == N_SLOTS - 1 and summary["local_window"] == 4096  # from /props
    for line in lines:
        assert set(line) == KEYS
        assert line["agrees"] in (True, False, None)
        assert line["recorded_action"] and (
            "reply" in line["recorded_action"] or "tools" in line["recorded_action"]
        )
        if line["agrees"] is None:
            assert line["error"] and line["local_action"] is None
        else:
            assert line["local_action"] is not None and line["provider"].startswith("local:")
            assert line["completion_tokens"] is not None and line["completion_tokens"] <= 48
    assert sum(line["agrees"] is not None for line in lines) >= len(lines) // 2  # most steps answered
    again = runner.invoke(app, [*args, "--json"])
    assert again.exit_code == 0 and json.loads(again.stdout)["asked"] == 0  # all written: nothing asked again
    if any(line["agrees"] is False and line["step"] > 0 for line in lines):
        calibrated = runner.invoke(
            app, ["calibrate", "--labels", str(out), "--target-cloud-fraction", "0.3", "--json"]
        )
        assert calibrated.exit_code == 0, calibrated.output
        found = json.loads(calibrated.stdout)
        assert found["chosen"]["share"] <= 0.3
        assert found["labelled"] + found["unlabelled"] == len(lines)
