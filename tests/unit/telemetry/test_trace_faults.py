"""Traces under bad input and faults: error text, a dead collector, server tasks, UUID ids, console."""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.runnables import RunnableConfig
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from fusion_graph import FusionContext
from fusion_graph.errors import ProviderRequestError
from fusion_graph.redact import register_secret
from fusion_graph.telemetry import switch
from fusion_graph.telemetry.traces import SHUTDOWN_TIMEOUT_S, Traces, _clean, shutdown_within
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from fusion_graph_testing.llama_server import free_port
from tests.plugins.fakes import user_input
from tests.plugins.served import lookup_then_done, turn_state
from tests.unit.telemetry.test_metrics import SECRET, graph_with

#: Text of the user's prompt that a provider's error body echoes back.
FRAGMENT = "violet-harbour-ledger-7731"
#: The repository root: the subprocesses import the package from here.
ROOT = Path(__file__).resolve().parents[3]


def traced(error_detail: bool = False) -> tuple[InMemorySpanExporter, Traces]:
    """A ``Traces`` over an in-memory exporter of the test's own (``error_detail`` as the setting)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, Traces(provider.get_tracer("test"), error_detail=error_detail)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Traces on (error text off, the default), into an in-memory exporter; off again after it."""
    exporter, switch.ACTIVE.traces = traced()
    yield exporter
    switch.reset()


def seen(span: ReadableSpan) -> str:
    """Everything of ``span`` a trace backend shows: name, attributes, events, status, as text."""
    events = [(e.name, dict(e.attributes or {})) for e in span.events]
    status = (span.status.status_code.name, span.status.description)
    return json.dumps([span.name, dict(span.attributes or {}), events, status], default=str)


def of(finished: tuple[ReadableSpan, ...], operation: str) -> list[ReadableSpan]:
    """The spans of one ``gen_ai.operation.name``."""
    return [s for s in finished if (s.attributes or {}).get("gen_ai.operation.name") == operation]


def echoing_400() -> Reply:
    """A 400 whose error body echoes the prompt (and the key), as some gateways' validation errors do."""
    body = {"error": {"message": f"bad request near '{FRAGMENT}' (key {SECRET})", "type": "invalid_request"}}
    return Reply(status=400, raw=json.dumps(body).encode())


async def refused_turn(how: str) -> None:
    """One turn whose cloud plan is refused with ``echoing_400``: the run raises ``ProviderRequestError``."""
    with FakeOpenAI([echoing_400()]) as cloud, FakeOpenAI([Reply(content="unused")]) as local:
        graph = graph_with(cloud, local)
        with pytest.raises(ProviderRequestError) as raised:
            await turn_state(graph, f"please plan {FRAGMENT}", how, FusionContext(cloud_share=30))
    assert FRAGMENT in str(raised.value)  # the error itself carries the echo: the spans must not


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_a_provider_error_echoing_the_prompt_leaves_no_fragment_on_any_span(
    spans: InMemorySpanExporter, how: str
) -> None:
    await refused_turn(how)
    finished = spans.get_finished_spans()
    [run] = of(finished, "invoke_agent")
    assert run.status.status_code is StatusCode.ERROR
    assert run.status.description == "ProviderRequestError (bad_request)"  # class and kind, no text
    assert (
        run.attributes is not None
        and run.attributes["error.type"] == "fusion_graph.errors.ProviderRequestError"
    )
    [event] = [e for e in run.events if e.name == "exception"]
    attributes = dict(event.attributes or {})
    assert attributes["exception.type"] == "fusion_graph.errors.ProviderRequestError"
    assert attributes["fusion.error.kind"] == "bad_request" and "exception.message" not in attributes
    assert attributes["fusion.error.provider_type"]  # the provider's exception class, a name
    assert "exception.stacktrace" not in attributes  # a traceback's last line is the message
    assert finished and not [s.name for s in finished if FRAGMENT in seen(s) or SECRET in seen(s)]


async def test_error_detail_puts_the_scrubbed_text_on_the_run_span() -> None:
    exporter, switch.ACTIVE.traces = traced(error_detail=True)
    try:
        await refused_turn("ainvoke")
    finally:
        switch.reset()
    [run] = of(exporter.get_finished_spans(), "invoke_agent")
    [event] = [e for e in run.events if e.name == "exception"]
    message = str((event.attributes or {})["exception.message"])
    assert FRAGMENT in message and FRAGMENT in (run.status.description or "")
    assert SECRET not in seen(run) and "[REDACTED]" in message  # opted-in text is still scrubbed


def _blank(coroutine: Any) -> asyncio.Task[Any]:
    """``coroutine`` in a task of its own with an empty context, as a server pulls each chunk of a run."""
    return asyncio.get_running_loop().create_task(coroutine, context=contextvars.Context())


async def pulled_like_a_server(stream: AsyncIterator[Any]) -> None:
    """Drain ``stream`` one ``anext`` per fresh task (``langgraph_api``'s ``wait_if_not_done`` does so)."""
    end = object()
    while await _blank(anext(stream, end)) is not end:
        pass


@pytest.mark.parametrize("mode", ["messages", "updates"])
async def test_spans_of_a_server_run_share_one_trace_under_the_run_span(
    spans: InMemorySpanExporter, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    thread, run_id = str(uuid.uuid4()), str(uuid.uuid4())
    config: RunnableConfig = {
        "configurable": {"thread_id": thread},
        "metadata": {"run_id": run_id, "assistant_id": str(uuid.uuid4()), "thread_id": thread},
        "run_id": uuid.UUID(run_id),
    }
    with (
        caplog.at_level(logging.ERROR, logger="opentelemetry.context"),
        FakeOpenAI([Reply(content="plan", tool_calls=[("lookup", {"key": "k0"})])]) as cloud,
        FakeOpenAI(lookup_then_done()) as local,
    ):
        graph = graph_with(cloud, local)
        stream = graph.astream(
            user_input("look up three keys"), config, context=FusionContext(cloud_share=30), stream_mode=mode
        )
        await pulled_like_a_server(stream)
    finished = spans.get_finished_spans()
    [run] = of(finished, "invoke_agent")
    assert run.context is not None and run.parent is None
    others = [s for s in finished if s is not run]
    assert len(of(finished, "chat")) >= 3 and of(finished, "execute_tool")
    assert {s.context.trace_id for s in finished if s.context is not None} == {run.context.trace_id}
    by_id = {s.context.span_id: s for s in finished if s.context is not None}
    for span in others:
        chain, parent = [], span.parent
        while parent is not None:
            chain.append(parent.span_id)
            parent = by_id[parent.span_id].parent
        assert run.context.span_id in chain, span.name
    assert "Failed to detach context" not in caplog.text
    assert run.attributes is not None and run.attributes["fusion.run_id"] == run_id  # a UUID, kept


async def test_a_span_made_where_the_run_context_never_reached_still_nests_under_the_run() -> None:
    exporter, traces = traced()

    async def tool_in_a_blank_task() -> None:
        with traces.tool("lookup", "call-1", "t"):  # a node LangGraph ran without the run's context
            pass

    async def run_steps() -> AsyncIterator[int]:
        await _blank(tool_in_a_blank_task())
        yield 1

    async for _ in traces.run(run_steps(), "fusion", "t", {}):
        pass
    [run] = of(exporter.get_finished_spans(), "invoke_agent")
    [tool] = of(exporter.get_finished_spans(), "execute_tool")
    assert run.context is not None and tool.parent is not None
    assert tool.parent.span_id == run.context.span_id


async def test_a_uuid_thread_id_is_the_conversation_id_on_every_span(spans: InMemorySpanExporter) -> None:
    thread = str(uuid.uuid4())
    config: RunnableConfig = {"configurable": {"thread_id": thread}}
    plan = Reply(content="plan", tool_calls=[("lookup", {"key": "k0"})])
    with FakeOpenAI([plan]) as cloud, FakeOpenAI(lookup_then_done()) as local:
        await turn_state(
            graph_with(cloud, local), "look up a key", "ainvoke", FusionContext(cloud_share=30), config
        )
    finished = spans.get_finished_spans()
    assert of(finished, "execute_tool") and len(of(finished, "chat")) >= 2
    assert {(s.attributes or {}).get("gen_ai.conversation.id") for s in finished} == {thread}


def test_a_registered_secret_is_still_removed_from_a_thread_id() -> None:
    register_secret(SECRET)
    cleaned = _clean({"gen_ai.conversation.id": f"thread-{SECRET}", "fusion.run_id": str(uuid.UUID(int=7))})
    assert cleaned["gen_ai.conversation.id"] == "thread-[REDACTED]"
    assert cleaned["fusion.run_id"] == str(uuid.UUID(int=7))


class _Stuck(SpanProcessor):
    """A span processor whose shutdown never returns by itself (an exporter stuck on a silent socket)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def on_end(self, span: ReadableSpan) -> None:
        return

    def on_start(self, span: Span, parent_context: Any = None) -> None:
        return

    def shutdown(self) -> None:
        self.release.wait(300)


def test_shutdown_gives_up_after_its_bound() -> None:
    provider = TracerProvider(shutdown_on_exit=False)
    stuck = _Stuck()
    provider.add_span_processor(stuck)
    try:
        assert shutdown_within(provider, 0.2) is False  # returned while the processor still hangs
    finally:
        stuck.release.set()
    assert SHUTDOWN_TIMEOUT_S <= 2.0


#: A process with traces on, one span, then exit; an exit hook registered first (so it runs last)
#: prints how long the exit took after the script's last line (imports and start-up not counted).
EXITING = textwrap.dedent(
    """
    import atexit, time
    ended = []
    atexit.register(lambda: print(f"exit_s={time.monotonic() - ended[0]:.2f}", flush=True))
    from fusion_graph import FusionSettings
    from fusion_graph.telemetry import switch
    switch.configure(FusionSettings())
    assert switch.ACTIVE.traces is not None
    switch.ACTIVE.traces.tracer.start_span("probe").end()
    ended.append(time.monotonic())
    """
)


def run_traced(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``EXITING`` in a fresh interpreter with traces on and ``env`` (no operator setting inherited)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("FUSION_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "-c", EXITING],
        cwd=tmp_path,
        env=clean | {"PYTHONPATH": str(ROOT), "FUSION_TRACES": "true", **env},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


@pytest.mark.parametrize("collector", ["refused", "silent"])
def test_a_dead_collector_delays_the_exit_by_at_most_the_bound(tmp_path: Path, collector: str) -> None:
    with socket.socket() as silent:
        if collector == "silent":  # accepts connections (the kernel does), never reads nor answers
            silent.bind(("127.0.0.1", 0))
            silent.listen(16)
            port = silent.getsockname()[1]
        else:
            port = free_port()  # nothing listens: refused
        done = run_traced(tmp_path, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}")
    assert done.returncode == 0, done.stderr[-3000:]
    exit_s = float(done.stdout.split("exit_s=")[1].split()[0])
    # The bound is SHUTDOWN_TIMEOUT_S (2 s of wall clock, however busy the machine). The SDK's defaults
    # took 10-17 s here, and never under 5.6 s refused (its retries back off 1, 2, 4 s, jitter -20 %):
    # 5 s fails them all and leaves a busy 2-core machine 3 s beyond the bound.
    assert exit_s < 5, exit_s


def test_the_console_exporter_prints_each_span_as_a_json_line(tmp_path: Path) -> None:
    done = run_traced(tmp_path, FUSION_TRACES_EXPORTER="console")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert [span["name"] for span in lines] == ["probe"]
    assert lines[0]["resource"]["attributes"]["service.name"] == "fusion-graph"
    assert "exit_s=" in done.stdout and "probe" not in done.stdout  # stdout stays the program's own
