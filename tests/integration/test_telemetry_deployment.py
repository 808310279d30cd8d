"""A real Prometheus scraping a two-worker LangGraph server: what PromQL sums equals the threads' route logs.

Each worker process serves ``/metrics`` on its own ``FUSION_METRICS_PORT`` (one
scrape target per worker, as an operator configures it); the turns go through
both workers' APIs, on a fake cloud with a price and the real llama-server.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from langgraph_sdk import get_client

from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from fusion_graph_testing.llama_server import LlamaServer, free_port
from fusion_graph_testing.prometheus import Prometheus, PrometheusNotInstalled, ensure_prometheus
from tests.integration.test_langgraph_server_harness import Turn, assistant_of, bounded
from tests.plugins.langgraph_server import StartServer
from tests.plugins.requires import service_missing

KEY = "sk-operator-key-never-in-a-metric"
#: Local turns (every step on the tiny model) and default ones (the plan on the fake cloud).
LOCAL = {"mode": "local", "max_completion_tokens": 16, "sub_runners": "off"}
FUSION = {"max_completion_tokens": 16, "sub_runners": "off"}
SCRAPE_S = 1.0
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def prometheus_bin() -> Path:
    """The ``prometheus`` executable, or skip/fail (under ``CI=true``) when it is missing."""
    try:
        return ensure_prometheus()
    except PrometheusNotInstalled as exc:
        missing = str(exc)
    service_missing(missing, fix="apt-get install prometheus")


@pytest.fixture
def prometheus_factory(prometheus_bin: Path, tmp_path: Path) -> Iterator[Any]:
    started: list[Prometheus] = []

    def start(targets: list[str]) -> Prometheus:
        server = Prometheus(targets, tmp_path / "prometheus", interval_s=SCRAPE_S, binary=prometheus_bin)
        started.append(server.start())
        return server

    yield start
    for server in started:
        server.stop()


def report_json(*args: str, **env: str) -> dict[str, Any]:
    """``fusion-graph report ... --json``, as an operator runs it (a process of its own)."""
    import json
    import os
    import subprocess
    import tempfile

    done = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "fusion-graph"), "report", *args, "--json"],
        capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir(),
        env={**{k: v for k, v in os.environ.items() if not k.startswith("FUSION_")}, **env},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data: dict[str, Any] = json.loads(done.stdout)
    return data


def total(prometheus: Prometheus, promql: str) -> float:
    return float(sum(r["value"] for r in prometheus.query(promql)))


def settle(prometheus: Prometheus, promql: str, want: float, timeout_s: float = 30.0) -> float:
    """``promql``'s value once it reaches ``want`` (scrapes lag), else the last value seen."""
    deadline = time.monotonic() + timeout_s
    seen = total(prometheus, promql)
    while abs(seen - want) > 1e-9 and time.monotonic() < deadline:
        time.sleep(SCRAPE_S / 2)
        seen = total(prometheus, promql)
    return seen


async def test_prometheus_sums_over_both_workers_equal_the_threads_route_logs(
    start_langgraph_server: StartServer,
    llama_server_9: LlamaServer,
    prometheus_factory: Any,
) -> None:
    ports = [free_port(), free_port()]
    with FakeOpenAI(lambda body: Reply(content="cloud answer", prompt_tokens=120)) as cloud:
        server = start_langgraph_server(
            {
                "OPENAI_API_KEY": KEY,
                "FUSION_SHARED_STATE": "postgres",
                "FUSION_METRICS": "true",
                "FUSION_CLOUD_MODEL": "c",
                "FUSION_PRICE_OVERRIDES": '{"c": [10.0, 10.0, 1.0]}',
                "FUSION_CLOUD_BASE_URL": cloud.base_url,
                "FUSION_LOCAL_BASE_URL": llama_server_9.openai_base_url,
            },
            workers=2,
            worker_env=[{"FUSION_METRICS_PORT": str(port)} for port in ports],
        )
        targets = [f"127.0.0.1:{port}" for port in ports]
        prometheus = prometheus_factory(targets)
        clients: list[Any] = [get_client(url=url) for url in server.urls]
        assistant = await assistant_of(clients[0])
        threads = [(await clients[0].threads.create())["thread_id"] for _ in range(6)]
        for k in range(2):
            turns = [
                Turn(
                    clients[(i + k) % 2],
                    assistant,
                    t,
                    f"turn {k} of thread {i}",
                    "wait",
                    LOCAL if i % 2 else FUSION,
                )
                for i, t in enumerate(threads)
            ]
            await bounded(asyncio.gather(*(turn.run() for turn in turns)), f"turn {k}", server)
        states = [await clients[0].threads.get_state(t) for t in threads]
        scraped = [httpx.get(f"http://{target}/metrics", timeout=10).text for target in targets]
    log = [record for state in states for record in state["values"]["route_log"]]
    by_leg = Counter(r["leg"] for r in log)
    assert by_leg["cloud"] > 0 and by_leg["local"] > 0
    # Both workers answered turns and are scraped; PromQL sums them as the dashboard does.
    assert all(text.count("fusion_inferences_total{") > 0 for text in scraped)
    assert settle(prometheus, "count(up == 1)", 2) == 2, prometheus.scraped_up()
    counted = settle(prometheus, "sum(fusion_inferences_total)", len(log))
    assert counted == len(log)
    for leg, n in by_leg.items():
        assert total(prometheus, f'sum(fusion_inferences_total{{leg="{leg}"}})') == n
    cost = sum(r["cost_usd"] or 0.0 for r in log)
    assert total(prometheus, "sum(fusion_cost_usd_total)") == pytest.approx(cost)
    for leg in ("cloud", "local"):
        prompt = sum(r["prompt_tokens"] or 0 for r in log if r["leg"] == leg)
        assert total(prometheus, f'sum(fusion_tokens_total{{leg="{leg}",type="prompt"}})') == prompt
    cloud_share = total(
        prometheus,
        'sum(fusion_inferences_total{leg="cloud"}) / sum(fusion_inferences_total)',
    )
    assert cloud_share == pytest.approx(by_leg["cloud"] / len(log))
    assert not [text for text in scraped if KEY in text]

    # The deployment's report, over every thread in the server's Postgres, says the same.
    report = report_json(
        "--postgres", server.database_url, "--assistant", "fusion", "--since", "1h", "--margin", "0.1",
        FUSION_CLOUD_MODEL="c", FUSION_PRICE_OVERRIDES='{"c": [10.0, 10.0, 1.0]}',
    )  # fmt: skip
    assert sorted(report["threads"]) == sorted(threads)
    assert report["totals"]["cost_usd"] == pytest.approx(cost)
    assert sum(row["steps"] for row in report["threads"].values()) == sum(
        1 for r in log if r["kind"] in ("plan", "step")
    )
    assert report["savings_usd"] is not None and report["savings_usd"] > 0  # local turns cost nothing
    assert report["shadow"]["non_inferiority"]["margin"] == 0.1
    assert report_json("--postgres", server.database_url, "--assistant", "no-such-graph")["threads"] == {}
