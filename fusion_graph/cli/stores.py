"""Where ``fusion-graph run`` keeps threads and memories: SQLite files by default, or Postgres.

Checkpoints (each thread's messages and ``route_log``) go to ``--db``; the
LangGraph store (memories and the memory job log) to a second SQLite file
beside it (``threads.sqlite`` -> ``threads.store.sqlite``), or to the same
Postgres database with ``--postgres``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

from fusion_graph.errors import RunError

if TYPE_CHECKING:
    from langgraph.checkpoint.base import BaseCheckpointSaver
    from langgraph.store.base import BaseStore

POSTGRES_EXTRA = "pip install 'langgraph-checkpoint-postgres' 'psycopg[binary]'"


def store_path(db: Path) -> Path:
    """The SQLite store file beside the checkpoint file ``db``."""
    return db.with_name(f"{db.stem}.store{db.suffix or '.sqlite'}")


def _check_postgres(url: str) -> None:
    from fusion_graph.redact import scrub

    if not url.startswith(("postgres://", "postgresql://")):
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
            AsyncPostgresSaver.from_conn_string(postgres),
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
        async with AsyncPostgresStore.from_conn_string(postgres) as pg_store:
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
