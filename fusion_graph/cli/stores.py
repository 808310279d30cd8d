"""Where ``fusion-graph run`` keeps threads and memories: SQLite files by default, or Postgres.

Checkpoints (each thread's messages and ``route_log``) go to ``--db``; the
LangGraph store (memories and the memory job log) to a second SQLite file
beside it (``threads.sqlite`` -> ``threads.store.sqlite``), or to the same
Postgres database with ``--postgres``.

``check_target`` looks at a SQLite file with the standard library alone, so
``run`` refuses a bad ``--db`` or an unknown ``--thread`` before it loads
LangGraph or calls a server.

A Postgres is reached with a bounded connect (``postgres_conninfo``): psycopg
waits 130 s for a server that accepts the connection and never answers, where
an operator expects a command to give up within seconds and say where it
looked (``unreachable``: the host, port and database, never the password).
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, closing
from pathlib import Path
from typing import TYPE_CHECKING, cast

from fusion_graph.errors import RunError

if TYPE_CHECKING:
    from langgraph.checkpoint.base import BaseCheckpointSaver
    from langgraph.store.base import BaseStore

POSTGRES_EXTRA = "pip install 'langgraph-checkpoint-postgres' 'psycopg[binary]'"
#: Where ``run`` keeps threads unless ``--db`` says otherwise: under the directory it runs in.
DEFAULT_DB = Path(".fusion-graph") / "threads.sqlite"


def store_path(db: Path) -> Path:
    """The SQLite store file beside the checkpoint file ``db``."""
    return db.with_name(f"{db.stem}.store{db.suffix or '.sqlite'}")


def no_thread(thread: str, where: str) -> RunError:
    """The error for a ``--thread`` with no checkpoint in ``where`` (``--db PATH`` or ``--postgres``)."""
    return RunError(f"thread {thread!r} has no checkpoint in {where}; use --new-thread to start it")


def sqlite_has_thread(db: Path, thread: str) -> bool:
    """Whether the SQLite checkpoint file ``db`` holds ``thread`` (read-only; no file: ``False``).

    Raises:
        sqlite3.Error: ``db`` is not a SQLite file.
    """
    if not db.is_file():
        return False
    with closing(sqlite3.connect(db.resolve().as_uri() + "?mode=ro", uri=True)) as connection:
        tables = connection.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'checkpoints'"
        )
        if tables.fetchone() is None:
            return False
        found = connection.execute("SELECT 1 FROM checkpoints WHERE thread_id = ? LIMIT 1", (thread,))
        return found.fetchone() is not None


def missing_thread(thread: str, db: Path, elsewhere: Sequence[Path] = ()) -> RunError:
    """A ``--thread`` not in ``db``: where it looked and why, and where it is if one of ``elsewhere`` has it.

    Threads live in ``--db`` (default ``.fusion-graph/threads.sqlite`` under the
    directory the command runs in, whatever ``--workspace`` says), so a thread
    begun in another directory is not found from here.
    """
    looked = f"thread {thread!r} has no checkpoint in {db.resolve()}"
    why = "" if db != DEFAULT_DB else " (--db's default: .fusion-graph/threads.sqlite under this directory)"
    others = [other for other in elsewhere if other.resolve() != db.resolve()]
    found = next((other for other in others if sqlite_has_thread(other, thread)), None)
    if found is not None:
        return RunError(f"{looked}{why}; it is in {found.resolve()}: add --db {found.resolve()}")
    return RunError(
        f"{looked}{why}; if it was run from another directory, add --db DIR/.fusion-graph/threads.sqlite, "
        "or --new-thread to start it here"
    )


def check_target(
    db: Path, postgres: str | None, thread: str | None, new_thread: bool, elsewhere: Sequence[Path] = ()
) -> None:
    """Refuse, before anything runs, a store ``open_saver`` could not use or a ``--thread`` it lacks.

    Postgres is only checked for its URL's shape here (its threads when connected).

    Raises:
        RunError: A ``--postgres`` value that is not a URL, or a ``thread`` with no checkpoint
            while ``new_thread`` is false.
        OSError, sqlite3.Error: ``db`` is not a file, sits under a file, or is not SQLite.
    """
    if postgres:
        _check_postgres(postgres)
        return
    if db.exists() and not db.is_file():
        raise IsADirectoryError(f"{db} is not a file")
    above = next((d for d in db.parents if d.exists()), Path("."))
    if not above.is_dir():
        raise NotADirectoryError(f"{above} is not a directory")
    found = sqlite_has_thread(db, thread or "")
    if thread is not None and not new_thread and not found:
        raise missing_thread(thread, db, elsewhere)


def is_postgres_url(url: str) -> bool:
    """Whether ``url`` names a Postgres database (``postgres://`` or ``postgresql://``)."""
    return url.startswith(("postgres://", "postgresql://"))


#: Seconds to reach a Postgres, unless the URL (``?connect_timeout=N``) or ``PGCONNECT_TIMEOUT`` says.
POSTGRES_CONNECT_TIMEOUT_S = 10


def postgres_conninfo(url: str) -> str:
    """``url`` as a connection string with a bounded connect: ``connect_timeout`` unless it sets its own.

    libpq's ``connect_timeout`` bounds the whole connection (TCP, TLS, the startup
    exchange), so a socket that accepts and never answers fails within it.
    A URL psycopg cannot parse is returned as it is: connecting says what is wrong.
    """
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        params = conninfo_to_dict(url)
    except ProgrammingError:
        return url
    if params.get("connect_timeout") is not None or os.environ.get("PGCONNECT_TIMEOUT"):
        return url
    return make_conninfo(url, connect_timeout=POSTGRES_CONNECT_TIMEOUT_S)


def postgres_where(url: str) -> str:
    """Where ``url`` points, for an error: ``host:port/database`` (never the user or the password)."""
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    from fusion_graph.redact import scrub

    try:
        params = conninfo_to_dict(url)
    except ProgrammingError:
        return "the --postgres URL"
    host = str(params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST") or "localhost")
    port = str(params.get("port") or os.environ.get("PGPORT") or "5432")
    database = params.get("dbname")
    return scrub(f"{host}:{port}" + (f"/{database}" if database else ""))


def unreachable(url: str, error: BaseException) -> str:
    """The one line for a Postgres that could not be connected to: where, and why (scrubbed)."""
    from fusion_graph.redact import scrub

    where = postgres_where(url)
    detail = scrub(str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)
    if "timeout" in detail.lower():
        return (
            f"--postgres: the database at {where} did not answer within {_connect_timeout(url)} s "
            "(the connect timeout: the URL's ?connect_timeout=N or PGCONNECT_TIMEOUT sets it); is it up, "
            "and is that its address?"
        )
    return f"--postgres: cannot connect to the database at {where}: {detail}"


def _connect_timeout(url: str) -> str:
    """The connect timeout a connection to ``url`` ran under (``postgres_conninfo``), for a message."""
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(postgres_conninfo(url))
    except ProgrammingError:
        params = {}
    return str(params.get("connect_timeout") or os.environ.get("PGCONNECT_TIMEOUT") or "?")


def _check_postgres(url: str) -> None:
    from fusion_graph.redact import scrub

    if not is_postgres_url(url):
        raise RunError(f"--postgres {scrub(url)!r} is not a postgresql://user:password@host:port/db URL")


@asynccontextmanager
async def open_saver(db: Path, postgres: str | None) -> AsyncIterator[BaseCheckpointSaver[str]]:
    """The thread checkpointer: SQLite at ``db`` by default, Postgres with ``--postgres``."""
    if postgres:
        _check_postgres(postgres)
        try:
            from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
        except ImportError as error:
            raise RunError(f"--postgres needs langgraph-checkpoint-postgres: {POSTGRES_EXTRA}") from error
        manager = cast(
            AbstractAsyncContextManager["BaseCheckpointSaver[str]"],
            AsyncPostgresSaver.from_conn_string(postgres_conninfo(postgres)),
        )
        async with manager as saver:
            await saver.setup()  # type: ignore[attr-defined]
            yield saver
        return
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    db.parent.mkdir(parents=True, exist_ok=True)
    async with AsyncSqliteSaver.from_conn_string(str(db)) as sqlite:
        yield sqlite


@asynccontextmanager
async def open_store(db: Path, postgres: str | None) -> AsyncIterator[BaseStore]:
    """The memory store: ``store_path(db)`` (SQLite), or the ``--postgres`` database."""
    if postgres:
        _check_postgres(postgres)
        try:
            from langgraph.store.postgres.aio import AsyncPostgresStore
        except ImportError as error:
            raise RunError(f"--postgres needs langgraph-checkpoint-postgres: {POSTGRES_EXTRA}") from error
        async with AsyncPostgresStore.from_conn_string(postgres_conninfo(postgres)) as pg_store:
            await pg_store.setup()
            yield pg_store
        return
    from langgraph.store.sqlite.aio import AsyncSqliteStore

    path = store_path(db)
    path.parent.mkdir(parents=True, exist_ok=True)
    async with AsyncSqliteStore.from_conn_string(str(path)) as sqlite_store:
        await sqlite_store.setup()
        yield sqlite_store


async def has_checkpoint(saver: BaseCheckpointSaver[str], thread_id: str) -> bool:
    """Whether ``thread_id`` has a checkpoint in ``saver``."""
    return await saver.aget_tuple({"configurable": {"thread_id": thread_id}}) is not None


def thread_saved(db: Path, postgres: str | None, thread_id: str) -> bool:
    """Whether ``thread_id`` has a checkpoint, asked anew (after Ctrl-C); ``False`` when it cannot be told."""
    if not postgres:
        try:
            return sqlite_has_thread(db, thread_id)
        except sqlite3.Error:
            return False
    import asyncio

    async def ask() -> bool:
        async with open_saver(db, postgres) as saver:
            return await has_checkpoint(saver, thread_id)

    try:
        return asyncio.run(ask())
    except (Exception, KeyboardInterrupt):  # noqa: BLE001 - a second Ctrl-C, or the store is gone
        return False
