"""OpenTelemetry spans of a run: ``invoke_agent`` per turn, ``chat`` per inference, ``execute_tool`` per call.

Attributes follow OpenTelemetry's GenAI semantic conventions
(``gen_ai.operation.name``, ``gen_ai.provider.name``, ``gen_ai.request.model``,
``gen_ai.response.model``, ``gen_ai.usage.*``, ``gen_ai.conversation.id``), with
the routing decision beside them under ``fusion.*`` (the leg routed to and the
leg that answered, the score and its terms, the threshold, the reason, box and
slot, cost, budget verdict, placement, shadow agreement). Every value comes
from the inference's record and is scrubbed of the operator's secrets.

The spans nest through OpenTelemetry's context: the turn's span is current while
LangGraph runs the turn's tasks, so the inferences and tool calls of a LangGraph
server run, a ``langgraph dev`` run or an embedded one hang under it. When the
app set up OpenTelemetry itself, its tracer provider is used; otherwise one is
set up that exports over OTLP/HTTP where the standard ``OTEL_EXPORTER_OTLP_*``
variables say (``OTEL_SERVICE_NAME``: the service, ``fusion-graph`` by default).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from fusion_graph.redact import scrub, scrub_repeated
from fusion_graph.routing.records import RouteRecord, placement_of

#: Attribute values OpenTelemetry takes.
Value = str | bool | int | float
#: Attributes whose text differs on every span (the rest repeat: ids, names, legs).
FREE_TEXT = frozenset({"fusion.reason", "fusion.cloud_budget"})


def _provider_name(provider_id: str, leg: str) -> str:
    """``gen_ai.provider.name``: ``llama.cpp`` for the local leg, else the cloud provider's kind."""
    return "llama.cpp" if leg == "local" else provider_id.split(":", 1)[0] or "openai"


def _clean(attributes: Mapping[str, Any]) -> dict[str, Value]:
    """``attributes`` without ``None`` values, strings scrubbed, other values as OpenTelemetry takes them."""
    out: dict[str, Value] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        if isinstance(value, bool | int | float):
            out[key] = value
        else:
            out[key] = scrub(str(value)) if key in FREE_TEXT else scrub_repeated(str(value))
    return out


def inference_attributes(
    record: RouteRecord, *, model: str, response_model: str | None, thread_id: str | None
) -> dict[str, Value]:
    """A ``chat`` span's attributes: the GenAI conventions' and the routing decision's, from ``record``."""
    extra = record["extra"]
    found = extra.get("shadow")
    shadow: Mapping[str, Any] = found if isinstance(found, dict) else {}
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": _provider_name(record["provider"] or "", record["leg"]),
        "gen_ai.request.model": model,
        "gen_ai.response.model": response_model,
        "gen_ai.usage.input_tokens": record["prompt_tokens"],
        "gen_ai.usage.output_tokens": record["completion_tokens"],
        "gen_ai.usage.cache_read.input_tokens": record["cached_tokens"],
        "gen_ai.conversation.id": thread_id,
        "fusion.kind": record["kind"],
        "fusion.turn": record["turn"],
        "fusion.step": record["step"],
        "fusion.routed_leg": record["routed_leg"],
        "fusion.leg": record["leg"],
        "fusion.provider": record["provider"],
        "fusion.score": record["score"],
        "fusion.threshold": record["threshold"],
        "fusion.reason": record["reason"],
        "fusion.slot": record["slot"],
        "fusion.box": extra.get("box"),
        "fusion.placement": placement_of(record),
        "fusion.processed_tokens": record["processed_tokens"],
        "fusion.cost_usd": record["cost_usd"],
        "fusion.kept_local_by_budget": bool(record.get("kept_local_by_budget")),
        "fusion.cloud_budget": extra.get("cloud_budget"),
        "fusion.failed_attempts": len(record["attempts"]),
        "fusion.shadow.agrees": shadow.get("agrees"),
    }
    for term, points in (record["breakdown"] or {}).items():
        attributes[f"fusion.score.{term}"] = points
    return _clean(attributes)


class Traces:
    """The tracer the spans are made with."""

    def __init__(self, tracer: Tracer) -> None:
        """Make spans with ``tracer``."""
        self.tracer = tracer

    @classmethod
    def start(cls) -> Traces:
        """The app's tracer provider if it set one up, else one exporting over OTLP/HTTP."""
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider):  # nobody set one up: export by OTLP
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            service = os.environ.get("OTEL_SERVICE_NAME") or "fusion-graph"
            sdk = TracerProvider(resource=Resource.create({"service.name": service}))
            sdk.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            trace.set_tracer_provider(sdk)
            provider = trace.get_tracer_provider()
        return cls(provider.get_tracer("fusion_graph"))

    def inference(
        self,
        record: RouteRecord,
        *,
        started_ns: int,
        ended_ns: int,
        model: str,
        response_model: str | None,
        thread_id: str | None,
    ) -> None:
        """The ``chat`` span of one inference, made from its record once it is known."""
        attributes = inference_attributes(
            record, model=model, response_model=response_model, thread_id=thread_id
        )
        span = self.tracer.start_span(
            f"chat {scrub(model)}", kind=SpanKind.CLIENT, start_time=started_ns, attributes=attributes
        )
        for attempt in record["attempts"]:
            span.add_event(
                "fusion.failed_attempt",
                _clean({"provider": attempt.get("provider"), "error_class": attempt.get("kind")}),
            )
        if record["provider"] is None:
            span.set_status(Status(StatusCode.ERROR, "no provider answered"))
        span.end(end_time=ended_ns)

    @contextmanager
    def tool(self, name: str, call_id: str | None, thread_id: str) -> Iterator[None]:
        """The ``execute_tool`` span of one tool call, current while it runs."""
        attributes = _clean(
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": name,
                "gen_ai.tool.call.id": call_id,
                "gen_ai.conversation.id": thread_id,
            }
        )
        with self.tracer.start_as_current_span(f"execute_tool {name}", attributes=attributes):
            yield

    @contextmanager
    def turn(self, graph: str, thread_id: str | None, metadata: Mapping[str, Any]) -> Iterator[None]:
        """The ``invoke_agent`` span of one run of the graph, current while LangGraph runs it."""
        attributes = _clean(
            {
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.agent.name": graph,
                "gen_ai.conversation.id": thread_id,
                "fusion.assistant_id": metadata.get("assistant_id"),
                "fusion.run_id": metadata.get("run_id"),
            }
        )
        with self.tracer.start_as_current_span(f"invoke_agent {graph}", attributes=attributes):
            yield
