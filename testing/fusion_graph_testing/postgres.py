"""A throwaway PostgreSQL cluster on a free loopback port, for tests and benchmarks.

``PostgresCluster`` runs ``initdb`` into a fresh temporary folder, then ``pg_ctl
start`` on a free loopback port with its unix socket in that folder, so it never
touches a system cluster; on exit (and at interpreter exit) it stops the server
and removes the folder. Postgres refuses to run as root, so under root every
server command runs as the unprivileged ``postgres`` OS user (made by Debian's
``postgresql`` package). ``create_database`` gives each user a database of its
own. ``psycopg`` is imported on first use (the dev extra).
"""

from __future__ import annotations

import atexit
import glob
import os
import pwd
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import NoReturn, Self

from fusion_graph_testing.llama_server import HOST, free_port

#: Where Debian (and Ubuntu) put the server binaries, one folder per major version.
BIN_GLOB = "/usr/lib/postgresql/*/bin"
#: The OS user that runs the server when the caller runs as root.
OS_USER = "postgres"
#: Seconds to wait for the server to start, accept connections, or stop.
START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 60
#: Settings for a disposable server: durability off, loopback only.
SERVER_SETTINGS = {
    "listen_addresses": HOST,
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "100",
}
#: How the server binaries are installed.
INSTALL_HINT = "install the Debian 'postgresql' package (scripts/setup.sh does)"


class PostgresUnavailableError(RuntimeError):
    """The server binaries (or the user to run them as) are not on this machine."""


class PostgresError(RuntimeError):
    """The throwaway server failed to initialise, start or accept connections; the message has its log."""


def _version_key(bin_dir: str) -> tuple[int, ...]:
    version = Path(bin_dir).parent.name
    return tuple(int(part) for part in re.findall(r"\d+", version)) or (0,)


def find_bin_dir(patterns: Sequence[str] = (BIN_GLOB,)) -> Path:
    """The newest folder holding ``initdb``, ``pg_ctl`` and ``postgres``; then ``PATH``.

    Raises:
        PostgresUnavailableError: None found; the message names where it looked.
    """
    needed = ("initdb", "pg_ctl", "postgres")
    for pattern in patterns:
        for bin_dir in sorted(glob.glob(pattern), key=_version_key, reverse=True):
            if all(os.access(Path(bin_dir, name), os.X_OK) for name in needed):
                return Path(bin_dir)
    on_path = [shutil.which(name) for name in needed]
    if all(on_path):
        return Path(os.path.realpath(str(on_path[0]))).parent
    raise PostgresUnavailableError(
        f"PostgreSQL server binaries (initdb, pg_ctl, postgres) not found under {', '.join(patterns)} "
        "or on PATH"
    )


def check_os_user() -> None:
    """Under root, the server needs the ``postgres`` OS user to run as (``PostgresUnavailableError``)."""
    if os.geteuid() != 0:
        return
    try:
        pwd.getpwnam(OS_USER)
    except KeyError:
        raise PostgresUnavailableError(
            f"running as root and there is no {OS_USER!r} OS user to run the server as"
        ) from None
    if shutil.which("runuser") is None:
        raise PostgresUnavailableError("running as root and there is no 'runuser' to drop privileges")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as error:
        return f"(no server log at {path}: {error})"
    return "\n".join(text.splitlines()[-lines:]) or "(server log is empty)"


@dataclass
class PostgresServer:
    """A server in ``root``: data in ``root/data``, socket and log beside it (run by ``PostgresCluster``)."""

    bin_dir: Path
    root: Path
    port: int = 0

    @property
    def data(self) -> Path:
        """The data folder."""
        return self.root / "data"

    @property
    def log(self) -> Path:
        """The server log."""
        return self.root / "server.log"

    @property
    def url(self) -> str:
        """A libpq URL for the ``postgres`` superuser's ``postgres`` database over TCP."""
        return self.url_for("postgres")

    def url_for(self, database: str) -> str:
        """A libpq URL for the superuser's ``database`` over TCP."""
        return f"postgresql://{OS_USER}@{HOST}:{self.port}/{database}?connect_timeout=10"

    def _command(self, program: str, *args: str) -> list[str]:
        command = [str(self.bin_dir / program), *args]
        if os.geteuid() == 0:  # postgres refuses to run as root
            command = ["runuser", "-u", OS_USER, "--", *command]
        return command

    def _run(self, program: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        """Run a server program (as the postgres user under root); a timeout is a failed exit."""
        command = self._command(program, *args)
        try:
            return subprocess.run(
                command,
                cwd=self.root,  # the caller's folder may not be readable by the postgres user
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                env={**os.environ, "LC_ALL": "C", "LANG": "C"},
            )
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(command, -1, "", f"{program} timed out after {timeout} s")

    def _fail(self, what: str, result: subprocess.CompletedProcess[str] | None = None) -> NoReturn:
        output = ""
        if result is not None:
            output = f"\n--- exit {result.returncode}, output:\n{(result.stdout + result.stderr).strip()}"
        raise PostgresError(
            f"PostgreSQL test server: {what} (data {self.data}){output}\n"
            f"--- server log tail ({self.log}):\n{_tail(self.log)}"
        )

    def initdb(self) -> None:
        """Create the cluster's data folder (``PostgresError`` when ``initdb`` fails)."""
        if os.geteuid() == 0:  # the server's files must belong to the user that runs it
            account = pwd.getpwnam(OS_USER)
            os.chown(self.root, account.pw_uid, account.pw_gid)
        result = self._run(
            "initdb",
            "--pgdata",
            str(self.data),
            "--username",
            OS_USER,
            "--auth",
            "trust",
            "--encoding",
            "UTF8",
            "--locale",
            "C",
            "--no-sync",
            timeout=START_TIMEOUT_S,
        )
        if result.returncode != 0:
            self._fail("initdb failed", result)

    def start(self, attempts: int = 3, *, port: int | None = None) -> None:
        """Start on ``port``, else a free port (a new one if another process took it meanwhile), then wait."""
        result: subprocess.CompletedProcess[str] | None = None
        for _ in range(attempts if port is None else 1):
            self.port = port if port is not None else free_port()
            options = [f"-p {self.port}", f"-k {shlex.quote(str(self.root))}"]
            options += [f"-c {key}={value}" for key, value in SERVER_SETTINGS.items()]
            result = self._run(
                "pg_ctl",
                "start",
                "--pgdata",
                str(self.data),
                "--log",
                str(self.log),
                "--wait",
                "--timeout",
                str(START_TIMEOUT_S),
                "--options",
                " ".join(options),
                timeout=START_TIMEOUT_S + 30,
            )
            if result.returncode == 0:
                self.wait_ready()
                return
            if "could not bind" not in _tail(self.log, 10) and "in use" not in _tail(self.log, 10):
                break
        self._fail("pg_ctl start failed", result)

    def wait_ready(self) -> None:
        """Poll until a real client connection succeeds and answers a query."""
        import psycopg

        deadline = time.monotonic() + START_TIMEOUT_S
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                with psycopg.connect(self.url, autocommit=True) as conn:
                    conn.execute("SELECT 1").fetchone()
                return
            except psycopg.OperationalError as error:
                last_error = error
                time.sleep(0.2)
        self._fail(f"not accepting connections after {START_TIMEOUT_S} s: {last_error}")

    def stop(self) -> None:
        """``pg_ctl stop -m fast``; ``-m immediate`` if that does not finish in time."""
        if not (self.data / "postmaster.pid").exists():
            return
        for mode in ("fast", "immediate"):
            args = ("stop", "--pgdata", str(self.data), "--mode", mode, "--wait")
            result = self._run("pg_ctl", *args, "--timeout", str(STOP_TIMEOUT_S), timeout=STOP_TIMEOUT_S + 30)
            if result.returncode == 0:
                return


class PostgresCluster:
    """A throwaway server in a temporary folder of its own: started on enter, stopped and removed on exit.

    Usable as ``with PostgresCluster() as cluster:`` or through :meth:`start` and
    :meth:`stop` (idempotent, also run at interpreter exit).

    Raises:
        PostgresUnavailableError: From :meth:`start`: no server binaries, or no user to run them as.
        PostgresError: From :meth:`start`: the server did not initialise, start or accept connections.
    """

    def __init__(self, *, bin_dir: Path | None = None, prefix: str = "fusion-pg-") -> None:
        """A cluster of the binaries in ``bin_dir`` (default: ``find_bin_dir()``); nothing starts yet."""
        self.bin_dir = bin_dir
        self.prefix = prefix
        self._server: PostgresServer | None = None
        #: Seconds ``start`` took (initdb and the first accepted connection).
        self.start_s = 0.0

    @property
    def server(self) -> PostgresServer:
        """The running server (``RuntimeError`` before :meth:`start`)."""
        if self._server is None:
            raise RuntimeError("the PostgreSQL cluster is not started")
        return self._server

    @property
    def url(self) -> str:
        """The superuser's connection URL for the ``postgres`` database (loopback TCP)."""
        return self.server.url

    @property
    def port(self) -> int:
        """The server's TCP port."""
        return self.server.port

    @property
    def log(self) -> Path:
        """The server log (removed with the folder on :meth:`stop`)."""
        return self.server.log

    def url_for(self, database: str) -> str:
        """The superuser's connection URL for ``database``."""
        return self.server.url_for(database)

    def start(self) -> Self:
        """``initdb`` into a fresh folder, start on a free port and wait for a real connection."""
        if self._server is not None:
            return self
        bin_dir = self.bin_dir or find_bin_dir()
        check_os_user()
        root = Path(tempfile.mkdtemp(prefix=self.prefix))  # not under a 0700 base dir of the caller
        self._server = PostgresServer(bin_dir=bin_dir, root=root)
        atexit.register(self.stop)
        started = time.perf_counter()
        try:
            self._server.initdb()
            self._server.start()
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - started
        return self

    def stop(self) -> None:
        """Stop the server and remove its folder (idempotent)."""
        atexit.unregister(self.stop)
        server, self._server = self._server, None
        if server is None:
            return
        try:
            server.stop()
        finally:
            shutil.rmtree(server.root, ignore_errors=True)

    def halt(self) -> None:
        """Stop the server and keep its data and port (a database outage); ``resume`` starts it again."""
        self.server.stop()

    def resume(self) -> None:
        """Start the halted server again on the same port, and wait for a real connection."""
        self.server.start(port=self.server.port)

    def version(self) -> str:
        """The server's ``server_version``, e.g. ``15.8 (Debian 15.8-0+deb12u1)``."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        return str(row[0]) if row else "unknown"

    def create_database(self, name: str) -> str:
        """Create the empty database ``name``; returns its connection URL."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url_for(name)

    def drop_database(self, name: str) -> None:
        """Drop ``name`` if it exists, closing its connections."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
