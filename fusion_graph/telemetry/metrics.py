"""Prometheus metrics of every inference, counted from its record (``prometheus-client``).

Why ``prometheus-client`` and not OpenTelemetry metrics with a Prometheus
exporter: operators scrape Prometheus, and the client is one small dependency
with the text format, a WSGI/ASGI handler and a multiprocess mode, where the
OpenTelemetry route would add the SDK's metric pipeline to every step for the
same output. Spans are OpenTelemetry's job (``traces``).

Several workers: each worker process counts its own inferences and serves them
on its own ``FUSION_METRICS_PORT``, one scrape target per process; PromQL sums
over them (``sum(...)``), as the dashboard does. A scrape per worker rather than
prometheus-client's multiprocess collector: workers run on several machines
(which no shared directory spans), a restarted worker's counters reset as
Prometheus's ``rate`` and ``increase`` expect, and the cooldown gauge (read at
scrape time from the process's own chains) has no multiprocess form. Not the
LangGraph server's own port: its custom-app route (``langgraph.json`` ``http``)
runs the API's store middleware before the Postgres pool starts (langgraph-api
0.11 on the Postgres runtime), and no worker comes up.

Every label value comes from a record (provider ids, legs, kinds, boxes), scrubbed
of the operator's secrets; none grows with the traffic (no thread or run ids).
The ``box`` label is the one value that may come from outside: a gateway names
the box that served in a response header, which any server on the local URL may
send with any text in it. So it is only ever a box the operator configured
(``local_workers``, gathered by ``Metrics.know_boxes``), ``other`` for a record
that names any other box, or the answering provider's id where the record names
none or no box is configured in the process.

Served by ``endpoint.MetricsEndpoint`` (one thread, bounded connections), not
prometheus-client's thread-per-connection server.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client import REGISTRY, CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fusion_graph.redact import scrub_repeated as scrub
from fusion_graph.routing.records import RouteRecord, placement_of
from fusion_graph.routing.score import score_band
from fusion_graph.telemetry.endpoint import MetricsEndpoint

if TYPE_CHECKING:
    from prometheus_client import Metric


class Watched(Protocol):
    """What the cooldown gauge reads of a provider chain (``ProviderChain.health_states``)."""

    def health_states(self) -> Mapping[str, str]:
        """Each provider's circuit state now, by provider id."""
        ...


#: The ``box`` label of a box a gateway named that no configured ``local_workers`` entry is.
OTHER_BOX = "other"


def box_label(url: str) -> str:
    """A box's URL as a gateway names it and as the ``box`` label shows it: no trailing ``/`` or ``/v1``."""
    url = url.strip().rstrip("/")
    return url.removesuffix("/v1")


#: Every metric's name, for the dashboard test and the docs (the ``_total`` suffix as scraped).
NAMES = (
    "fusion_inferences_total",
    "fusion_cost_usd_total",
    "fusion_all_cloud_cost_usd_total",
    "fusion_unpriced_inferences_total",
    "fusion_tokens_total",
    "fusion_failed_attempts_total",
    "fusion_fallovers_total",
    "fusion_budget_kept_local_total",
    "fusion_placements_total",
    "fusion_memory_jobs_total",
    "fusion_shadow_checks_total",
    "fusion_provider_cooldown",
    "fusion_shared_state_failures_total",
    "fusion_memory_runs_pending",
)


class Failing(Protocol):
    """What the shared-state gauge reads (``SharedState.failures``: operations that failed so far)."""

    failures: int


class _SharedState(Collector):
    """``fusion_shared_state_failures_total``: failed shared-state operations of this process, read at scrape.

    Each failure is a turn placed, or a claim made, in this process instead (never a failed turn).
    """

    def __init__(self) -> None:
        self.states: weakref.WeakSet[Failing] = weakref.WeakSet()

    def collect(self) -> Iterator[Metric]:
        counter = CounterMetricFamily(
            "fusion_shared_state_failures",
            "Shared-state operations that failed (timed out, refused, connection lost): each fell back "
            "to this process",
        )
        counter.add_metric([], float(sum(state.failures for state in list(self.states))))
        yield counter


class _PendingMemory(Collector):
    """``fusion_memory_runs_pending``: memory runs detached in this process and not finished, at scrape."""

    def __init__(self) -> None:
        self.count: Callable[[], int] | None = None

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "fusion_memory_runs_pending", "Memory runs detached in this process and still running"
        )
        gauge.add_metric([], float(self.count() if self.count is not None else 0))
        yield gauge


class _Cooldowns(Collector):
    """``fusion_provider_cooldown``: 1 per provider this process's chains hold in cooldown, read at scrape."""

    def __init__(self) -> None:
        self.chains: weakref.WeakSet[Watched] = weakref.WeakSet()

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "fusion_provider_cooldown",
            "1 while this process holds the provider in cooldown (0: healthy or probing)",
            labels=["provider"],
        )
        seen: set[str] = set()
        for chain in list(self.chains):
            for link_id, state in chain.health_states().items():
                if link_id not in seen:
                    seen.add(link_id)
                    gauge.add_metric([scrub(link_id)], 1.0 if state == "cooldown" else 0.0)
        yield gauge


class Metrics:
    """The metrics of one registry, and how a record is counted into them."""

    _process: Metrics | None = None

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        """Register every metric in ``registry`` (a fresh one in tests)."""
        self.registry = registry

        def counter(name: str, doc: str, labels: tuple[str, ...]) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.inferences = counter(
            "fusion_inferences",
            "Inferences by kind, the leg the rule routed to, the leg and provider that answered, outcome",
            ("kind", "routed_leg", "leg", "provider", "outcome"),
        )
        self.cost = counter(
            "fusion_cost_usd", "USD spent, priced at the provider that answered", ("kind", "leg", "provider")
        )
        self.all_cloud = counter(
            "fusion_all_cloud_cost_usd",
            "USD the same priced inferences would have cost on the cloud link (savings = this - cost)",
            ("kind",),
        )
        self.unpriced = counter(
            "fusion_unpriced_inferences",
            "Answered inferences with no price (not in the cost metrics)",
            ("kind", "leg", "provider"),
        )
        self.tokens = counter(
            "fusion_tokens",
            "Tokens as the provider reported them: prompt, cached (of the prompt), processed (prefilled "
            "by llama-server), completion",
            ("leg", "box", "type"),
        )
        self.failed = counter(
            "fusion_failed_attempts",
            "Failed attempts before an answer or exhaustion",
            ("provider", "error_class"),
        )
        self.fallovers = counter(
            "fusion_fallovers",
            "Inferences answered after failed attempts, by the leg routed to and the leg that answered",
            ("routed_leg", "leg"),
        )
        self.kept_local = counter(
            "fusion_budget_kept_local", "Inferences the cloud budget moved from cloud to local", ("kind",)
        )
        self.placements = counter(
            "fusion_placements",
            "Local inferences by placement: shared lease, guest, in-process, unplaced (no slot named)",
            ("placement",),
        )
        self.memory_jobs = counter(
            "fusion_memory_jobs",
            "Memory jobs by outcome: stored, dropped (no valid answer, a store write failed, taken over), "
            "or pending (stopped before it finished, e.g. at exit: the thread's next turn runs it)",
            ("outcome",),
        )
        self.shadows = counter(
            "fusion_shadow_checks",
            "Shadow checks by the step's score band and whether cloud acted as local did",
            ("band", "agrees"),
        )
        #: The ``box`` label values a gateway's header may give (``know_boxes``).
        self.boxes: frozenset[str] = frozenset()
        self.cooldowns = _Cooldowns()
        self.shared_states = _SharedState()
        self.pending_memory = _PendingMemory()
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            for collector in (self.cooldowns, self.shared_states, self.pending_memory):
                registry.register(collector)

    @classmethod
    def process(cls) -> Metrics:
        """The process's metrics in prometheus-client's default registry (made once)."""
        if cls._process is None:
            cls._process = cls()
        return cls._process

    def watch(self, chain: Watched) -> None:
        """Report ``chain``'s providers in the cooldown gauge (held weakly)."""
        self.cooldowns.chains.add(chain)

    def watch_shared(self, shared: Failing) -> None:
        """Report ``shared``'s failed operations (held weakly)."""
        self.shared_states.states.add(shared)

    def watch_pending_memory(self, count: Callable[[], int]) -> None:
        """Report the memory runs in flight in this process (``count`` is read at each scrape)."""
        self.pending_memory.count = count

    def know_boxes(self, urls: Iterable[str]) -> None:
        """Add configured boxes (``local_workers``) to the ``box`` label's values (every graph's add up)."""
        self.boxes |= {box_label(url) for url in urls if url.strip()}

    def box(self, record: RouteRecord, provider: str) -> str:
        """The ``box`` label of an answered record: a configured box, ``other``, or ``provider``.

        The gateway's header is text from the network (any server on the local URL
        may send it, with a key or a prompt in it): only a value naming a configured
        box becomes a label, anything else is ``other``; without a header, or with no
        box configured (llama-server itself is the local endpoint), the provider id.
        """
        named = record.get("placement", {}).get("box")
        if not isinstance(named, str) or not named or not self.boxes:
            return provider
        box = box_label(named)
        return scrub(box) if box in self.boxes else OTHER_BOX

    def serve(self, host: str, port: int) -> MetricsEndpoint:
        """Serve ``/metrics`` of this registry on ``host:port`` from one daemon thread (``endpoint``).

        Raises:
            OSError: The address cannot be bound (the port is taken).
        """
        endpoint = MetricsEndpoint(self.registry, host, port)
        endpoint.start()
        return endpoint

    def observe(self, record: RouteRecord, all_cloud_usd: float | None) -> None:
        """Count one inference's record (``all_cloud_usd``: its cost on the cloud link, when priced)."""
        kind, leg, provider = record["kind"], record["leg"], scrub(record["provider"] or "none")
        answered = record["provider"] is not None
        outcome = "answered" if answered else str(record.get("outcome", {}).get("status", "unanswered"))
        self.inferences.labels(kind, record["routed_leg"], leg, provider, outcome).inc()
        for attempt in record["attempts"]:
            self.failed.labels(scrub(str(attempt.get("provider"))), str(attempt.get("kind"))).inc()
        if record.get("kept_local_by_budget"):
            self.kept_local.labels(kind).inc()
        if not answered:
            return
        if record["attempts"]:
            self.fallovers.labels(record["routed_leg"], leg).inc()
        cost = record["cost_usd"]
        if cost is None:
            self.unpriced.labels(kind, leg, provider).inc()
        else:
            self.cost.labels(kind, leg, provider).inc(cost)
            if all_cloud_usd is not None:
                self.all_cloud.labels(kind).inc(all_cloud_usd)
        box = self.box(record, provider)
        for kind_of, value in (
            ("prompt", record["prompt_tokens"]),
            ("cached", record["cached_tokens"]),
            ("processed", record["processed_tokens"]),
            ("completion", record["completion_tokens"]),
        ):
            if value:
                self.tokens.labels(leg, box, kind_of).inc(value)
        placed = placement_of(record)
        if placed is not None:
            self.placements.labels(placed).inc()

    def job(self, record: RouteRecord) -> None:
        """Count a memory job by the outcome its last record says (``stored`` or ``dropped``)."""
        self.memory_jobs.labels(str(record.get("memory", {}).get("outcome", "dropped"))).inc()

    def job_pending(self) -> None:
        """Count a memory job stopped before it finished: left ``pending``, not ``dropped``."""
        self.memory_jobs.labels("pending").inc()

    def shadow(self, record: RouteRecord) -> None:
        """Count a finished shadow check by its step's score band and whether cloud agreed."""
        shadow = record.get("shadow")
        if shadow is None:
            return
        agrees = shadow.get("agrees")
        self.shadows.labels(
            score_band(shadow.get("score")), "unknown" if agrees is None else str(agrees).lower()
        ).inc()
