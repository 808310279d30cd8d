"""The process's telemetry: off until a provider resolver reads ``metrics`` and ``traces`` in its settings.

Prometheus metrics and an OpenTelemetry tracer provider belong to a process,
not to one graph, so the switch is process-wide: once a graph turned them on,
every graph of the process counts into the same metrics. What the hooks report
is already in each inference's record (scrubbed of the operator's secrets).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fusion_graph.errors import ProviderConfigError
from fusion_graph.routing.records import RouteRecord

if TYPE_CHECKING:
    from fusion_graph.settings import FusionSettings
    from fusion_graph.telemetry.metrics import Failing, Metrics, Watched
    from fusion_graph.telemetry.traces import Traces

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'fusion-graph[telemetry]'"


@dataclass
class Telemetry:
    """What is on in this process: the metrics, the traces (``None``: off)."""

    metrics: Metrics | None = None
    traces: Traces | None = None
    served_port: int | None = None

    @property
    def on(self) -> bool:
        """Whether any hook has work to do."""
        return self.metrics is not None or self.traces is not None


#: The process's telemetry.
ACTIVE = Telemetry()


def configure(settings: FusionSettings) -> None:
    """Turn on what ``settings`` asks for (never off: another graph of the process may count).

    Raises:
        ProviderConfigError: ``metrics`` or ``traces`` is on and the 'telemetry' extra is missing,
            or ``metrics_port`` cannot be served.
    """
    if settings.metrics and ACTIVE.metrics is None:
        try:
            from fusion_graph.telemetry.metrics import Metrics
        except ImportError as error:
            raise ProviderConfigError(f"FUSION_METRICS needs prometheus-client: {INSTALL_HINT}") from error
        ACTIVE.metrics = Metrics.process()
    if settings.metrics and settings.metrics_port is not None and ACTIVE.served_port is None:
        assert ACTIVE.metrics is not None
        try:
            ACTIVE.metrics.serve(settings.metrics_port)
        except OSError as error:
            raise ProviderConfigError(
                f"cannot serve /metrics on FUSION_METRICS_PORT={settings.metrics_port}: {error} "
                "(one port per process: give each worker its own, or scrape the server's http app)"
            ) from error
        ACTIVE.served_port = settings.metrics_port
    if settings.traces and ACTIVE.traces is None:
        try:
            from fusion_graph.telemetry.traces import Traces
        except ImportError as error:
            raise ProviderConfigError(f"FUSION_TRACES needs OpenTelemetry: {INSTALL_HINT}") from error
        ACTIVE.traces = Traces.start()


def reset() -> None:
    """Everything off (tests; an app that shuts its graphs down)."""
    ACTIVE.metrics, ACTIVE.traces, ACTIVE.served_port = None, None, None


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
    if ACTIVE.metrics is not None:
        ACTIVE.metrics.observe(record, all_cloud_usd)
    if ACTIVE.traces is not None:
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
    if ACTIVE.metrics is not None:
        ACTIVE.metrics.watch(chain)


def watch_shared(shared: Failing) -> None:
    """Report the failed operations of the deployment's shared state (read at each scrape)."""
    if ACTIVE.metrics is not None:
        ACTIVE.metrics.watch_shared(shared)


def watch_pending_memory(count: Callable[[], int]) -> None:
    """Report the memory runs in flight in this process (``count`` is read at each scrape)."""
    if ACTIVE.metrics is not None:
        ACTIVE.metrics.pending_memory.count = count


def job_finished(record: RouteRecord) -> None:
    """Count a memory job from its last record (its outcome is known only once it is stored)."""
    if ACTIVE.metrics is not None:
        ACTIVE.metrics.job(record)


def shadow_checked(record: RouteRecord) -> None:
    """Count a shadow check once whether cloud agreed is known (after its inference was counted)."""
    if ACTIVE.metrics is not None:
        ACTIVE.metrics.shadow(record)


#: What a span hook returns while traces are off: a context that does nothing (reused, it holds no state).
_NO_SPAN: AbstractContextManager[None] = nullcontext()


def tool_call(name: str, call_id: str | None, thread_id: str) -> AbstractContextManager[None]:
    """An ``execute_tool`` span around one tool call (the inferences it makes, MCP samples, nest in it)."""
    return _NO_SPAN if ACTIVE.traces is None else ACTIVE.traces.tool(name, call_id, thread_id)


def turn(
    graph: str, thread_id: str | None, metadata: Mapping[str, Any] | None = None
) -> AbstractContextManager[None]:
    """An ``invoke_agent`` span around one run of the graph: its inferences and tools nest in it."""
    return _NO_SPAN if ACTIVE.traces is None else ACTIVE.traces.turn(graph, thread_id, metadata or {})
