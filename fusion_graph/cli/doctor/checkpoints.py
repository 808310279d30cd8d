"""Doctor's checkpoint store row: the SQLite file ``run`` writes (or can create), or a Postgres URL."""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from fusion_graph.cli.doctor.rows import Check
from fusion_graph.redact import REDACTED, scrub

#: ``fusion_graph.cli.run.DEFAULT_DB``, repeated so importing this command loads no LangGraph (a test
#: checks they agree).
DEFAULT_DB = Path(".fusion-graph") / "threads.sqlite"


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


def postgres_check(url: str, *, timeout: float) -> Check:
    """A connection opens (``psycopg``, an optional dependency) and answers ``SELECT 1``."""
    name, shown = "checkpoint db", redact_url(url)
    if not url.startswith(("postgres://", "postgresql://")):
        return Check(
            name,
            "fail",
            f"--postgres {scrub(shown)!r} is not a URL",
            "use postgresql://user:password@host:port/db",
        )
    try:
        import psycopg
        from langgraph.checkpoint.postgres import PostgresSaver  # noqa: F401  (what `run --postgres` needs)
    except ImportError as error:
        return Check(
            name,
            "fail",
            f"--postgres needs {error.name or 'psycopg'}, which is not installed",
            "pip install 'langgraph-checkpoint-postgres' 'psycopg[binary]'",
        )
    try:
        with psycopg.connect(url, connect_timeout=max(1, round(timeout))) as connection:
            version = connection.info.server_version
            connection.execute("SELECT 1")
    except psycopg.Error as error:
        detail = scrub(f"{type(error).__name__}: {error}".splitlines()[0], [url])
        return Check(
            name, "fail", f"cannot connect to {shown} ({detail})", "check the URL and that the server runs"
        )
    return Check(name, "ok", f"{shown} connects (server version {version})")
