"""A real OTLP receiver (Arize Phoenix) gets a turn's spans: one tree, GenAI attributes equal to the records.

The turn runs in a child process configured as a deployment is (``FUSION_TRACES``
and the standard ``OTEL_*`` variables), so the exporter set-up is the one users
get; a key planted in a provider's error never reaches a span.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from fusion_graph_testing.phoenix import Phoenix, PhoenixNotInstalled, ensure_phoenix
from tests.plugins.requires import service_missing
from tests.plugins.served import lookup_then_done

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-planted-cloud-key-0123456789abcdef"
PROJECT = "fusion-traces-test"


@pytest.fixture
def phoenix(tmp_path: Path) -> Iterator[Phoenix]:
    try:
        binary = ensure_phoenix(ROOT)
    except PhoenixNotInstalled as exc:
        service_missing(str(exc), fix="bash scripts/setup.sh")
    with Phoenix(tmp_path / "phoenix", binary=binary).start() as server:
        yield server


def spans_of(phoenix: Phoenix, want: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The project's spans once ``want`` have arrived (the exporter batches), else those there are."""
    deadline = time.monotonic() + timeout_s
    spans = phoenix.spans(PROJECT)
    while len(spans) < want and time.monotonic() < deadline:
        time.sleep(0.5)
        spans = phoenix.spans(PROJECT)
    return spans


def test_a_turn_s_spans_reach_phoenix_as_one_tree_with_the_records_attributes(
    phoenix: Phoenix, tmp_path: Path
) -> None:
    refused = Reply(status=500, content=f"upstream broke, key {KEY}")
    out = tmp_path / "route_log.json"
    with (
        FakeOpenAI([refused]) as cloud,
        FakeOpenAI(lookup_then_done()) as local,
    ):
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "FUSION_"))},
            "OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.url,
            "OTEL_SERVICE_NAME": "fusion-graph-test",
            "OTEL_RESOURCE_ATTRIBUTES": f"openinference.project.name={PROJECT}",
        }
        done = subprocess.run(
            [sys.executable, "-m", "tests.integration.traced_turn_child", cloud.base_url, local.base_url,
             str(out), KEY],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    log = json.loads(out.read_text(encoding="utf-8"))
    spans = spans_of(phoenix, want=1 + len(log) + 1)  # the turn, its inferences, its one tool call
    roots = [s for s in spans if s["attributes"].get("gen_ai.operation.name") == "invoke_agent"]
    chats = [s for s in spans if s["attributes"].get("gen_ai.operation.name") == "chat"]
    calls = [s for s in spans if s["attributes"].get("gen_ai.operation.name") == "execute_tool"]
    assert len(roots) == 1 and roots[0]["parent_id"] is None
    root_id = roots[0]["context"]["span_id"]
    assert {s["parent_id"] for s in chats + calls} == {root_id}
    assert [c["attributes"]["gen_ai.tool.name"] for c in calls] == ["lookup"]
    assert len(chats) == len(log)
    for span, record in zip(sorted(chats, key=lambda s: s["start_time"]), log, strict=True):
        a = span["attributes"]
        assert (a["fusion.leg"], a["fusion.routed_leg"], a["fusion.kind"]) == (
            record["leg"], record["routed_leg"], record["kind"]
        )  # fmt: skip
        assert a["gen_ai.usage.input_tokens"] == record["prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == record["completion_tokens"]
        assert a.get("gen_ai.usage.cache_read.input_tokens") == record["cached_tokens"]
        assert a["gen_ai.conversation.id"] == "traced"
        assert a["fusion.failed_attempts"] == len(record["attempts"])
    assert KEY not in json.dumps(spans)
