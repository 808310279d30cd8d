"""OpenTelemetry spans: a turn's tree, GenAI attributes equal to the records, no secret anywhere."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from fusion_graph import FusionContext
from fusion_graph.telemetry import switch
from fusion_graph.telemetry.traces import Traces
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.served import lookup_then_done
from tests.unit.telemetry.test_metrics import SECRET, graph_with, run


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Traces on, into an in-memory exporter of the test's own; off again after it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    switch.ACTIVE.traces = Traces(provider.get_tracer("test"))
    yield exporter
    switch.reset()


def everything(span: ReadableSpan) -> str:
    """Every attribute and event of ``span`` as text, to look for a secret in."""
    events = [(e.name, dict(e.attributes or {})) for e in span.events]
    return json.dumps([span.name, dict(span.attributes or {}), events], default=str)


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_a_turn_is_one_tree_whose_chat_spans_say_what_the_records_say(
    spans: InMemorySpanExporter, how: str
) -> None:
    refused = Reply(status=500, content=f"upstream broke, key {SECRET}")
    with (
        FakeOpenAI([refused]) as cloud,
        FakeOpenAI(lookup_then_done()) as local,
    ):
        graph = graph_with(cloud, local)
        state = await run(graph, how, FusionContext(cloud_share=30))
    finished = spans.get_finished_spans()
    turns = [
        s for s in finished if s.attributes and s.attributes.get("gen_ai.operation.name") == "invoke_agent"
    ]
    assert len(turns) == 1
    root = turns[0]
    assert root.parent is None and root.attributes is not None
    assert root.attributes["gen_ai.conversation.id"] == "t"
    chats = [s for s in finished if s.attributes and s.attributes.get("gen_ai.operation.name") == "chat"]
    tools = [
        s for s in finished if s.attributes and s.attributes.get("gen_ai.operation.name") == "execute_tool"
    ]
    assert all(s.context is not None for s in finished)
    trace_id = root.context.trace_id if root.context is not None else None
    assert {s.context.trace_id for s in finished if s.context is not None} == {trace_id}
    assert all(s.parent is not None and s.parent.span_id == root.context.span_id for s in chats + tools)
    assert [t.attributes["gen_ai.tool.name"] for t in tools if t.attributes] == ["lookup"]
    log = state["route_log"]
    assert len(chats) == len(log)
    for span, record in zip(sorted(chats, key=lambda s: s.start_time or 0), log, strict=True):
        a = span.attributes
        assert a is not None
        assert a["fusion.leg"] == record["leg"] and a["fusion.routed_leg"] == record["routed_leg"]
        assert a["fusion.kind"] == record["kind"] and a["fusion.step"] == record["step"]
        assert a["gen_ai.usage.input_tokens"] == record["prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == record["completion_tokens"]
        assert a.get("gen_ai.usage.cache_read.input_tokens") == record["cached_tokens"]
        assert a["gen_ai.provider.name"] == ("llama.cpp" if record["leg"] == "local" else "cloud")
        assert a["gen_ai.conversation.id"] == "t"
        assert a.get("fusion.score") == record["score"] and a["fusion.reason"] == record["reason"]
        assert a.get("fusion.cost_usd") == record["cost_usd"]
        assert a["fusion.failed_attempts"] == len(record["attempts"])
        for term, points in (record["breakdown"] or {}).items():
            assert a[f"fusion.score.{term}"] == points
    assert chats[0].events and chats[0].events[0].name == "fusion.failed_attempt"  # the refused cloud call
    assert not [s.name for s in finished if SECRET in everything(s)]


async def test_traces_off_make_no_span(spans: InMemorySpanExporter) -> None:
    switch.reset()
    with FakeOpenAI([Reply(content="plan")]) as cloud, FakeOpenAI([]) as local:
        await run(graph_with(cloud, local), "ainvoke", FusionContext(cloud_share=30))
    assert spans.get_finished_spans() == ()
