"""One loopback server process a test starts: launched with its log, stopped by its own PID.

``LlamaServer``, ``Gateway``, ``RedisServer``, ``LangGraphWorker``, ``GraphWorker``,
``Phoenix`` and ``Prometheus`` share this lifecycle; each says how it starts (``start``: a
free port, then its own readiness check, ``_await_ready`` where that is a plain poll), what it
runs (``args``) and, where it needs them, its environment and working directory
(``launch_env``, ``launch_cwd``).
"""

from __future__ import annotations

import asyncio
import atexit
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Self


class ManagedProcess:
    """A process this object launched, its log file, and stopping it (also at interpreter exit)."""

    log_path: Path
    _proc: subprocess.Popen[bytes] | None = None

    def args(self) -> list[str]:
        """The command line."""
        raise NotImplementedError

    def start(self) -> Self:
        """Launch and wait until ready."""
        raise NotImplementedError

    def launch_env(self) -> Mapping[str, str] | None:
        """The process's whole environment; None (the default) inherits this interpreter's."""
        return None

    def launch_cwd(self) -> Path | None:
        """The process's working directory; None (the default) is this interpreter's."""
        return None

    @property
    def pid(self) -> int | None:
        """PID of the running process, None when not started."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the process was started and has not exited."""
        return self._proc is not None and self._proc.poll() is None

    def _launch(self) -> None:
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(self.args())}\n".encode())
            log.flush()
            env = self.launch_env()
            self._proc = subprocess.Popen(
                self.args(),
                env=dict(env) if env is not None else None,
                cwd=self.launch_cwd(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C in the test runner is ours to handle
            )
        atexit.register(self.stop)

    def _failure(self, what: str) -> str:
        return f"{what}; command: {' '.join(self.args())}\nlog {self.log_path}:\n{self.log_tail()}"

    def _await_ready(
        self, ready: Callable[[], bool], *, name: str, timeout: float, poll_s: float, error: type[Exception]
    ) -> None:
        """Poll ``ready`` until it holds.

        Raises ``error`` (with the log's tail) when the process exits first, or
        when ``timeout`` passes; then the process is stopped first.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise error(self._failure(f"{name} exited with code {self._proc.returncode}"))
            if ready():
                return
            time.sleep(poll_s)
        self.stop()
        raise error(self._failure(f"{name} did not answer within {timeout:.0f} s"))

    def stop(self, timeout: float = 10.0) -> None:
        """Terminates the process (SIGTERM, then SIGKILL after ``timeout`` s).

        Idempotent; only ever signals the PID this object started.
        """
        atexit.unregister(self.stop)
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)

    def kill(self, timeout: float = 10.0) -> int | None:
        """Kills the process with SIGKILL, as a crash or the OOM killer would; returns its exit code.

        No shutdown handler runs: what the process held (a run, a lock, a
        heartbeat) is left for others to notice. Only ever signals the PID this
        object started; None when it was not running.
        """
        atexit.unregister(self.stop)
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        return proc.wait(timeout=timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.stop)

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the process log."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
