"""A real Prometheus scrapes ``/metrics`` while 300 idle connections are held open against it.

The unit tests scrape with an HTTP GET (``tests/unit/telemetry/test_endpoint.py``);
here the scraper is Prometheus itself, with its own HTTP client, keep-alive and
``Accept`` header, as an operator's would be.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from fusion_graph.telemetry.endpoint import THREADS, MetricsEndpoint
from fusion_graph.telemetry.metrics import Metrics
from fusion_graph_testing.prometheus import Prometheus, PrometheusNotInstalled, ensure_prometheus
from tests.plugins.requires import service_missing

IDLE = 300
SCRAPE_S = 1.0


@pytest.fixture
def prometheus_bin() -> Path:
    """The ``prometheus`` executable, or skip/fail (under ``CI=true``) when it is missing."""
    try:
        return ensure_prometheus()
    except PrometheusNotInstalled as exc:
        missing = str(exc)
    service_missing(missing, fix="apt-get install prometheus")


@pytest.fixture
def flooded() -> Iterator[tuple[MetricsEndpoint, int]]:
    """``/metrics`` of a registry with one inference counted, with ``IDLE`` idle connections held on it."""
    metrics = Metrics(CollectorRegistry())
    metrics.inferences.labels("step", "local", "local", "local:l", "answered").inc()
    before = threading.active_count()
    served = metrics.serve("127.0.0.1", 0)
    held = [socket.create_connection(("127.0.0.1", served.port), timeout=30) for _ in range(IDLE)]
    yield served, before
    for sock in held:
        sock.close()
    served.close()


def test_prometheus_scrapes_through_300_idle_connections(
    prometheus_bin: Path, tmp_path: Path, flooded: tuple[MetricsEndpoint, int]
) -> None:
    served, before = flooded
    prometheus = Prometheus(
        [f"127.0.0.1:{served.port}"], tmp_path / "prometheus", interval_s=SCRAPE_S, binary=prometheus_bin
    ).start()
    try:
        deadline = time.monotonic() + 60
        seen: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            seen = prometheus.query('fusion_inferences_total{kind="step"}')
            if seen:
                break
            time.sleep(SCRAPE_S / 2)
        assert [r["value"] for r in seen] == [1.0], prometheus.scraped_up()
        assert all(prometheus.scraped_up().values())
    finally:
        prometheus.stop()
    assert threading.active_count() - before <= THREADS
