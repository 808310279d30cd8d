"""Find, build and run a real ``llama-server`` for tests and benchmarks.

Mocks of the OpenAI API cannot tell us whether slot pinning, prompt-cache
reuse or grammar-constrained decoding actually work, so the integration
tests run the genuine server (a CPU build made by
``scripts/build_llama_server.sh``) against a tiny generated model. This
module hides the details: where the binary lives, which flags this version
takes, picking a free port, waiting for readiness and always killing the
process it started (by PID, never by name).
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import httpx

from fusion_graph_testing.executables import bad_explicit, find_executable, is_executable
from fusion_graph_testing.process import ManagedProcess

#: llama-cpp-python release whose vendored llama.cpp the build script compiles.
DEFAULT_LLAMA_CPP_PYTHON_VERSION = "0.3.36"

#: Loopback only: the test server is never reachable from outside the host.
HOST = "127.0.0.1"

_BUILD_SCRIPT = Path("scripts") / "build_llama_server.sh"

#: The build cache's tool-capable template that pairs with the qwen2 vocab (renders tools and tool messages).
TOOLS_TEMPLATE = "Qwen-Qwen2.5-7B-Instruct"


class LlamaServerNotBuilt(RuntimeError):
    """No ``llama-server`` binary (or its vocab files) could be found or built."""


class LlamaServerError(RuntimeError):
    """The server process failed to start or become healthy."""


def cache_dir() -> Path:
    """Directory where the build script caches binary, vocabs and templates.

    Mirrors the script: ``$FUSION_GRAPH_CACHE`` (default
    ``~/.cache/fusion-graph``) / ``llama-server-$LLAMA_CPP_PYTHON_VERSION``.
    """
    root = os.environ.get("FUSION_GRAPH_CACHE") or str(Path.home() / ".cache" / "fusion-graph")
    version = os.environ.get("LLAMA_CPP_PYTHON_VERSION") or DEFAULT_LLAMA_CPP_PYTHON_VERSION
    return Path(root).expanduser() / f"llama-server-{version}"


def find_llama_server() -> Path | None:
    """Locates a ``llama-server`` binary without building anything.

    Order: ``$LLAMA_SERVER_BIN`` (an explicit choice wins), the build cache
    (:func:`cache_dir`), then ``llama-server`` on ``PATH``.

    Returns:
        The binary's path, or None if there is none.
    """
    return find_executable("LLAMA_SERVER_BIN", cache_dir() / "bin" / "llama-server", "llama-server")


def build_script() -> Path | None:
    """The repository's build script, if this is a source checkout."""
    for parent in Path(__file__).resolve().parents:
        candidate = parent / _BUILD_SCRIPT
        if candidate.is_file():
            return candidate
    return None


def _how_to_build() -> str:
    explicit = bad_explicit("LLAMA_SERVER_BIN")
    if explicit is not None:
        return explicit
    script = build_script()
    where = str(script) if script else str(_BUILD_SCRIPT)
    return (
        f"build it with `bash {where}` (CPU, several minutes once; cached in {cache_dir()}), "
        "or point LLAMA_SERVER_BIN at an existing binary"
    )


def ensure_llama_server(build: bool = False) -> Path:
    """Returns a ``llama-server`` binary, building it first if asked to.

    Args:
        build: Run ``scripts/build_llama_server.sh`` when no binary is found.
            Off by default because the compile takes minutes.

    Raises:
        LlamaServerNotBuilt: No binary, and building was not requested or
            is impossible (no script outside a source checkout) or failed.
    """
    found = find_llama_server()
    if found is not None:
        return found
    if not build:
        raise LlamaServerNotBuilt(f"llama-server not found; {_how_to_build()}")
    script = build_script()
    if script is None:
        raise LlamaServerNotBuilt(
            f"llama-server not found and {_BUILD_SCRIPT} is not available outside a source checkout; "
            "set LLAMA_SERVER_BIN to an existing binary"
        )
    result = subprocess.run(["bash", str(script)], stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        raise LlamaServerNotBuilt(f"{script} failed with exit code {result.returncode}; see its output above")
    printed = result.stdout.strip().splitlines()
    if not printed:
        raise LlamaServerNotBuilt(f"{script} succeeded but did not print its cache directory")
    built = Path(printed[-1]) / "bin" / "llama-server"
    if not is_executable(built):
        raise LlamaServerNotBuilt(f"{script} finished but {built} is not an executable")
    return built


def vocab_dir() -> Path:
    """The ``models/`` directory (vocab GGUFs, ``templates/*.jinja``) of the build cache.

    Looked up next to the binary :func:`find_llama_server` returns, falling
    back to the cache directory (a ``LLAMA_SERVER_BIN`` from elsewhere may
    have no models beside it).

    Raises:
        LlamaServerNotBuilt: Neither location has the files.
    """
    candidates = []
    binary = find_llama_server()
    if binary is not None:
        candidates.append(binary.resolve().parent.parent / "models")
    candidates.append(cache_dir() / "models")
    for candidate in candidates:
        if any(candidate.glob("ggml-vocab-*.gguf")):
            return candidate
    raise LlamaServerNotBuilt(
        f"no llama.cpp vocab files in {' or '.join(map(str, candidates))}; {_how_to_build()}"
    )


def vocab_path(name: str = "qwen2") -> Path:
    """Path of ``ggml-vocab-<name>.gguf`` in :func:`vocab_dir`."""
    path = vocab_dir() / f"ggml-vocab-{name}.gguf"
    if not path.is_file():
        raise LlamaServerNotBuilt(f"{path} not found")
    return path


def chat_template(name: str) -> str:
    """Text of ``templates/<name>.jinja`` from :func:`vocab_dir`.

    ``Qwen-Qwen2.5-7B-Instruct`` pairs with the qwen2 vocab and supports tools.
    """
    return (vocab_dir() / "templates" / f"{name}.jinja").read_text(encoding="utf-8")


def write_chat_template(folder: Path, name: str = TOOLS_TEMPLATE) -> Path:
    """Writes :func:`chat_template` ``name`` to ``folder/<name>.jinja`` and returns that path.

    What ``--chat-template-file`` takes: every server started with a template from the
    build cache (tests, benchmarks) gets the file the same way.
    """
    path = folder / f"{name}.jinja"
    path.write_text(chat_template(name), encoding="utf-8")
    return path


@functools.cache
def _help_text(binary: Path) -> str:
    """``llama-server --help`` output, to probe which flags this build has."""
    result = subprocess.run(
        [str(binary), "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=30,
        check=False,
    )
    return result.stdout


def supports_flag(binary: Path, flag: str) -> bool:
    """Whether ``flag`` appears as an option in the binary's ``--help``."""
    text = _help_text(binary)
    return any(token.strip(",") == flag for line in text.splitlines() for token in line.split())


def free_port() -> int:
    """A TCP port on the loopback that is free right now.

    Racy by nature (someone may take it before the server binds), which is
    why :meth:`LlamaServer.start` retries on a bind failure.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


class LlamaServer(ManagedProcess):
    """One ``llama-server`` process on a free loopback port.

    Usable as ``with LlamaServer(model) as srv:`` or ``async with``, or via
    :meth:`start`/:meth:`stop`. The process is stopped by its own PID
    (SIGTERM, then SIGKILL) on exit, on :meth:`stop` and at interpreter exit.

    Attributes:
        model: The GGUF file served.
        binary: The ``llama-server`` executable.
        n_slots: Parallel slots (``-np``).
        ctx_size: Total KV context (``-c``); each slot gets ``ctx_size / n_slots``
            (llama.cpp pads that up to a multiple of 256) unless ``--kv-unified``.
        log_path: File receiving the server's stdout and stderr; kept after
            :meth:`stop` so a failure can be debugged.
    """

    def __init__(
        self,
        model: Path,
        *,
        binary: Path | None = None,
        n_slots: int = 4,
        ctx_size: int | None = None,
        threads: int = 2,
        jinja: bool = True,
        metrics: bool = True,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        startup_timeout: float = 60.0,
        port: int | None = None,
    ) -> None:
        """Configures the server; nothing starts until :meth:`start`.

        Args:
            model: GGUF model to serve (``-m``).
            binary: Executable; defaults to :func:`ensure_llama_server`.
            n_slots: ``-np``. Explicit, so the KV cache is per slot (with
                ``-np`` left on auto, llama.cpp picks 4 and a unified cache).
            ctx_size: ``-c``; defaults to ``4096 * n_slots``.
            threads: ``-t``; two keeps parallel test runs from starving.
            jinja: Pass ``--jinja`` (needed for tools and ``chat_template_kwargs``).
            metrics: Pass ``--metrics`` (Prometheus ``/metrics``).
            extra_args: Appended verbatim, after the presets, so they win.
            log_path: Where to write the server log; defaults to a temp file.
            startup_timeout: Seconds to wait for ``GET /health`` to return 200.
            port: Fixed port; by default a free one is picked per start.
        """
        self.model = Path(model)
        self.binary = Path(binary) if binary is not None else ensure_llama_server()
        self.n_slots = n_slots
        self.ctx_size = ctx_size if ctx_size is not None else 4096 * n_slots
        self.threads = threads
        self.jinja = jinja
        self.metrics = metrics
        self.extra_args = tuple(extra_args)
        self.startup_timeout = startup_timeout
        self._fixed_port = port
        self.port = port or 0
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen[bytes] | None = None

    # -- command line ------------------------------------------------------

    def args(self) -> list[str]:
        """The full command line for the current port."""
        args = [
            str(self.binary),
            "-m", str(self.model),
            "--host", HOST,
            "--port", str(self.port),
            "-np", str(self.n_slots),
            "-c", str(self.ctx_size),
            "-t", str(self.threads),
        ]  # fmt: skip
        if self.jinja:
            args.append("--jinja")
        if self.metrics:
            args.append("--metrics")
        if supports_flag(self.binary, "--slots"):
            args.append("--slots")
        args.extend(self.extra_args)
        return args

    # -- addresses ---------------------------------------------------------

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``: llama.cpp's native endpoints live here."""
        return f"http://{HOST}:{self.port}"

    @property
    def openai_base_url(self) -> str:
        """``base_url + "/v1"``, what OpenAI-compatible clients expect."""
        return f"{self.base_url}/v1"

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> Self:
        """Launches the server and blocks until ``/health`` says it is ready.

        Raises:
            LlamaServerError: The process exited or did not become healthy
                within ``startup_timeout``; the message ends with the log tail.
        """
        if self.running:
            return self
        if not self.model.is_file():
            raise LlamaServerError(f"model not found: {self.model}")
        attempts = 1 if self._fixed_port else 3
        for attempt in range(attempts):
            self.port = self._fixed_port or free_port()
            self._launch()
            try:
                self._wait_healthy()
                return self
            except LlamaServerError:
                self.stop()
                lost_race = "bind" in self.log_tail(20).lower()
                if attempt + 1 < attempts and lost_race:
                    continue
                raise
        raise AssertionError("unreachable")

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(base_url=self.base_url, timeout=2.0) as client:
            while time.monotonic() < deadline:
                assert self._proc is not None
                code = self._proc.poll()
                if code is not None:
                    raise LlamaServerError(
                        self._failure(f"llama-server exited with code {code} during startup")
                    )
                try:
                    if client.get("/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                time.sleep(0.1)
        raise LlamaServerError(self._failure(f"llama-server not healthy after {self.startup_timeout:.0f} s"))

    # -- introspection -----------------------------------------------------

    def _get(self, path: str) -> httpx.Response:
        response = httpx.get(self.base_url + path, timeout=10.0)
        response.raise_for_status()
        return response

    def health(self) -> bool:
        """Whether ``GET /health`` answers 200 (model loaded, ready for requests)."""
        try:
            return httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def props(self) -> dict[str, Any]:
        """``GET /props``: ``total_slots``, ``default_generation_settings``, the chat template."""
        data: dict[str, Any] = self._get("/props").json()
        return data

    def slots(self) -> list[dict[str, Any]]:
        """``GET /slots``: per-slot ``id``, ``n_ctx``, ``is_processing``, … (needs ``--slots``)."""
        data: list[dict[str, Any]] = self._get("/slots").json()
        return data

    def metrics_text(self) -> str:
        """``GET /metrics`` in Prometheus text format (needs ``--metrics``)."""
        return self._get("/metrics").text

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"LlamaServer({self.model.name}, {self.base_url}, np={self.n_slots}, {state})"
