"""OpenTelemetry spans of a run: ``invoke_agent`` per turn, ``chat`` per inference, ``execute_tool`` per call.

Attributes follow OpenTelemetry's GenAI semantic conventions
(``gen_ai.operation.name``, ``gen_ai.provider.name``, ``gen_ai.request.model``,
``gen_ai.response.model``, ``gen_ai.usage.*``, ``gen_ai.conversation.id``), with
the routing decision beside them under ``fusion.*`` (the leg routed to and the
leg that answered, the score and its terms, the threshold, the reason, box and
slot, cost, budget verdict, placement, shadow agreement). Every value comes
from the inference's record and is scrubbed of the operator's secrets.

Nesting. A run's ``invoke_agent`` span is made current around each step of its
stream (``Traces.run``), not once around the whole stream: a LangGraph server
pulls each chunk in a task of its own (``langgraph dev`` does), so a context set
in the first step would not be current in the next, and the node tasks LangGraph
starts there would make spans with no parent, each its own trace. The run span
is also kept by thread id while the run is in flight (runs of one thread do not
interleave in a process: ``run_queue``), and an inference or tool span takes it
as its parent whenever the current context is not already inside that run (one
of its tool spans, or the run span itself): a span of the run never starts a
trace of its own, whichever task or thread LangGraph ran it in.

Errors. A run that raises gets OpenTelemetry's ``exception`` event and an error
status, with the error's class (the semantic conventions' type attributes) and the
package's own classification (``fusion.error.kind``, ``fusion.error.provider_type``)
but not the error's text: a provider's error text may echo the prompt, and a
trace backend is read by more people than the run's user. ``traces_error_detail``
opts in to the text (scrubbed of secrets) and the stack trace.

Export. When the app set up OpenTelemetry itself, its tracer provider is used;
otherwise one is set up that exports over OTLP/HTTP where the standard
``OTEL_EXPORTER_OTLP_*`` variables say (``OTEL_SERVICE_NAME``: the service,
``fusion-graph`` by default), or prints JSON lines to stderr
(``traces_exporter="console"``). An OTLP export gives up after
``EXPORT_TIMEOUT_S`` (the SDK's default is 10 s, retries included), and the
process spends at most ``SHUTDOWN_TIMEOUT_S`` at exit flushing spans: a refused
or silent collector costs a turn nothing and an exit at most that long.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from fusion_graph.redact import scrub, scrub_known, scrub_repeated
from fusion_graph.routing.records import RouteRecord, placement_of

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

T = TypeVar("T")

#: Attribute values OpenTelemetry takes.
Value = str | bool | int | float
#: Attributes whose text differs on every span (the rest repeat: ids, names, legs).
FREE_TEXT = frozenset({"fusion.reason", "fusion.cloud_budget"})
#: Identifiers, only ever cleared of the registered secrets, never of key-shaped text: a LangGraph
#: server's thread, run and assistant ids are UUIDs, which the pattern scrubber takes for keys.
IDENTIFIERS = frozenset(
    {"gen_ai.conversation.id", "gen_ai.tool.call.id", "fusion.run_id", "fusion.assistant_id"}
)
#: Seconds an OTLP export (its retries included) may take before its spans are dropped, unless the
#: standard ``OTEL_EXPORTER_OTLP_TRACES_TIMEOUT``/``OTEL_EXPORTER_OTLP_TIMEOUT`` says otherwise.
EXPORT_TIMEOUT_S = 2.0
#: Seconds the process spends at exit flushing and shutting the exporter down, however it is set up.
SHUTDOWN_TIMEOUT_S = 2.0
#: Where fusion-graph's own tracer provider sends spans (``traces_exporter``).
Exporter = Literal["otlp", "console"]


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
        elif key in IDENTIFIERS:
            out[key] = scrub_known(str(value))
        else:
            out[key] = scrub(str(value)) if key in FREE_TEXT else scrub_repeated(str(value))
    return out


def inference_attributes(
    record: RouteRecord, *, model: str, response_model: str | None, thread_id: str | None
) -> dict[str, Value]:
    """A ``chat`` span's attributes: the GenAI conventions' and the routing decision's, from ``record``."""
    found = record.get("shadow")
    shadow: Mapping[str, Any] = found if found is not None else {}
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
        "fusion.box": record.get("placement", {}).get("box"),
        "fusion.placement": placement_of(record),
        "fusion.processed_tokens": record["processed_tokens"],
        "fusion.cost_usd": record["cost_usd"],
        "fusion.kept_local_by_budget": bool(record.get("kept_local_by_budget")),
        "fusion.cloud_budget": record.get("budget", {}).get("over"),
        "fusion.failed_attempts": len(record["attempts"]),
        "fusion.shadow.agrees": shadow.get("agrees"),
    }
    for term, points in (record["breakdown"] or {}).items():
        attributes[f"fusion.score.{term}"] = points
    return _clean(attributes)


def _qualified(error: BaseException) -> str:
    """The fully qualified name of ``error``'s class (what ``exception.type`` and ``error.type`` hold)."""
    kind = type(error)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _console_line(span: Any) -> str:
    """One span as one line of JSON (``jq`` reads a stream of them)."""
    return str(span.to_json(indent=None)) + os.linesep


def _own_processor(exporter: Exporter) -> SpanProcessor:
    """The span processor of fusion-graph's own tracer provider: OTLP/HTTP with bounded export, or stderr.

    The console exporter writes each span as it ends (nothing is held back, so nothing waits at
    exit) to stderr, so a CLI's answer on stdout stays clean. The OTLP exporter's timeout bounds an
    export and its retries together (the SDK's default, 10 s, is what made an exit towards a dead
    collector take 10-17 s); the standard variables still set it when the operator gives them.
    """
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    if exporter == "console":
        return SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr, formatter=_console_line))
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    standard = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_TIMEOUT"
    )
    otlp = OTLPSpanExporter(timeout=None if standard else EXPORT_TIMEOUT_S)
    return BatchSpanProcessor(otlp, export_timeout_millis=EXPORT_TIMEOUT_S * 1000)


def own_provider(exporter: Exporter = "otlp") -> TracerProvider:
    """fusion-graph's tracer provider (not made global here), shut down within ``SHUTDOWN_TIMEOUT_S`` at exit.

    The SDK's own exit hook would wait for the batch processor's worker without a bound (up
    to 30 s, then the exporter's own timeout), so it is turned off and ``shutdown_within``
    stands in for it.
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    service = os.environ.get("OTEL_SERVICE_NAME") or "fusion-graph"
    sdk = TracerProvider(resource=Resource.create({"service.name": service}), shutdown_on_exit=False)
    sdk.add_span_processor(_own_processor(exporter))
    atexit.register(shutdown_within, sdk, SHUTDOWN_TIMEOUT_S)
    return sdk


def shutdown_within(provider: TracerProvider, timeout_s: float) -> bool:
    """Flush and shut ``provider`` down, waiting for it at most ``timeout_s`` seconds.

    It runs in a daemon thread: past the bound the process goes on (exits) and the spans not yet
    sent are dropped, as the SDK drops them when its own timeouts pass. Returns whether it finished.
    """
    worker = threading.Thread(target=provider.shutdown, name="fusion-traces-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return not worker.is_alive()


@dataclass
class _Run:
    """A run in flight: its span and the ids of its spans now open (itself, its tool spans)."""

    span: Span
    open: set[int] = field(default_factory=set)


class _Runs:
    """The runs in flight by thread id, so a span of a run finds the run's span whatever task it is in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_thread: dict[str, list[_Run]] = {}

    def push(self, thread_id: str, run: _Run) -> None:
        """``run`` is in flight on ``thread_id`` (a run may start inside another run's tool)."""
        with self._lock:
            self._by_thread.setdefault(thread_id, []).append(run)

    def pop(self, thread_id: str, run: _Run) -> None:
        """``run`` is over: its later spans (a memory job outliving it) keep the context they have."""
        with self._lock:
            runs = self._by_thread.get(thread_id, [])
            if run in runs:
                runs.remove(run)
            if not runs:
                self._by_thread.pop(thread_id, None)

    def current(self, thread_id: str | None) -> _Run | None:
        """The innermost run in flight on ``thread_id`` (``None``: none, or no thread id)."""
        if thread_id is None:
            return None
        with self._lock:
            runs = self._by_thread.get(thread_id)
            return runs[-1] if runs else None


class Traces:
    """The tracer the spans are made with, and the runs in flight."""

    def __init__(self, tracer: Tracer, *, error_detail: bool = False) -> None:
        """Make spans with ``tracer``; ``error_detail``: a run's error text goes on its span (scrubbed)."""
        self.tracer = tracer
        self.error_detail = error_detail
        self._runs = _Runs()

    @classmethod
    def start(cls, *, exporter: Exporter = "otlp", error_detail: bool = False) -> Traces:
        """The app's tracer provider if it set one up, else fusion-graph's own (``own_provider``)."""
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider):  # nobody set one up: ours
            trace.set_tracer_provider(own_provider(exporter))
            provider = trace.get_tracer_provider()
        return cls(provider.get_tracer("fusion_graph"), error_detail=error_detail)

    def _parent(self, thread_id: str | None) -> tuple[Context | None, _Run | None]:
        """The context a span of ``thread_id``'s run starts in, and that run (``None``: no run in flight).

        The current context when it is inside the run (the run span or one of its tool spans is
        current), else the run span's: LangGraph may run a node in a task or thread the run's
        context never reached. No run in flight for the thread (an embedded run without a thread
        id, a memory job after its turn): the current context.
        """
        run = self._runs.current(thread_id)
        if run is None:
            return None, None
        if trace.get_current_span().get_span_context().span_id in run.open:
            return None, run
        return trace.set_span_in_context(run.span), run

    def failed(self, span: Span, error: BaseException) -> None:
        """Mark ``span`` failed by ``error``: its class and kind always, its (scrubbed) text only if opted in.

        OpenTelemetry's own ``record_exception`` would put the error's text and traceback on the
        span, and a provider's error text may echo the prompt; the class and the package's
        classification say what went wrong without it.
        """
        name = _qualified(error)
        kind, provider_type = getattr(error, "kind", None), getattr(error, "error_type", None)
        attributes: dict[str, Value] = {"exception.type": name}
        if isinstance(kind, str):
            attributes["fusion.error.kind"] = scrub_repeated(kind)
        if isinstance(provider_type, str):
            attributes["fusion.error.provider_type"] = scrub_repeated(provider_type)
        description = type(error).__name__ + (f" ({kind})" if isinstance(kind, str) else "")
        if self.error_detail:
            text = scrub(str(error))
            attributes["exception.message"] = text
            attributes["exception.stacktrace"] = scrub("".join(traceback.format_exception(error)))
            description = f"{description}: {text}"
        span.set_attribute("error.type", name)
        span.add_event("exception", attributes)
        span.set_status(Status(StatusCode.ERROR, description))

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
        parent, _ = self._parent(thread_id)
        span = self.tracer.start_span(
            f"chat {scrub(model)}",
            context=parent,
            kind=SpanKind.CLIENT,
            start_time=started_ns,
            attributes=attributes,
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
        """The ``execute_tool`` span of one tool call, current while it runs (its MCP samples nest in it)."""
        attributes = _clean(
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": name,
                "gen_ai.tool.call.id": call_id,
                "gen_ai.conversation.id": thread_id,
            }
        )
        parent, run = self._parent(thread_id)
        with self.tracer.start_as_current_span(
            f"execute_tool {name}",
            context=parent,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            span_id = span.get_span_context().span_id
            if run is not None:
                run.open.add(span_id)
            try:
                yield
            except Exception as error:
                self.failed(span, error)
                raise
            finally:
                if run is not None:
                    run.open.discard(span_id)

    async def run(
        self, stream: AsyncIterator[T], graph: str, thread_id: str | None, metadata: Mapping[str, Any]
    ) -> AsyncIterator[T]:
        """``stream`` inside the ``invoke_agent`` span of one run of the graph.

        The span is made current around each step of the stream (each ``anext``), in the task
        that pulls that step: a consumer may pull every chunk from a task of its own (a LangGraph
        server does), and a context attached in one task and detached in another is no context
        at all. It starts in the context current at the first step (an app's or server's span
        parents it). A run that raises marks it failed (``failed``); a consumer that stops early
        or a cancelled run ends it without an error.
        """
        attributes = _clean(
            {
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.agent.name": graph,
                "gen_ai.conversation.id": thread_id,
                "fusion.assistant_id": metadata.get("assistant_id"),
                "fusion.run_id": metadata.get("run_id"),
            }
        )
        span = self.tracer.start_span(f"invoke_agent {graph}", attributes=attributes)
        inside = trace.set_span_in_context(span)
        run = _Run(span, {span.get_span_context().span_id})
        if thread_id is not None:
            self._runs.push(thread_id, run)
        try:
            while True:
                token = otel_context.attach(inside)
                try:
                    chunk = await anext(stream)
                except StopAsyncIteration:
                    break
                finally:
                    otel_context.detach(token)
                yield chunk
        except Exception as error:
            self.failed(span, error)
            raise
        finally:
            if thread_id is not None:
                self._runs.pop(thread_id, run)
            span.end()
