"""Doctor's checkpoint store row: the SQLite file ``run`` writes (or can create), or a Postgres URL."""

from __future__ import annotations

import importlib
import os
import sqlite3
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from fusion_graph.cli.doctor.rows import Check
from fusion_graph.cli.stores import DEFAULT_DB, is_postgres_url
from fusion_graph.redact import REDACTED, scrub


def _writable_dir(directory: Path) -> tuple[Path, bool]:
    """The nearest existing directory at or above ``directory``, and whether files can be made in it."""
    for candidate in (directory, *directory.parents):
        if candidate.exists():
            return candidate, candidate.is_dir() and os.access(candidate, os.W_OK | os.X_OK)
    return directory, False


def sqlite_check(db: Path) -> Check:
    """The SQLite file opens (``PRAGMA schema_version``), or its directory can be made and written."""
    name = "checkpoint db"
    if db.exists():
        if not db.is_file():
            return Check(name, "fail", f"--db {db} is not a file", "pass --db a file path")
        if not os.access(db, os.R_OK | os.W_OK):
            return Check(name, "fail", f"--db {db} is not readable and writable", f"chmod u+rw {db}")
        try:
            with closing(sqlite3.connect(db.resolve().as_uri() + "?mode=ro", uri=True)) as connection:
                version = connection.execute("PRAGMA schema_version").fetchone()[0]
        except sqlite3.Error as error:
            return Check(
                name,
                "fail",
                f"--db {db} does not open as SQLite ({error})",
                "pass --db a SQLite file (or a new path: `fusion-graph run` creates it)",
            )
        directory, writable = _writable_dir(db.parent)
        if not writable:
            return Check(
                name, "fail", f"{directory.resolve()} is not writable (SQLite writes its journal there)", ""
            )
        return Check(name, "ok", f"{db} opens as SQLite (schema_version {version})")
    directory, writable = _writable_dir(db.parent)
    if not writable:
        return Check(
            name,
            "fail",
            f"{db} does not exist and {directory.resolve()} is not a writable directory",
            f"pass --db a path in a writable directory (default {DEFAULT_DB})",
        )
    return Check(
        name,
        "ok",
        f"{db} does not exist yet; `fusion-graph run` creates it ({directory.resolve()} is writable)",
    )


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``[REDACTED]``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:{REDACTED}@{netloc}"))


@dataclass(frozen=True)
class PostgresRow:
    """What one Postgres row says beyond the probe both rows make.

    Attributes:
        name: The row's name.
        needs: Who needs the driver (``--postgres``, ``the shared state``).
        modules: What must import for it (optional dependencies: ``fusion-graph[postgres]``).
        down: Said after ``cannot connect to <url> (<why>)``, and the row's fix.
        up: The ok row's text, with ``{url}`` and ``{version}``.
    """

    name: str
    needs: str
    modules: tuple[str, ...]
    down: tuple[str, str]
    up: str


#: ``run --postgres``'s checkpoint database.
CHECKPOINT_ROW = PostgresRow(
    "checkpoint db",
    "--postgres",
    ("psycopg", "langgraph.checkpoint.postgres"),
    ("", "check the URL and that the server runs"),
    "{url} connects (PostgreSQL {version})",
)
#: The shared state's database (``FUSION_SHARED_STATE=postgres``).
SHARED_STATE_ROW = PostgresRow(
    "shared state",
    "the shared state",
    ("psycopg", "psycopg_pool"),
    (
        "; until it answers, every worker places in-process",
        "check FUSION_SHARED_STATE_URL and that the server runs",
    ),
    "{url} connects: slots, cooldowns and memory job claims are shared",
)


def postgres_row(row: PostgresRow, url: str, timeout: float) -> Check:
    """``row`` for a ``postgres(ql)://`` ``url``: its driver imports, a connection answers ``SELECT 1``."""
    try:
        for module in row.modules:
            importlib.import_module(module)
    except ImportError as error:
        return not_installed(row.name, row.needs, error, "pip install 'fusion-graph[postgres]'")
    shown = redact_url(url)
    version, detail = select_one(url, timeout)
    if version is None:
        said, fix = row.down
        return Check(row.name, "fail", f"cannot connect to {shown} ({detail}){said}", fix)
    return Check(row.name, "ok", row.up.format(url=shown, version=postgres_version(version)))


def not_installed(name: str, what: str, error: ImportError, fix: str) -> Check:
    """The row for a Postgres feature whose driver (an optional dependency) is not installed."""
    return Check(name, "fail", f"{what} needs {error.name or 'psycopg'}, which is not installed", fix)


def select_one(url: str, timeout: float) -> tuple[int | None, str]:
    """Open a connection to ``url`` and run ``SELECT 1``: the server's version, or why not (scrubbed).

    libpq waits at least 2 s to connect, whatever ``timeout`` says.
    """
    import psycopg

    try:
        with psycopg.connect(url, connect_timeout=max(2, round(timeout))) as connection:
            connection.execute("SELECT 1")
            return connection.info.server_version, ""
    except psycopg.Error as error:
        return None, scrub(f"{type(error).__name__}: {error}".splitlines()[0], [url])


def postgres_version(number: int) -> str:
    """The version libpq reports (``server_version``) as PostgreSQL prints it: ``150018`` is ``15.18``."""
    if number >= 100000:  # 10 and later: major * 10000 + minor
        return f"{number // 10000}.{number % 10000}"
    return f"{number // 10000}.{number // 100 % 100}.{number % 100}"


def postgres_check(url: str, *, timeout: float) -> Check:
    """``run --postgres``'s database: a connection opens (``psycopg``) and answers ``SELECT 1``."""
    if not is_postgres_url(url):
        return Check(
            CHECKPOINT_ROW.name,
            "fail",
            f"--postgres {scrub(redact_url(url))!r} is not a URL",
            "use postgresql://user:password@host:port/db",
        )
    return postgres_row(CHECKPOINT_ROW, url, timeout)


def shared_state_check(url: str | None, *, timeout: float) -> Check:
    """With ``FUSION_SHARED_STATE=postgres``: the shared state's database opens and answers ``SELECT 1``.

    ``url`` is ``FusionSettings.shared_url()`` (``FUSION_SHARED_STATE_URL``, else ``DATABASE_URI``).
    A database that does not answer fails no turn (it places in-process), but every worker then
    keeps its own slots and cooldowns, so it is a failed row here.
    """
    if url is None:
        return Check(
            SHARED_STATE_ROW.name,
            "fail",
            "FUSION_SHARED_STATE=postgres but no database is named",
            "set FUSION_SHARED_STATE_URL=postgresql://... (a LangGraph server sets DATABASE_URI)",
        )
    if not is_postgres_url(url):
        scheme = url.split("://", 1)[0][:20] if "://" in url else ""
        return Check(
            SHARED_STATE_ROW.name,
            "fail",
            f"the shared state's URL is not a postgresql:// URL (its scheme is {scheme!r})",
            "fix FUSION_SHARED_STATE_URL (or DATABASE_URI when that is empty)",
        )
    return postgres_row(SHARED_STATE_ROW, url, timeout)
