"""A real OTLP receiver: Arize Phoenix (``phoenix serve``), its spans read back through its REST API.

Phoenix lives in a virtualenv of its own (``.venv-phoenix``, made by
``scripts/setup.sh``): its dependencies would pin the test environment's.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

import httpx

from fusion_graph_testing.llama_server import free_port
from fusion_graph_testing.process import ManagedProcess

HOST = "127.0.0.1"


class PhoenixNotInstalled(RuntimeError):
    """No ``phoenix`` executable: run ``scripts/setup.sh`` (it makes ``.venv-phoenix``)."""


class PhoenixError(RuntimeError):
    """Phoenix did not start, or a read failed."""


def ensure_phoenix(root: Path | None = None) -> Path:
    """``.venv-phoenix/bin/phoenix`` of the checkout at ``root``, else ``phoenix`` on ``PATH``.

    Raises:
        PhoenixNotInstalled: Neither exists.
    """
    if root is not None and (root / ".venv-phoenix" / "bin" / "phoenix").is_file():
        return root / ".venv-phoenix" / "bin" / "phoenix"
    found = shutil.which("phoenix")
    if found is None:
        raise PhoenixNotInstalled("Arize Phoenix is not installed (scripts/setup.sh makes .venv-phoenix)")
    return Path(found)


class Phoenix(ManagedProcess):
    """One ``phoenix serve`` on free loopback ports (HTTP with OTLP at ``/v1/traces``, and gRPC).

    Attributes:
        data_dir: Its working directory (its SQLite database).
        log_path: Its log; kept after :meth:`stop`.
    """

    def __init__(self, data_dir: Path, *, binary: Path, startup_timeout: float = 120.0) -> None:
        """Configures the server; nothing starts until :meth:`start`."""
        self.binary = binary
        self.data_dir = Path(data_dir)
        self.log_path = self.data_dir / "phoenix.log"
        self.startup_timeout = startup_timeout
        self.port = 0
        self.grpc_port = 0
        self._proc = None

    def args(self) -> list[str]:
        """The command line."""
        return [str(self.binary), "serve"]

    def launch_env(self) -> Mapping[str, str] | None:
        """Its ports and folder; nothing of the test runner's OpenTelemetry settings."""
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PHOENIX_"))}
        return {
            **inherited,
            "PHOENIX_WORKING_DIR": str(self.data_dir),
            "PHOENIX_HOST": HOST,
            "PHOENIX_PORT": str(self.port),
            "PHOENIX_GRPC_PORT": str(self.grpc_port),
        }

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``: OTLP/HTTP at ``/v1/traces``, the REST API under ``/v1``."""
        return f"http://{HOST}:{self.port}"

    def ready(self) -> bool:
        """Whether ``/healthz`` answers 200."""
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self) -> Self:
        """Launches Phoenix and blocks until it answers.

        Raises:
            PhoenixError: It exited or did not answer within ``startup_timeout``.
        """
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port, self.grpc_port = free_port(), free_port()
        self._launch()
        self._await_ready(
            self.ready, name="phoenix", timeout=self.startup_timeout, poll_s=0.5, error=PhoenixError
        )
        return self

    def spans(self, project: str) -> list[dict[str, Any]]:
        """Every span Phoenix holds for ``project`` (all pages)."""
        spans: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 1000, **({"cursor": cursor} if cursor else {})}
            answer = httpx.get(f"{self.url}/v1/projects/{project}/spans", params=params, timeout=10.0)
            if answer.status_code == 404:
                return spans  # no span of the project arrived yet
            answer.raise_for_status()
            body = answer.json()
            spans.extend(body.get("data", []))
            cursor = body.get("next_cursor")
            if not cursor:
                return spans
