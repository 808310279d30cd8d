"""A real Prometheus server scraping given targets, read back through its HTTP query API.

The deployment tests scrape each LangGraph server worker's ``/metrics`` as an
operator's Prometheus would (one target per worker process) and compare what
PromQL sums with the threads' route logs.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import httpx

from fusion_graph_testing.llama_server import free_port
from fusion_graph_testing.process import ManagedProcess

HOST = "127.0.0.1"


class PrometheusNotInstalled(RuntimeError):
    """No ``prometheus`` executable was found (Debian: ``apt-get install prometheus``)."""


class PrometheusError(RuntimeError):
    """Prometheus did not start, or a query failed."""


def ensure_prometheus() -> Path:
    """The ``prometheus`` executable on ``PATH``.

    Raises:
        PrometheusNotInstalled: There is none.
    """
    found = shutil.which("prometheus")
    if found is None:
        raise PrometheusNotInstalled("prometheus is not installed (apt-get install prometheus)")
    return Path(found)


class Prometheus(ManagedProcess):
    """One Prometheus on a free loopback port scraping ``targets`` (``host:port``) every ``interval_s``.

    Attributes:
        targets: What it scrapes, each at ``/metrics``.
        data_dir: Its configuration and its TSDB.
        log_path: Its log; kept after :meth:`stop`.
    """

    def __init__(
        self,
        targets: Sequence[str],
        data_dir: Path,
        *,
        interval_s: float = 1.0,
        binary: Path | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        """Configures the server; nothing starts until :meth:`start`."""
        self.binary = Path(binary) if binary is not None else ensure_prometheus()
        self.targets = list(targets)
        self.data_dir = Path(data_dir)
        self.log_path = self.data_dir / "prometheus.log"
        self.interval_s = interval_s
        self.startup_timeout = startup_timeout
        self.port = 0
        self._proc = None

    @property
    def config_path(self) -> Path:
        """Its ``prometheus.yml``."""
        return self.data_dir / "prometheus.yml"

    def args(self) -> list[str]:
        """The command line for the current port."""
        return [
            str(self.binary),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
            f"--web.listen-address={HOST}:{self.port}",
            "--log.level=warn",
        ]

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``: the query API is under ``/api/v1``."""
        return f"http://{HOST}:{self.port}"

    def write_config(self) -> None:
        """The scrape configuration: one job, every target, scraped every ``interval_s``."""
        targets = ", ".join(f"'{t}'" for t in self.targets)
        self.config_path.write_text(
            "global:\n"
            f"  scrape_interval: {self.interval_s:g}s\n"
            f"  scrape_timeout: {self.interval_s:g}s\n"
            "scrape_configs:\n"
            "  - job_name: fusion-graph\n"
            "    metrics_path: /metrics\n"
            f"    static_configs:\n      - targets: [{targets}]\n",
            encoding="utf-8",
        )

    def ready(self) -> bool:
        """Whether ``/-/ready`` answers 200."""
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self) -> Self:
        """Writes the configuration, launches Prometheus and blocks until it is ready.

        Raises:
            PrometheusError: It exited or was not ready within ``startup_timeout``.
        """
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.write_config()
        self.port = free_port()
        self._launch()
        self._await_ready(
            self.ready, name="prometheus", timeout=self.startup_timeout, poll_s=0.2, error=PrometheusError
        )
        return self

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector ``promql`` evaluates to now: ``[{"metric": labels, "value": float}]``.

        Raises:
            PrometheusError: The query was refused (its error says why).
        """
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10.0).json()
        if answer.get("status") != "success":
            raise PrometheusError(f"{promql}: {answer.get('errorType')}: {answer.get('error')}")
        data = answer["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": float(data["result"][1])}]
        return [{"metric": r["metric"], "value": float(r["value"][1])} for r in data["result"]]

    def scraped_up(self) -> dict[str, bool]:
        """Each target's last scrape: up or not, by its ``instance`` label."""
        return {r["metric"]["instance"]: r["value"] == 1.0 for r in self.query("up")}
