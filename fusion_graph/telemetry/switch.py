"""The process's telemetry: off until a provider resolver reads ``metrics`` and ``traces`` in its settings.

Prometheus metrics and an OpenTelemetry tracer provider belong to a process,
not to one graph, so the switch is process-wide: once a graph turned them on,
every graph of the process counts into the same metrics. What the hooks report
is already in each inference's record (scrubbed of the operator's secrets).

For the same reason one process serves one ``/metrics`` address: a graph whose
``metrics_host``/``metrics_port`` differs from the address already served is
refused with an error naming that address, not left unserved without a word
(its inferences are counted there anyway, in the one registry).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from fusion_graph.errors import ProviderConfigError
from fusion_graph.routing.records import RouteRecord

if TYPE_CHECKING:
    from fusion_graph.settings import FusionSettings
    from fusion_graph.telemetry.endpoint import MetricsEndpoint
    from fusion_graph.telemetry.metrics import Failing, Metrics, Watched
    from fusion_graph.telemetry.traces import Traces

logger = logging.getLogger(__name__)

T = TypeVar("T")

INSTALL_HINT = "pip install 'fusion-graph[telemetry]'"


class MetricsOff:
    """Metrics while off: each report does nothing (the null object the switch starts with)."""

    def observe(self, record: RouteRecord, all_cloud_usd: float | None) -> None:
        """Nothing: no inference is counted."""

    def watch(self, chain: Watched) -> None:
        """Nothing: no cooldown gauge."""

    def watch_shared(self, shared: Failing) -> None:
        """Nothing: no shared-state gauge."""

    def watch_pending_memory(self, count: Callable[[], int]) -> None:
        """Nothing: no memory-run gauge."""

    def job(self, record: RouteRecord) -> None:
        """Nothing: no memory job is counted."""

    def job_pending(self) -> None:
        """Nothing."""

    def shadow(self, record: RouteRecord) -> None:
        """Nothing: no shadow check is counted."""


class TracesOff:
    """Traces while off: no span, and a run's stream passes through untouched."""

    def inference(self, record: RouteRecord, **span: Any) -> None:
        """Nothing: no ``chat`` span."""

    def tool(self, name: str, call_id: str | None, thread_id: str) -> AbstractContextManager[None]:
        """A context that does nothing (reused, it holds no state)."""
        return _NO_SPAN

    def run(
        self, stream: AsyncIterator[T], graph: str, thread_id: str | None, metadata: Mapping[str, Any]
    ) -> AsyncIterator[T]:
        """``stream`` itself."""
        return stream


#: What a span hook returns while traces are off: a context that does nothing (reused, it holds no state).
_NO_SPAN: AbstractContextManager[None] = nullcontext()
METRICS_OFF = MetricsOff()
TRACES_OFF = TracesOff()


@dataclass
class Telemetry:
    """What is on in this process: metrics, traces (``METRICS_OFF``, ``TRACES_OFF``: off), ``/metrics``."""

    metrics: Metrics | MetricsOff = METRICS_OFF
    traces: Traces | TracesOff = TRACES_OFF
    endpoint: MetricsEndpoint | None = None

    @property
    def served_port(self) -> int | None:
        """The port ``/metrics`` is served on by this process (``None``: not served by fusion-graph)."""
        return self.endpoint.port if self.endpoint is not None else None

    @property
    def on(self) -> bool:
        """Whether any hook has work to do."""
        return self.metrics is not METRICS_OFF or self.traces is not TRACES_OFF


#: The process's telemetry.
ACTIVE = Telemetry()


def configure(settings: FusionSettings) -> None:
    """Turn on what ``settings`` asks for (never off: another graph of the process may count).

    Raises:
        ProviderConfigError: ``metrics`` or ``traces`` is on and the 'telemetry' extra is missing,
            or ``metrics_host:metrics_port`` cannot be served, or differs from the address this
            process already serves.
    """
    if settings.metrics and ACTIVE.metrics is METRICS_OFF:
        try:
            from fusion_graph.telemetry.metrics import Metrics
        except ImportError as error:
            raise ProviderConfigError(f"FUSION_METRICS needs prometheus-client: {INSTALL_HINT}") from error
        ACTIVE.metrics = Metrics.process()
    if settings.metrics and not isinstance(ACTIVE.metrics, MetricsOff):
        ACTIVE.metrics.know_boxes(settings.local_workers)  # the box label's only values
        if settings.metrics_port is not None:
            _serve(ACTIVE.metrics, settings.metrics_host, settings.metrics_port)
    if settings.traces and ACTIVE.traces is TRACES_OFF:
        try:
            from fusion_graph.telemetry.traces import Traces
        except ImportError as error:
            raise ProviderConfigError(f"FUSION_TRACES needs OpenTelemetry: {INSTALL_HINT}") from error
        ACTIVE.traces = Traces.start(
            exporter=settings.traces_exporter, error_detail=settings.traces_error_detail
        )


def _address(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _serve(metrics: Metrics, host: str, port: int) -> None:
    """Serve ``/metrics`` on ``host:port`` once per process; a graph asking for another address is refused.

    Raises:
        ProviderConfigError: The address cannot be bound, or this process already serves another.
    """
    served = ACTIVE.endpoint
    if served is not None:
        if (served.host, served.port) == (host, port):
            return  # another graph of this process, the same settings
        raise ProviderConfigError(
            f"FUSION_METRICS_HOST/FUSION_METRICS_PORT={_address(host, port)}: this process already serves "
            f"/metrics on {_address(served.host, served.port)} (one registry per process, so one address; "
            "its inferences are counted there): give every graph of a process the same address"
        )
    try:
        ACTIVE.endpoint = metrics.serve(host, port)
    except OSError as error:
        raise ProviderConfigError(
            f"cannot serve /metrics on {_address(host, port)} (FUSION_METRICS_HOST/FUSION_METRICS_PORT): "
            f"{error}. One port per process: give each worker process its own FUSION_METRICS_PORT, or "
            "leave FUSION_METRICS_PORT empty where the app already serves prometheus-client's default "
            "registry (the metrics are in it)"
        ) from error


def reset() -> None:
    """Everything off, the ``/metrics`` endpoint closed (tests; an app that shuts its graphs down)."""
    if ACTIVE.endpoint is not None:
        ACTIVE.endpoint.close()
    ACTIVE.metrics, ACTIVE.traces, ACTIVE.endpoint = METRICS_OFF, TRACES_OFF, None


def inference(
    record: RouteRecord,
    *,
    all_cloud_usd: float | None,
    started_ns: int,
    model: str,
    response_model: str | None,
    thread_id: str | None,
) -> None:
    """Report one inference from its record: counted, and a ``chat`` span from ``started_ns`` to now."""
    ACTIVE.metrics.observe(record, all_cloud_usd)
    ACTIVE.traces.inference(
        record,
        started_ns=started_ns,
        ended_ns=time.time_ns(),
        model=model,
        response_model=response_model,
        thread_id=thread_id,
    )


def watch_chain(chain: Watched) -> None:
    """Report ``chain``'s providers in the cooldown gauge (once per chain a resolver makes)."""
    ACTIVE.metrics.watch(chain)


def watch_shared(shared: Failing) -> None:
    """Report the failed operations of the deployment's shared state (read at each scrape)."""
    ACTIVE.metrics.watch_shared(shared)


def watch_pending_memory(count: Callable[[], int]) -> None:
    """Report the memory runs in flight in this process (``count`` is read at each scrape)."""
    ACTIVE.metrics.watch_pending_memory(count)


def job_finished(record: RouteRecord) -> None:
    """Count a memory job from its last record (its outcome is known only once it is stored)."""
    ACTIVE.metrics.job(record)


def job_left_pending() -> None:
    """Count a memory job stopped before it finished (its log entry stays pending; never ``dropped``)."""
    ACTIVE.metrics.job_pending()


def shadow_checked(record: RouteRecord) -> None:
    """Count a shadow check once whether cloud agreed is known (after its inference was counted)."""
    ACTIVE.metrics.shadow(record)


def tool_call(name: str, call_id: str | None, thread_id: str) -> AbstractContextManager[None]:
    """An ``execute_tool`` span around one tool call (the inferences it makes, MCP samples, nest in it)."""
    return ACTIVE.traces.tool(name, call_id, thread_id)


def turn(
    stream: AsyncIterator[T], graph: str, thread_id: str | None, metadata: Mapping[str, Any] | None = None
) -> AsyncIterator[T]:
    """``stream`` (one run of the graph) inside an ``invoke_agent`` span: its inferences and tools nest in it.

    A wrapper of the stream, not a context around it: the span is made current in each task
    that pulls a chunk (``Traces.run``). Traces off: ``stream`` itself.
    """
    return ACTIVE.traces.run(stream, graph, thread_id, metadata or {})
