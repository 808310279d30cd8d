"""Run the graph on a real multi-process LangGraph server: several ``langhost serve`` workers.

The deployment under test is the stock LangGraph server (``langgraph-api``) on
Postgres and Redis, several worker processes sharing one run queue: a run of a
thread goes to whichever worker is free, checkpoints live in Postgres, Redis
carries the queue's wake-ups, run streams, cancels and each running run's
heartbeat. ``langgraph dev`` (one in-memory process) cannot show what that
deployment does to a thread: turns that land in different processes, a worker
killed mid-run whose run another worker takes over. :class:`LangGraphServer`
starts exactly that on loopback: a ``redis-server`` of its own (no
persistence), then N ``langhost serve`` processes (``langhost``, MIT, over
``langgraph-runtime-pg``), each on its own free port, against a Postgres the
caller provides, serving the graph named in the project's ``langgraph.json``.
Every process is started and stopped (or SIGKILLed) by its own PID, its log
kept for failure messages.

What was measured with langhost / langgraph-runtime-pg 0.11.1.post1 (it pins
``langgraph-api==0.11.1`` and ``langgraph-checkpoint-postgres==3.1.0``, older
than the dev environment's, hence its own virtualenv ``.venv-server``):

* the ``langhost`` executable comes from the ``langhost`` distribution;
  ``langgraph-runtime-pg`` only ships the runtime and ``langgraph-runtime-pg-migrate``;
* ``DATABASE_URI`` goes to asyncpg (through SQLAlchemy), which refuses libpq's
  ``connect_timeout`` (a worker dies at its first query), so
  :func:`server_database_url` drops it;
* each worker runs the schema migrations and the checkpointer's set-up at start;
  started together they race on the DDL, so worker 0 is started (and ready) first;
* ``langgraph_api`` silently moves to another port when the one asked for is
  taken; :meth:`LangGraphWorker.start` notices and retries on a new one;
* a killed worker's run is re-queued by a live worker's sweep once the run's
  Redis heartbeat key expires (``2 x LG_BG_JOB_HEARTBEAT``, at least 4 s); the
  sweep runs only while that worker has a free job slot
  (``N_JOBS_PER_WORKER``, ``--n-jobs-per-worker``, 1 by default); the retry is
  attempt 2 of the same run id and resumes from the thread's last checkpoint;
* with ``LOG_JSON=true`` every line is a JSON object; a run's lines carry
  ``run_id``, ``run_attempt`` and ``thread_id``; ``Starting background run``
  opens an attempt and ``Background run succeeded`` (or ``... failed``, ...)
  closes it. The lines name no process, but each worker writes its own log, so
  the log a line is in says which worker ran the attempt (:meth:`LangGraphServer.run_attempts`);
* the server refuses ``config={"configurable": ...}`` together with ``context=``
  on one run (HTTP 400): send one of them.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx

from fusion_graph_testing.executables import find_executable, require_executable
from fusion_graph_testing.llama_server import HOST, free_port
from fusion_graph_testing.process import ManagedProcess

#: The virtualenv ``scripts/setup.sh`` builds for the server (its pins clash with the dev extra's).
SERVER_VENV = ".venv-server"
#: How the server is installed.
INSTALL_HINT = (
    f"run `bash scripts/setup.sh` (it creates {SERVER_VENV} with `pip install langhost -e .`), "
    "or point LANGHOST_BIN at a `langhost` executable"
)
REDIS_INSTALL_HINT = (
    "install the Debian 'redis-server' package (scripts/setup.sh does), or set REDIS_SERVER_BIN"
)
#: Seconds between a running run's heartbeats; its key expires after twice that (at least 4 s),
#: and only then does another worker take the run over. The server's default is minutes.
DEFAULT_HEARTBEAT_S = 2.0
#: Settings every worker gets unless the caller's ``env`` says otherwise.
DEFAULT_WORKER_ENV: Mapping[str, str] = {
    # No call to PyPI (version check), LangSmith (tracing) or analytics: loopback traffic only.
    "LANGGRAPH_NO_VERSION_CHECK": "true",
    "LANGSMITH_TRACING": "false",
    "LANGCHAIN_TRACING_V2": "false",
    "LANGGRAPH_CLI_NO_ANALYTICS": "1",
    # SQLAlchemy's pool (20 + 20 overflow by default) beside psycopg's (10): keep a few workers
    # well inside a test cluster's max_connections.
    "PG_POOL_SIZE": "5",
    "PG_MAX_OVERFLOW": "5",
}
#: Set by the harness whatever ``env`` says: the logs must be JSON for :meth:`LangGraphServer.run_attempts`.
FORCED_WORKER_ENV: Mapping[str, str] = {"LOG_JSON": "true", "LOG_COLOR": "false"}
#: Query parameters of a libpq URL that asyncpg's ``connect()`` refuses.
ASYNCPG_REFUSED_PARAMS = frozenset({"connect_timeout"})
#: Log event that opens a run attempt.
RUN_STARTED_EVENT = "Starting background run"
#: How the log event that closes an attempt begins, and the outcome it stands for (first match wins).
RUN_END_EVENTS: tuple[tuple[str, str], ...] = (
    ("Background run succeeded", "success"),
    ("Background run failed, will retry", "retry"),
    ("Background run failed", "error"),
    ("Background run timed out", "timeout"),
    ("Background run interrupted", "interrupted"),
    ("Background run rolled back", "rollback"),
)
_PORT_MOVED = "already in use, using port"


class LangGraphServerNotInstalled(RuntimeError):
    """No ``langhost`` or no ``redis-server`` executable could be found."""


class LangGraphServerError(RuntimeError):
    """A server process failed to start, died, or a run did not show up in the logs in time."""


def source_root() -> Path | None:
    """The source checkout this module lives in (the folder with ``langgraph.json``), if any."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "langgraph.json").is_file() and (parent / "testing").is_dir():
            return parent
    return None


def find_langhost() -> Path | None:
    """Locates the ``langhost`` launcher without installing anything.

    Order: ``$LANGHOST_BIN`` (an explicit choice wins), the source checkout's
    ``.venv-server/bin/langhost`` (what ``scripts/setup.sh`` builds), ``langhost``
    beside the running interpreter, then on ``PATH``.

    Returns:
        The executable's path, or None if there is none.
    """
    root = source_root()
    checkout = [root / SERVER_VENV / "bin" / "langhost"] if root is not None else []
    return find_executable("LANGHOST_BIN", *checkout, Path(sys.executable).parent / "langhost", "langhost")


def ensure_langhost() -> Path:
    """Returns the ``langhost`` executable.

    Raises:
        LangGraphServerNotInstalled: None found; the message says how to install it.
    """
    return require_executable(
        find_langhost(),
        "LANGHOST_BIN",
        LangGraphServerNotInstalled,
        f"langhost (the LangGraph server on Postgres + Redis) not found; {INSTALL_HINT}",
    )


def find_redis_server() -> Path | None:
    """``$REDIS_SERVER_BIN``, else ``redis-server`` on ``PATH``, else ``/usr/bin/redis-server``."""
    return find_executable("REDIS_SERVER_BIN", "redis-server", Path("/usr/bin/redis-server"))


def ensure_redis_server() -> Path:
    """Returns the ``redis-server`` executable.

    Raises:
        LangGraphServerNotInstalled: None found; the message says how to install it.
    """
    return require_executable(
        find_redis_server(),
        "REDIS_SERVER_BIN",
        LangGraphServerNotInstalled,
        f"redis-server not found; {REDIS_INSTALL_HINT}",
    )


def server_database_url(url: str) -> str:
    """``url`` without the libpq-only query parameters asyncpg refuses (``connect_timeout``).

    The runtime hands ``DATABASE_URI`` to both psycopg (checkpoints) and
    asyncpg (runs, threads); ``tests/plugins/postgres.py`` adds
    ``connect_timeout``, which psycopg takes and asyncpg rejects.
    """
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    kept = [(key, value) for key, value in query if key not in ASYNCPG_REFUSED_PARAMS]
    return urlunsplit(parts._replace(query=urlencode(kept)))


def graphs_of(config_path: Path) -> dict[str, str]:
    """The ``graphs`` of a ``langgraph.json``, each path made absolute against the file's folder.

    The workers run in a folder of their own (no ``.env`` of the checkout is read
    there), so ``./fusion_graph/agent.py:graph`` must not depend on the working directory.
    """
    data = json.loads(config_path.read_text(encoding="utf-8"))
    graphs = data.get("graphs")
    if not isinstance(graphs, dict) or not graphs:
        raise LangGraphServerError(f"{config_path} names no graphs")
    resolved = {}
    for name, spec in graphs.items():
        path, sep, attr = str(spec).partition(":")
        absolute = (config_path.parent / path).resolve() if not Path(path).is_absolute() else Path(path)
        resolved[str(name)] = f"{absolute}{sep}{attr}"
    return resolved


@dataclass(frozen=True)
class RunAttempt:
    """One attempt at a run, as the worker that ran it logged it.

    Attributes:
        worker: Index of the worker whose log holds the attempt.
        run_id: The run.
        attempt: ``run_attempt`` (1, then 2 for a run taken over after its worker died, ...).
        thread_id: The run's thread.
        started_at: Timestamp of the ``Starting background run`` line (ISO, UTC).
        outcome: ``success``, ``error``, ``retry``, ``timeout``, ``interrupted``, ``rollback``;
            None while running, or when the worker died before it could say.
    """

    worker: int
    run_id: str
    attempt: int
    thread_id: str | None
    started_at: str
    outcome: str | None


def read_json_log(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a log, one a line; other lines (banners, a line cut by a kill) are skipped."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _outcome(event: str) -> str | None:
    return next((outcome for prefix, outcome in RUN_END_EVENTS if event.startswith(prefix)), None)


def attempts_in(records: Sequence[Mapping[str, Any]], worker: int) -> list[RunAttempt]:
    """Every run attempt one worker's log records, in log order, each with its outcome."""
    opened: dict[tuple[str, int], RunAttempt] = {}
    for record in records:
        run_id, event = record.get("run_id"), str(record.get("event", ""))
        if run_id is None:
            continue
        key = (str(run_id), int(record.get("run_attempt") or 0))
        if event == RUN_STARTED_EVENT:
            opened[key] = RunAttempt(
                worker=worker,
                run_id=key[0],
                attempt=key[1],
                thread_id=str(record["thread_id"]) if record.get("thread_id") else None,
                started_at=str(record.get("timestamp", "")),
                outcome=None,
            )
        elif (outcome := _outcome(event)) is not None and key in opened:
            start = opened[key]
            opened[key] = RunAttempt(
                start.worker, start.run_id, start.attempt, start.thread_id, start.started_at, outcome
            )
    return list(opened.values())


class RedisServer(ManagedProcess):
    """One ``redis-server`` on a free loopback port, no persistence, its files in ``data_dir``.

    Attributes:
        binary: The ``redis-server`` executable.
        data_dir: Its working directory (nothing is saved there: no RDB, no AOF).
        log_path: Its log; kept after :meth:`stop`.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        binary: Path | None = None,
        log_path: Path | None = None,
        startup_timeout: float = 30.0,
    ) -> None:
        """Configures the server; nothing starts until :meth:`start`."""
        self.binary = Path(binary) if binary is not None else ensure_redis_server()
        self.data_dir = Path(data_dir)
        self.log_path = Path(log_path) if log_path is not None else self.data_dir / "redis.log"
        self.startup_timeout = startup_timeout
        self.port = 0
        self._proc = None

    def args(self) -> list[str]:
        """The command line for the current port."""
        return [
            str(self.binary),
            "--bind", HOST,
            "--port", str(self.port),
            "--protected-mode", "yes",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.data_dir),
            "--daemonize", "no",
            "--logfile", "",
        ]  # fmt: skip

    def launch_cwd(self) -> Path | None:
        """Its data folder (never the test runner's)."""
        return self.data_dir

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``, what ``REDIS_URI`` takes."""
        return f"redis://{HOST}:{self.port}/0"

    def ping(self) -> bool:
        """Whether the server answers ``PING`` with ``+PONG``."""
        try:
            with socket.create_connection((HOST, self.port), timeout=2.0) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def start(self) -> Self:
        """Launches the server and blocks until it answers ``PING``.

        Raises:
            LangGraphServerError: It exited or did not answer within ``startup_timeout``.
        """
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):
            self.port = free_port()
            self._launch()
            deadline = time.monotonic() + self.startup_timeout
            failure = f"redis-server did not answer PING within {self.startup_timeout:.0f} s"
            while time.monotonic() < deadline:
                assert self._proc is not None
                code = self._proc.poll()
                if code is not None:
                    failure = f"redis-server exited with code {code}"
                    break
                if self.ping():
                    return self
                time.sleep(0.1)
            message = self._failure(failure)
            self.stop()
            if attempt < 2 and "address already in use" in message.lower():
                continue
            raise LangGraphServerError(message)
        raise AssertionError("unreachable")


class LangGraphWorker(ManagedProcess):
    """One ``langhost serve`` process on a loopback port: a full server and a consumer of the queue.

    Attributes:
        index: Its position in the :class:`LangGraphServer`.
        binary: The ``langhost`` executable.
        config_path: The ``langgraph.json`` it serves.
        env: Its whole environment.
        workdir: Its working directory.
        jobs: Runs it executes at once (``--n-jobs-per-worker``).
        port: Its port (0 before the first start); kept across restarts where possible.
        log_path: Its log (JSON lines), appended to across restarts.
    """

    def __init__(
        self,
        index: int,
        *,
        binary: Path,
        config_path: Path,
        env: Mapping[str, str],
        workdir: Path,
        log_path: Path,
        jobs: int = 1,
        startup_timeout: float = 180.0,
    ) -> None:
        """Configures the worker; nothing starts until :meth:`start`."""
        self.index = index
        self.binary = binary
        self.config_path = config_path
        self.env = dict(env)
        self.workdir = workdir
        self.log_path = log_path
        self.jobs = jobs
        self.startup_timeout = startup_timeout
        self.port = 0
        self._log_offset = 0
        self._proc = None

    def args(self) -> list[str]:
        """The command line for the current port."""
        return [
            str(self.binary), "serve",
            "--host", HOST,
            "--port", str(self.port),
            "--config", str(self.config_path),
            "--n-jobs-per-worker", str(self.jobs),
            "--server-log-level", "info",
        ]  # fmt: skip

    def launch_env(self) -> Mapping[str, str] | None:
        """:attr:`env`, exactly."""
        return self.env

    def launch_cwd(self) -> Path | None:
        """:attr:`workdir`: no ``.env`` of the checkout is loaded by langhost or the graph's settings."""
        return self.workdir

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, what ``langgraph_sdk.get_client(url=...)`` takes."""
        return f"http://{HOST}:{self.port}"

    def launch(self) -> None:
        """Starts the process on :attr:`port` (a free one if unset) without waiting for it."""
        if self.running:
            return
        if not self.port:
            self.port = free_port()
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._launch()

    def _port_moved(self) -> bool:
        """Whether this launch logged that its port was taken (earlier launches' lines are not read)."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_offset)
                return _PORT_MOVED.encode() in log.read()
        except OSError:
            return False

    def ready(self) -> bool:
        """Whether ``GET /ok`` answers 200 (the graph is loaded, the queue consumer started)."""
        try:
            return httpx.get(self.url + "/ok", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self) -> None:
        """Blocks until ``GET /ok`` answers 200.

        Raises:
            LangGraphServerError: The process exited, moved to another port, or
                was not ready within ``startup_timeout``; the message ends with the log tail.
        """
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self._proc is None:
                    raise LangGraphServerError(f"worker {self.index} is not running")
                code = self._proc.poll()
                if code is not None:
                    raise LangGraphServerError(self._failure(f"worker {self.index} exited with code {code}"))
                if self._port_moved():
                    raise LangGraphServerError(self._failure(f"port {self.port} was taken ({_PORT_MOVED})"))
                try:
                    if client.get("/ok").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                time.sleep(0.2)
        raise LangGraphServerError(
            self._failure(f"worker {self.index} not ready after {self.startup_timeout:.0f} s")
        )

    def start(self) -> Self:
        """Launches the worker and blocks until it is ready; a taken port is swapped for a free one.

        Raises:
            LangGraphServerError: It did not become ready (see :meth:`wait_ready`).
        """
        if self.running:
            return self
        self.launch()
        self.wait_started()
        return self

    def wait_started(self, attempts: int = 3) -> None:
        """:meth:`wait_ready` for a launched worker; on a lost port race, relaunches on a free port.

        Raises:
            LangGraphServerError: It did not become ready (see :meth:`wait_ready`).
        """
        for attempt in range(attempts):
            try:
                self.wait_ready()
                return
            except LangGraphServerError as error:
                self.stop()
                lost_race = _PORT_MOVED in str(error) or "address already in use" in str(error).lower()
                if attempt + 1 < attempts and lost_race:
                    self.port = free_port()
                    self.launch()
                    continue
                raise

    def records(self) -> list[dict[str, Any]]:
        """Every JSON line of its log, over all its restarts."""
        return read_json_log(self.log_path)

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"LangGraphWorker({self.index}, {self.url}, {state})"


class LangGraphServer:
    """N ``langhost serve`` workers sharing a run queue on one Postgres and their own Redis.

    Usable as ``with LangGraphServer(url, env=...) as server:`` or via
    :meth:`start`/:meth:`close`. Every process is stopped by its own PID on
    exit, on :meth:`close` and at interpreter exit; the logs stay in
    :attr:`log_dir` for failure messages.

    Attributes:
        database_url: The Postgres the workers share (as given; see :func:`server_database_url`).
        n_workers: How many worker processes.
        config_path: The project's ``langgraph.json`` (its graphs are served).
        log_dir: Logs (``worker-N.log``, ``redis.log``), the generated ``langgraph.json``,
            Redis's folder and the workers' working directory.
        redis: The Redis server (started by :meth:`start`).
        workers: The worker processes, by index.
    """

    def __init__(
        self,
        database_url: str,
        *,
        workers: int = 2,
        env: Mapping[str, str] | None = None,
        config_path: Path | None = None,
        jobs_per_worker: int = 1,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        langhost: Path | None = None,
        redis_server: Path | None = None,
        log_dir: Path | None = None,
        startup_timeout: float = 180.0,
        auth: Mapping[str, Any] | None = None,
        worker_env: Sequence[Mapping[str, str]] = (),
    ) -> None:
        """Configures the server; nothing starts until :meth:`start`.

        Args:
            database_url: A libpq URL of an (empty or earlier-migrated) database.
            workers: Worker processes to start.
            env: The graph's settings (``FUSION_*``, the cloud key's variable, ...) and any
                server settings; they win over :data:`DEFAULT_WORKER_ENV` and the inherited
                environment (whose ``FUSION_*`` variables are dropped), but not over
                ``DATABASE_URI``, ``REDIS_URI`` and :data:`FORCED_WORKER_ENV`.
            config_path: The ``langgraph.json`` whose graphs are served; default: the source
                checkout's. Its folder goes first on the workers' ``PYTHONPATH``, so the
                graph's package is imported from that tree.
            jobs_per_worker: Runs each worker executes at once (``N_JOBS_PER_WORKER``); with 1 a
                busy worker leaves every queued run to the others.
            heartbeat_s: ``LG_BG_JOB_HEARTBEAT``: how soon a dead worker's run is taken over
                (its heartbeat key lasts twice this, at least 4 s).
            langhost: The ``langhost`` executable; default :func:`ensure_langhost`.
            redis_server: The ``redis-server`` executable; default :func:`ensure_redis_server`.
            log_dir: Where logs and generated files go; default a fresh temp folder.
            startup_timeout: Seconds each worker may take to answer ``GET /ok``.
            auth: The served config's ``auth`` (e.g. ``{"path": "/abs/auth.py:auth"}``); ``None``: none.
            worker_env: Per worker (by index), settings over ``env`` for that process alone
                (e.g. each worker's own ``FUSION_METRICS_PORT``).

        Raises:
            LangGraphServerNotInstalled: ``langhost`` or ``redis-server`` is missing.
        """
        if workers < 1:
            raise ValueError("a server needs at least one worker")
        self.database_url = database_url
        self.n_workers = workers
        self.jobs_per_worker = jobs_per_worker
        self.heartbeat_s = heartbeat_s
        self.startup_timeout = startup_timeout
        self.binary = Path(langhost) if langhost is not None else ensure_langhost()
        redis_binary = Path(redis_server) if redis_server is not None else ensure_redis_server()
        if config_path is None:
            root = source_root()
            if root is None:
                raise LangGraphServerError("no config_path given and this is not a source checkout")
            config_path = root / "langgraph.json"
        self.config_path = Path(config_path).resolve()
        if log_dir is None:
            log_dir = Path(tempfile.mkdtemp(prefix="langgraph-server-"))
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis = RedisServer(
            self.log_dir / "redis", binary=redis_binary, log_path=self.log_dir / "redis.log"
        )
        self._env = dict(env or {})
        self.auth = dict(auth) if auth is not None else None
        self._per_worker = [dict(e) for e in worker_env]
        self.workers: tuple[LangGraphWorker, ...] = ()

    # -- set-up ------------------------------------------------------------

    def served_config(self) -> Path:
        """Writes the ``langgraph.json`` the workers serve: the graphs by absolute path, no ``.env``."""
        graphs = graphs_of(self.config_path)
        root = self.config_path.parent
        served: dict[str, Any] = {
            "dependencies": [str(root)],
            "graphs": graphs,
            "env": {},
            "python_version": "3.11",
        }
        if self.auth is not None:
            served["auth"] = self.auth
        path = self.log_dir / "langgraph.json"
        path.write_text(json.dumps(served, indent=2), encoding="utf-8")
        return path

    def worker_env(self) -> dict[str, str]:
        """The environment every worker runs with (see ``env`` in the constructor)."""
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_")}
        for name in ("DATABASE_URI", "REDIS_URI", "N_JOBS_PER_WORKER", "LANGGRAPH_RUNTIME_EDITION"):
            inherited.pop(name, None)
        root = str(self.config_path.parent)
        python_path = os.pathsep.join(p for p in (root, inherited.get("PYTHONPATH", "")) if p)
        return {
            **inherited,
            **DEFAULT_WORKER_ENV,
            "LG_BG_JOB_HEARTBEAT": f"{self.heartbeat_s:g}",
            "PYTHONPATH": python_path,
            **self._env,
            **FORCED_WORKER_ENV,
            "DATABASE_URI": server_database_url(self.database_url),
            "REDIS_URI": self.redis.url,
        }

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> Self:
        """Starts Redis, then worker 0 (it migrates the schema), then the others together.

        Raises:
            LangGraphServerError: A process did not become ready; everything started is stopped.
        """
        if self.workers:
            return self
        try:
            self.redis.start()
            config = self.served_config()
            env = self.worker_env()
            workdir = self.log_dir / "work"
            workdir.mkdir(exist_ok=True)
            self.workers = tuple(
                LangGraphWorker(
                    index,
                    binary=self.binary,
                    config_path=config,
                    env={**env, **(self._per_worker[index] if index < len(self._per_worker) else {})},
                    workdir=workdir,
                    log_path=self.log_dir / f"worker-{index}.log",
                    jobs=self.jobs_per_worker,
                    startup_timeout=self.startup_timeout,
                )
                for index in range(self.n_workers)
            )
            self.workers[0].start()  # alone: the schema migrations and checkpointer DDL race otherwise
            for worker in self.workers[1:]:
                worker.launch()
            for worker in self.workers[1:]:
                worker.wait_started()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stops every worker, then Redis (SIGTERM, SIGKILL after a grace period). Idempotent."""
        for worker in self.workers:
            worker.stop()
        self.redis.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- workers -----------------------------------------------------------

    @property
    def urls(self) -> tuple[str, ...]:
        """Each worker's base URL, by index (a worker restarted on a new port has a new one)."""
        return tuple(worker.url for worker in self.workers)

    def url(self, index: int) -> str:
        """Base URL of worker ``index``."""
        return self.workers[index].url

    def pids(self) -> tuple[int | None, ...]:
        """Each worker's PID, None for one that is not running."""
        return tuple(worker.pid for worker in self.workers)

    def kill(self, index: int) -> int | None:
        """SIGKILLs worker ``index`` (its own PID): no shutdown, its runs are left running in the queue.

        Returns:
            Its exit code (``-9``), None when it was not running.
        """
        return self.workers[index].kill()

    def restart(self, index: int) -> str:
        """Stops worker ``index`` if it runs (SIGTERM), starts it again and waits until it is ready.

        Returns:
            Its URL: the same port when it is still free, else a new one.
        """
        worker = self.workers[index]
        worker.stop()
        worker.start()
        return worker.url

    # -- which worker ran what --------------------------------------------

    def run_attempts(self, run_id: str) -> list[RunAttempt]:
        """Every attempt at ``run_id`` over all workers' logs, by attempt number."""
        found = [
            attempt
            for worker in self.workers
            for attempt in attempts_in(worker.records(), worker.index)
            if attempt.run_id == str(run_id)
        ]
        return sorted(found, key=lambda a: (a.attempt, a.started_at))

    def all_attempts(self) -> list[RunAttempt]:
        """Every run attempt any worker logged, by start time."""
        found = [a for worker in self.workers for a in attempts_in(worker.records(), worker.index)]
        return sorted(found, key=lambda a: a.started_at)

    def ran_by(self, run_id: str) -> int | None:
        """The worker that ran the run's last attempt (None before any worker started it)."""
        attempts = self.run_attempts(run_id)
        return attempts[-1].worker if attempts else None

    def wait_run_started(self, run_id: str, *, attempt: int = 1, timeout: float = 60.0) -> RunAttempt:
        """Polls the logs until some worker has started ``attempt`` of ``run_id``.

        Raises:
            LangGraphServerError: No worker logged it within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for found in self.run_attempts(run_id):
                if found.attempt == attempt:
                    return found
            time.sleep(0.1)
        raise LangGraphServerError(
            f"no worker started attempt {attempt} of run {run_id} within {timeout:.0f} s\n{self.log_tails()}"
        )

    def records(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """``(worker index, JSON log line)`` over every worker's log."""
        for worker in self.workers:
            for record in worker.records():
                yield worker.index, record

    def log_tails(self, lines: int = 40) -> str:
        """The tail of every log, for a failure message."""
        parts = [f"--- {self.redis.log_path}:\n{self.redis.log_tail(lines)}"]
        parts += [f"--- worker {w.index} {w.log_path} ({w!r}):\n{w.log_tail(lines)}" for w in self.workers]
        return "\n".join(parts)

    def __repr__(self) -> str:
        return f"LangGraphServer(workers={list(self.workers)}, redis={self.redis.url}, logs={self.log_dir})"
