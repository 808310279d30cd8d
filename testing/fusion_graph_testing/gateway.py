"""Run a real ``smg`` gateway (SGLang model gateway) in front of several llama-servers.

The gateway routes each request to one worker: with ``--policy manual`` a
routing-key header (``x-fusion-thread``) pins every request of a key to the
worker it was first assigned, and the response names the worker that served
it (``x-smg-routed-worker-id``). Tests and benchmarks use this module to start
the genuine gateway on a free loopback port, wait until every worker is
registered and healthy, and always stop the process it started (by PID, never
by name).

What was measured with smg 1.13 and llama-server:

* the request's ``model`` must equal the workers' served model id, so start
  every llama-server with ``--alias local`` and send ``"model": "local"``;
* ``GET /health`` answers 200 before any worker is registered; :meth:`Gateway.start`
  waits on ``GET /workers`` instead;
* ``/props``, ``/tokenize``, ``/apply-template`` and ``/slots`` are not proxied
  (404): ask the workers themselves;
* ``--assignment-mode min_group`` gives a new key the worker with the fewest
  routing keys *in flight* (ties at random): keys opened one after another,
  each finished before the next starts, are spread at random, and a streamed
  response stops counting once its headers are sent;
* with fast health checks (:data:`HEALTH_ARGS`) a stopped worker is marked
  unhealthy within about two seconds and its keys move to a healthy worker; a
  request that hits the dead worker before that is retried by the gateway.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import httpx

from fusion_graph_testing.executables import find_executable, require_executable
from fusion_graph_testing.llama_server import HOST, free_port
from fusion_graph_testing.process import ManagedProcess

#: How the gateway is installed (the ``pool`` extra pins ``smg``).
INSTALL_HINT = "pip install 'fusion-graph[pool]'"
#: Response header naming the worker that served the request (``http://127.0.0.1:PORT``).
ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"
#: Request header the graph puts its routing key in.
DEFAULT_ROUTING_KEY_HEADER = "x-fusion-thread"
#: Health checks every second; two failed probes (a refused connection fails at once) mark a worker
#: unhealthy, so a stopped worker is avoided within about two seconds; one good probe brings it back.
#: Later ``extra_args`` override them (argparse keeps the last value).
HEALTH_ARGS: tuple[str, ...] = (
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "2",
    "--health-success-threshold", "1",
    "--health-check-timeout-secs", "2",
)  # fmt: skip


class GatewayNotInstalled(RuntimeError):
    """No ``smg`` executable could be found."""


class GatewayError(RuntimeError):
    """The gateway process failed to start, or its workers did not become healthy."""


def find_smg() -> Path | None:
    """Locates the ``smg`` launcher without installing anything.

    Order: ``$SMG_BIN`` (an explicit choice wins), ``smg`` on ``PATH``, then
    ``smg`` next to the running interpreter (a virtualenv's ``bin/`` that is
    not on ``PATH``).

    Returns:
        The executable's path, or None if there is none.
    """
    return find_executable("SMG_BIN", "smg", Path(sys.executable).parent / "smg")


def ensure_smg() -> Path:
    """Returns the ``smg`` executable.

    Raises:
        GatewayNotInstalled: None found; the message says how to install it.
    """
    return require_executable(
        find_smg(),
        "SMG_BIN",
        GatewayNotInstalled,
        f"smg (the SGLang model gateway) not found on PATH or beside {sys.executable}; "
        f"install it with `{INSTALL_HINT}`, or point SMG_BIN at the executable",
    )


def smg_version(binary: Path) -> str:
    """``smg --version``, e.g. ``smg 1.13.0`` (``unknown`` when it prints nothing)."""
    result = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    lines = (result.stdout + result.stderr).strip().splitlines()
    return lines[-1].strip() if lines else "unknown"


def served_by(headers: Mapping[str, str] | httpx.Headers) -> str | None:
    """The worker that served a gateway response (``http://127.0.0.1:PORT``), None without the header."""
    if isinstance(headers, httpx.Headers):
        value: str | None = headers.get(ROUTED_WORKER_HEADER)
        return value
    wanted = ROUTED_WORKER_HEADER.lower()
    return next((value for name, value in headers.items() if name.lower() == wanted), None)


def _normalized(url: str) -> str:
    return url.rstrip("/")


class Gateway(ManagedProcess):
    """One ``smg launch`` process on a free loopback port, routing to ``worker_urls``.

    Usable as ``with Gateway(urls) as gw:`` or ``async with``, or via
    :meth:`start`/:meth:`stop`. The process is stopped by its own PID
    (SIGTERM, then SIGKILL) on exit, on :meth:`stop` and at interpreter exit.

    Attributes:
        worker_urls: The workers, as given (``http://127.0.0.1:PORT``).
        policy: ``--policy`` (``manual``, ``cache_aware``, ``round_robin``, ...).
        routing_key_header: Header carrying the routing key (manual policy only).
        assignment_mode: How the manual policy assigns a new key (manual only).
        binary: The ``smg`` executable.
        log_path: File receiving the gateway's stdout and stderr; kept after
            :meth:`stop` so a failure can be debugged.
    """

    def __init__(
        self,
        worker_urls: Sequence[str],
        *,
        policy: str = "manual",
        routing_key_header: str | None = DEFAULT_ROUTING_KEY_HEADER,
        assignment_mode: str | None = "min_group",
        extra_args: Sequence[str] = (),
        binary: Path | None = None,
        log_path: Path | None = None,
        startup_timeout: float = 60.0,
        settle: float = 0.5,
        port: int | None = None,
    ) -> None:
        """Configures the gateway; nothing starts until :meth:`start`.

        Args:
            worker_urls: Base URLs of the workers (each a llama-server started
                with ``--alias local``).
            policy: ``--policy``.
            routing_key_header: ``--routing-key-headers``; with ``policy="manual"``
                only (other policies ignore routing keys unless told otherwise
                through ``extra_args``). None leaves it out.
            assignment_mode: ``--assignment-mode`` (``min_group``, ``min_load``,
                ``random``); with ``policy="manual"`` only. None leaves it out.
            extra_args: Appended verbatim after the presets (:data:`HEALTH_ARGS`
                and the rest), so they win.
            binary: The ``smg`` executable; defaults to :func:`ensure_smg`.
            log_path: Where to write the gateway log; defaults to a temp file.
            startup_timeout: Seconds to wait for every worker to be listed healthy.
            settle: Seconds to wait after that before :meth:`start` returns.
            port: Fixed port; by default a free one is picked per start.
        """
        if not worker_urls:
            raise ValueError("a gateway needs at least one worker URL")
        self.worker_urls = tuple(worker_urls)
        self.policy = policy
        self.routing_key_header = routing_key_header
        self.assignment_mode = assignment_mode
        self.extra_args = tuple(extra_args)
        self.binary = Path(binary) if binary is not None else ensure_smg()
        self.startup_timeout = startup_timeout
        self.settle = settle
        self._fixed_port = port
        self.port = port or 0
        self.metrics_port = 0
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="smg-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen[bytes] | None = None

    # -- command line ------------------------------------------------------

    def args(self) -> list[str]:
        """The full command line for the current ports."""
        args = [
            str(self.binary), "launch",
            "--host", HOST,
            "--port", str(self.port),
            "--worker-urls", *self.worker_urls,
            "--policy", self.policy,
        ]  # fmt: skip
        if self.policy == "manual":
            if self.routing_key_header is not None:
                args += ["--routing-key-headers", self.routing_key_header]
            if self.assignment_mode is not None:
                args += ["--assignment-mode", self.assignment_mode]
        # Prometheus listens on 0.0.0.0:29000 by default: loopback and a port of its own instead.
        args += ["--prometheus-host", HOST, "--prometheus-port", str(self.metrics_port)]
        args += [*HEALTH_ARGS, "--shutdown-grace-period-secs", "1"]
        args.extend(self.extra_args)
        return args

    # -- addresses ---------------------------------------------------------

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``: the gateway's own endpoints (``/workers``) live here."""
        return f"http://{HOST}:{self.port}"

    @property
    def openai_base_url(self) -> str:
        """``base_url + "/v1"``, what OpenAI-compatible clients expect."""
        return f"{self.base_url}/v1"

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> Self:
        """Launches the gateway and blocks until ``GET /workers`` lists every worker healthy.

        Raises:
            GatewayError: The process exited, or not every worker was healthy
                within ``startup_timeout``; the message ends with the log tail.
        """
        if self.running:
            return self
        attempts = 1 if self._fixed_port else 3
        for attempt in range(attempts):
            self.port = self._fixed_port or free_port()
            self.metrics_port = free_port()
            self._launch()
            try:
                self.wait_for_workers(
                    lambda workers: self._all_healthy(workers),
                    timeout=self.startup_timeout,
                    what="every worker registered and healthy",
                )
                time.sleep(self.settle)
                return self
            except GatewayError:
                self.stop()
                lost_race = "address already in use" in self.log_tail(30).lower()
                if attempt + 1 < attempts and lost_race:
                    continue
                raise
        raise AssertionError("unreachable")

    def _all_healthy(self, workers: Sequence[Mapping[str, Any]]) -> bool:
        healthy = {_normalized(str(w.get("url", ""))) for w in workers if w.get("is_healthy") is True}
        return all(_normalized(url) in healthy for url in self.worker_urls)

    def wait_for_workers(
        self,
        condition: Callable[[list[dict[str, Any]]], bool],
        *,
        timeout: float = 30.0,
        what: str = "the workers to reach the expected state",
    ) -> list[dict[str, Any]]:
        """Polls ``GET /workers`` until ``condition(workers)`` holds; returns that list.

        Raises:
            GatewayError: The process exited, or the condition did not hold
                within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        seen: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            if self._proc is None:
                raise GatewayError("the gateway is not running")
            code = self._proc.poll()
            if code is not None:
                raise GatewayError(self._failure(f"smg exited with code {code}"))
            try:
                seen = self.workers()
            except (httpx.TransportError, httpx.HTTPStatusError, ValueError):
                seen = []  # not listening yet
            if condition(seen):
                return seen
            time.sleep(0.1)
        brief = [(w.get("url"), w.get("is_healthy"), w.get("status")) for w in seen]
        raise GatewayError(self._failure(f"waited {timeout:.0f} s for {what}; last /workers: {brief}"))

    def wait_worker_down(self, url: str, *, timeout: float = 30.0) -> None:
        """Waits until the gateway lists ``url`` as unhealthy, or no longer lists it.

        Raises:
            GatewayError: Still healthy after ``timeout`` seconds.
        """
        wanted = _normalized(url)

        def down(workers: list[dict[str, Any]]) -> bool:
            if not workers:
                return False  # an empty answer may be a failed poll
            return not any(
                _normalized(str(w.get("url", ""))) == wanted and w.get("is_healthy") is True for w in workers
            )

        self.wait_for_workers(down, timeout=timeout, what=f"{url} to be marked unhealthy")

    # -- introspection -----------------------------------------------------

    def workers(self) -> list[dict[str, Any]]:
        """``GET /workers``: the registered workers (``url``, ``is_healthy``, ``status``, ``load``, ...)."""
        response = httpx.get(self.base_url + "/workers", timeout=5.0)
        response.raise_for_status()
        data = response.json()
        listed = data.get("workers", []) if isinstance(data, dict) else data
        return [dict(w) for w in listed if isinstance(w, dict)]

    def healthy_workers(self) -> list[str]:
        """URLs of the workers the gateway currently routes to."""
        return [str(w["url"]) for w in self.workers() if w.get("is_healthy") is True]

    @staticmethod
    def served_by(headers: Mapping[str, str] | httpx.Headers) -> str | None:
        """The worker that served a response (:func:`served_by`)."""
        return served_by(headers)

    def worker_index(self, url: str | None) -> int | None:
        """Position of ``url`` in :attr:`worker_urls`, None when it is not one of them."""
        if url is None:
            return None
        normalized = [_normalized(u) for u in self.worker_urls]
        wanted = _normalized(url)
        return normalized.index(wanted) if wanted in normalized else None

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"Gateway({self.policy}, {self.base_url}, workers={len(self.worker_urls)}, {state})"
