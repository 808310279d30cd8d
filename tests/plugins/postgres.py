"""Pytest fixtures for tests that need a real PostgreSQL server.

One throwaway server per session: ``initdb`` into a fresh temporary folder, then
``pg_ctl start`` on a free loopback port with its unix socket in that folder, so
it never touches a system cluster. Postgres refuses to run as root, so under
root every server command runs as the unprivileged ``postgres`` OS user (made by
Debian's ``postgresql`` package). Each test gets a database of its own.

Missing binaries skip the tests locally and fail them under ``CI=true``, so CI
cannot go green by silently not running them. ``tests/conftest.py`` registers
this module as a plugin, so a test just asks for ``postgres_url`` or
``postgres_db`` (the fixture functions are named ``*_fixture``).
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

from tests.plugins.requires import service_missing

#: Where Debian (and Ubuntu) put the server binaries, one folder per major version.
BIN_GLOB = "/usr/lib/postgresql/*/bin"
#: The OS user that runs the server when the tests run as root.
OS_USER = "postgres"
#: Seconds to wait for the server to start, accept connections, or stop.
START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 60
#: Settings for a disposable test server: durability off, loopback only.
SERVER_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "100",
}


class PostgresUnavailableError(RuntimeError):
    """The server binaries (or the user to run them as) are not on this machine."""


def unavailable(reason: str) -> NoReturn:
    """Fail under ``CI=true`` (Postgres is a set-up step there), skip elsewhere."""
    service_missing(reason, fix="install the Debian 'postgresql' package (scripts/setup.sh does)")


def _version_key(bin_dir: str) -> tuple[int, ...]:
    version = Path(bin_dir).parent.name
    return tuple(int(part) for part in re.findall(r"\d+", version)) or (0,)


def find_bin_dir(patterns: Sequence[str] = (BIN_GLOB,)) -> Path:
    """The newest folder holding ``initdb``, ``pg_ctl`` and ``postgres``; then ``PATH``."""
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
    """Under root, the server needs the ``postgres`` OS user to run as."""
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as error:
        return f"(no server log at {path}: {error})"
    return "\n".join(text.splitlines()[-lines:]) or "(server log is empty)"


@dataclass
class PostgresServer:
    """A throwaway server in ``root``: data in ``root/data``, socket and log beside it."""

    bin_dir: Path
    root: Path
    port: int = 0

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    @property
    def url(self) -> str:
        """A libpq URL for the ``postgres`` superuser's ``postgres`` database over TCP."""
        return self.url_for("postgres")

    def url_for(self, database: str) -> str:
        return f"postgresql://{OS_USER}@127.0.0.1:{self.port}/{database}?connect_timeout=10"

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
        pytest.fail(
            f"PostgreSQL test server: {what} (data {self.data}){output}\n"
            f"--- server log tail ({self.log}):\n{_tail(self.log)}",
            pytrace=False,
        )

    def initdb(self) -> None:
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

    def start(self, attempts: int = 3) -> None:
        """Start on a free port (a new one if another process took it meanwhile), then wait."""
        result: subprocess.CompletedProcess[str] | None = None
        for _ in range(attempts):
            self.port = free_port()
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


@pytest.fixture(scope="session", name="postgres_url")
def postgres_url_fixture() -> Iterator[str]:
    """A running throwaway PostgreSQL server: the superuser's connection URL (loopback TCP)."""
    try:
        bin_dir = find_bin_dir()
        check_os_user()
    except PostgresUnavailableError as error:
        missing = str(error)
    else:
        missing = ""
    if missing:  # outside the except block: the skip/fail message stands alone
        unavailable(missing)
    root = Path(tempfile.mkdtemp(prefix="fusion-pg-"))  # not under pytest's 0700 base dir
    server = PostgresServer(bin_dir=bin_dir, root=root)
    try:
        started = time.perf_counter()
        server.initdb()
        server.start()
        print(
            f"postgres ready in {time.perf_counter() - started:.2f} s on port {server.port}, log {server.log}"
        )
        yield server.url
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(name="postgres_db")
def postgres_db_fixture(postgres_url: str) -> Iterator[str]:
    """A fresh, empty database on the session server for one test: its connection URL."""
    import psycopg
    from psycopg import sql

    name = f"test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    base, _, query = postgres_url.partition("?")
    yield f"{base.rsplit('/', 1)[0]}/{name}?{query}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
