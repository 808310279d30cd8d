"""``/metrics`` under bad input: idle connections hold no thread, one address per process, clear errors."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry, Metric
from prometheus_client.registry import Collector

from fusion_graph import FusionSettings
from fusion_graph.errors import ProviderConfigError
from fusion_graph.telemetry import endpoint, switch
from fusion_graph.telemetry.endpoint import THREADS, MetricsEndpoint
from fusion_graph.telemetry.metrics import Metrics
from fusion_graph_testing.llama_server import free_port

IDLE = 300


@pytest.fixture
def served() -> Iterator[MetricsEndpoint]:
    """A fresh registry's ``/metrics`` on a free loopback port, closed after the test."""
    metrics = Metrics(CollectorRegistry())
    metrics.inferences.labels("step", "local", "local", "local:l", "answered").inc()
    started = metrics.serve("127.0.0.1", 0)
    yield started
    started.close()


def idle_connections(port: int, count: int) -> list[socket.socket]:
    """``count`` connections to ``port`` that never send a byte."""
    held = []
    for _ in range(count):
        held.append(socket.create_connection(("127.0.0.1", port), timeout=30))
    return held


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` without answering (a reset, when it left bytes unread)."""
    sock.settimeout(60)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_idle_connections_hold_no_thread_and_a_scrape_still_answers() -> None:
    metrics = Metrics(CollectorRegistry())
    metrics.inferences.labels("step", "local", "local", "local:l", "answered").inc()
    before = threading.active_count()
    started = metrics.serve("127.0.0.1", 0)
    held = idle_connections(started.port, IDLE)
    try:
        scrape = httpx.get(f"http://127.0.0.1:{started.port}/metrics", timeout=30)
        assert scrape.status_code == 200
        assert 'fusion_inferences_total{kind="step"' in scrape.text
        # One serving thread, however many connections are held (a thread each before: +300).
        assert threading.active_count() - before <= THREADS
    finally:
        for sock in held:
            sock.close()
        started.close()
    assert threading.active_count() <= before  # closing ends the thread


def test_a_connection_that_never_sends_its_request_is_closed(
    served: MetricsEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(endpoint, "TIMEOUT_S", 0.2)
    with socket.create_connection(("127.0.0.1", served.port), timeout=60) as sock:
        assert closed_by_server(sock)  # the server closed it, it did not wait for good


def test_the_oldest_connection_makes_room_past_the_bound(served: MetricsEndpoint) -> None:
    held = idle_connections(served.port, endpoint.MAX_CONNECTIONS + 1)
    try:
        assert httpx.get(f"http://127.0.0.1:{served.port}/metrics", timeout=30).status_code == 200
        assert closed_by_server(held[0])  # closed to make room
    finally:
        for sock in held:
            sock.close()


def test_it_answers_as_prometheus_client_does(served: MetricsEndpoint) -> None:
    base = f"http://127.0.0.1:{served.port}"
    plain = httpx.get(f"{base}/metrics", timeout=30)
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert plain.headers["connection"] == "close"
    openmetrics = httpx.get(f"{base}/metrics", headers={"Accept": "application/openmetrics-text"}, timeout=30)
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.endswith("# EOF\n")
    raw = httpx.get(f"{base}/metrics", headers={"Accept-Encoding": "gzip"}, timeout=30)
    assert raw.headers["content-encoding"] == "gzip" and "fusion_inferences_total" in raw.text
    only = httpx.get(f"{base}/metrics?name[]=fusion_inferences_total", timeout=30).text
    assert "fusion_inferences_total{" in only and "fusion_memory_runs_pending" not in only
    assert httpx.post(f"{base}/metrics", timeout=30).status_code == 405
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        head = b"GET /metrics HTTP/1.1\r\nX-Long: " + b"a" * (endpoint.MAX_REQUEST_BYTES + 1) + b"\r\n\r\n"
        with contextlib.suppress(OSError):  # it may close before the client stops sending
            sock.sendall(head)
        assert closed_by_server(sock)  # a head no scrape sends: closed, nothing read past the bound


# ------------------------------------------------------------------ the operator settings


@pytest.fixture
def process_metrics() -> Iterator[None]:
    """The process's telemetry off before and after the test (its endpoint closed)."""
    switch.reset()
    yield
    switch.reset()


def test_metrics_listen_on_the_loopback_unless_the_operator_says_otherwise(process_metrics: None) -> None:
    assert FusionSettings().metrics_host == "127.0.0.1"
    port = free_port()
    switch.configure(FusionSettings(metrics=True, metrics_port=port))
    assert switch.ACTIVE.endpoint is not None and switch.ACTIVE.endpoint.host == "127.0.0.1"
    assert switch.ACTIVE.served_port == port
    assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).status_code == 200


def test_a_second_graph_with_another_address_is_refused_naming_the_served_one(process_metrics: None) -> None:
    port, other = free_port(), free_port()
    switch.configure(FusionSettings(metrics=True, metrics_port=port))
    switch.configure(FusionSettings(metrics=True, metrics_port=port))  # the same address: fine
    with pytest.raises(ProviderConfigError) as refused:
        switch.configure(FusionSettings(metrics=True, metrics_port=other))
    message = str(refused.value)
    assert f"127.0.0.1:{other}" in message and f"already serves /metrics on 127.0.0.1:{port}" in message
    assert switch.ACTIVE.served_port == port


def test_a_taken_port_says_what_to_do_and_not_to_scrape_the_servers_app(process_metrics: None) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ProviderConfigError) as refused:
            switch.configure(FusionSettings(metrics=True, metrics_port=port))
    message = str(refused.value)
    assert f"127.0.0.1:{port}" in message and "its own FUSION_METRICS_PORT" in message
    assert "http app" not in message
    assert switch.ACTIVE.endpoint is None


def test_a_collector_that_fails_is_a_500_and_the_endpoint_goes_on(served: MetricsEndpoint) -> None:
    class Broken(Collector):
        def collect(self) -> Iterator[Metric]:
            raise RuntimeError("broken collector")

    broken = Broken()
    served.registry.register(broken)
    base = f"http://127.0.0.1:{served.port}/metrics"
    assert httpx.get(base, timeout=30).status_code == 500
    served.registry.unregister(broken)
    assert httpx.get(base, timeout=30).status_code == 200
