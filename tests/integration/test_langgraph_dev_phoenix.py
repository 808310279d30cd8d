"""A real OTLP receiver (Arize Phoenix) sees one nested trace per run of a real ``langgraph dev``.

``langgraph dev`` runs with traces on and the standard ``OTEL_*`` variables pointing at
Phoenix, as an operator deploys it; two runs go through the official SDK, one with
``runs.wait`` and one with ``runs.stream(stream_mode="messages")``, each with a tool call. The
server pulls a run's chunks from asyncio tasks of its own, so what Phoenix holds is the proof
that the spans of a run still hang together: one trace a run, one root (its ``invoke_agent``
span) that every other span of the run descends from, and the two runs two traces. Both runs
are on one thread, so a span that found the thread's previous run would show here.

The server and both runs are started once for the module; each test reads what Phoenix got.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from langgraph_sdk import get_client

from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from fusion_graph_testing.phoenix import Phoenix, PhoenixNotInstalled, ensure_phoenix
from tests.integration.test_langgraph_dev import CLI, dev_settings, serve
from tests.plugins.requires import service_missing

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "fusion-langgraph-dev-traces"
QUESTION = {"messages": [{"role": "user", "content": "what is in the workspace?"}]}
CONTEXT = {"cloud_share": 30, "sub_runners": "off"}


@dataclass
class Runs:
    """What the two runs left: the thread, each run's id and route log, and the spans Phoenix holds."""

    thread_id: str
    waited: list[dict[str, Any]]  # the runs.wait run's route log
    streamed: list[dict[str, Any]]  # the runs.stream run's route log
    streamed_run_id: str
    run_ids: set[str]
    tool_calls: int
    spans: list[dict[str, Any]]


def list_then_answer(body: dict[str, Any]) -> Reply:
    """A model that lists the workspace when the user asked and answers once the tool has: a tool
    call in every turn, whichever leg a step is routed to."""
    if body["messages"][-1]["role"] == "user":
        return Reply(content="Plan: list the workspace", tool_calls=[("list_dir", {"path": "."})])
    return Reply(content="the workspace holds notes.txt")


def operation(span: dict[str, Any]) -> str | None:
    name = span["attributes"].get("gen_ai.operation.name")
    return name if isinstance(name, str) else None


def spans_of(phoenix: Phoenix, chats: int, tools: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """The project's spans once both runs, ``chats`` chat spans and ``tools`` tool spans arrived."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = phoenix.spans(PROJECT)
        seen = Counter(operation(s) for s in spans)
        if (seen["invoke_agent"], seen["chat"], seen["execute_tool"]) >= (2, chats, tools):
            time.sleep(1.0)  # anything more the exporter still had (a stray span must show too)
            return phoenix.spans(PROJECT)
        if time.monotonic() > deadline:
            return spans
        time.sleep(0.5)


async def two_runs(url: str) -> tuple[str, list[Any], list[Any], str, set[str], int]:
    """A ``runs.wait`` run, then a ``runs.stream`` (messages) run, on one new thread."""
    client: Any = get_client(url=url)
    [assistant] = await client.assistants.search(graph_id="fusion")
    thread_id = (await client.threads.create())["thread_id"]
    waited = await client.runs.wait(
        thread_id, assistant["assistant_id"], input=QUESTION, context=CONTEXT, raise_error=False
    )
    assert isinstance(waited, dict) and "__error__" not in waited, waited
    parts = [
        part
        async for part in client.runs.stream(
            thread_id, assistant["assistant_id"], input=QUESTION, context=CONTEXT, stream_mode="messages"
        )
    ]
    assert not [p for p in parts if p.event == "error"], parts
    [streamed_run_id] = [p.data["run_id"] for p in parts if p.event == "metadata"]
    state = (await client.threads.get_state(thread_id))["values"]
    first = waited["route_log"]
    second = state["route_log"][len(first) :]
    assert state["route_log"][: len(first)] == first and first and second, state["route_log"]
    tools = [m["content"] for m in state["messages"] if m["type"] == "tool"]
    assert tools == ["notes.txt", "notes.txt"], state["messages"]  # one tool call a run
    run_ids = {run["run_id"] for run in await client.runs.list(thread_id)}
    assert len(run_ids) == 2 and streamed_run_id in run_ids, (run_ids, streamed_run_id)
    return thread_id, first, second, streamed_run_id, run_ids, len(tools)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """Phoenix, ``langgraph dev`` exporting to it, and two runs through the SDK (skip/fail when missing)."""
    if not CLI.exists() or importlib.util.find_spec("langgraph_api") is None:
        service_missing(f"langgraph dev is not installed ({CLI})", fix="pip install -e '.[studio]'")
    try:
        binary = ensure_phoenix(ROOT)
    except PhoenixNotInstalled as exc:
        service_missing(str(exc), fix="bash scripts/setup.sh")
    tmp_path = tmp_path_factory.mktemp("langgraph-dev-phoenix")
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "notes.txt").write_text("hello\n", encoding="utf-8")
    with (
        pytest.MonkeyPatch.context() as patch,
        Phoenix(tmp_path / "phoenix", binary=binary).start() as phoenix,
        FakeOpenAI(list_then_answer) as cloud,
        FakeOpenAI(list_then_answer) as local,
    ):
        for name in [n for n in os.environ if n.startswith("OTEL_")]:  # the runner's own never reach it
            patch.delenv(name)
        settings = {
            **dev_settings(cloud, local, workspace, "sk-operator-key-for-the-real-cloud"),
            "FUSION_TRACES": "true",
            "OTEL_EXPORTER_OTLP_ENDPOINT": phoenix.url,
            "OTEL_SERVICE_NAME": "fusion-graph-langgraph-dev",
            "OTEL_RESOURCE_ATTRIBUTES": f"openinference.project.name={PROJECT}",
            "OTEL_BSP_SCHEDULE_DELAY": "500",  # the batch goes out in 0.5 s, not 5 s
        }
        with serve(tmp_path, settings) as url:
            thread_id, first, second, streamed_run_id, run_ids, tools = asyncio.run(two_runs(url))
            spans = spans_of(phoenix, chats=len(first) + len(second), tools=tools)
        yield Runs(thread_id, first, second, streamed_run_id, run_ids, tools, spans)


def test_phoenix_sees_one_nested_trace_per_langgraph_dev_run(runs: Runs) -> None:
    spans = runs.spans
    # Nothing but the two runs' spans, all of the thread: its UUID as sent, not [REDACTED].
    chats = len(runs.waited) + len(runs.streamed)
    assert Counter(operation(s) for s in spans) == {
        "invoke_agent": 2,
        "chat": chats,
        "execute_tool": runs.tool_calls,
    }, spans
    assert {s["attributes"].get("gen_ai.conversation.id") for s in spans} == {runs.thread_id}, spans

    # One root a run, its invoke_agent span; the two runs are two traces, every span in one of them.
    roots = sorted(
        (s for s in spans if s["parent_id"] is None), key=lambda s: datetime.fromisoformat(s["start_time"])
    )
    assert [operation(r) for r in roots] == ["invoke_agent", "invoke_agent"], roots
    by_trace: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_trace.setdefault(span["context"]["trace_id"], []).append(span)
    assert len(by_trace) == 2 and set(by_trace) == {r["context"]["trace_id"] for r in roots}, by_trace

    # Every other span of a run descends from the run's root, through spans of its trace.
    ids = {s["context"]["span_id"]: s for s in spans}
    for root, log in zip(roots, (runs.waited, runs.streamed), strict=True):  # runs.wait ran first
        trace_spans = by_trace[root["context"]["trace_id"]]
        for span in trace_spans:
            node, hops = span, 0
            while node["parent_id"] is not None:
                assert node["parent_id"] in ids, f"{span['name']}: its parent {node['parent_id']} never came"
                node, hops = ids[node["parent_id"]], hops + 1
                assert node["context"]["trace_id"] == root["context"]["trace_id"] and hops < len(spans)
            assert node is root, f"{span['name']} hangs under {node['name']}, not under its run's root"
        # Several spans a run: its inferences and its tool call, each run's own.
        kinds = Counter(operation(s) for s in trace_spans)
        assert kinds == {"invoke_agent": 1, "chat": len(log), "execute_tool": 1}, (kinds, log)


def test_each_run_span_names_its_run(runs: Runs) -> None:
    """langgraph-api passes a run's id as ``config["run_id"]``, not in its metadata: the span names it."""
    roots = [s for s in runs.spans if operation(s) == "invoke_agent"]
    assert {r["attributes"].get("fusion.run_id") for r in roots} == runs.run_ids, roots
