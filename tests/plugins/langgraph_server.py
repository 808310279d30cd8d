"""Pytest fixtures for the graph on a real multi-process LangGraph server (``langhost serve``).

``start_langgraph_server`` is a factory: each call makes a fresh database on the
session's throwaway PostgreSQL (``postgres_url``), then starts a
:class:`~fusion_graph_testing.langgraph_server.LangGraphServer` on it (its own
``redis-server``, N ``langhost serve`` workers on loopback ports) with the
environment the test passes: the test first starts the fakes the graph talks
to, then hands their URLs in ``FUSION_*`` settings. Everything it started is
stopped, and each database dropped, when the test ends.

``langhost`` lives in its own virtualenv (``.venv-server``, made by
``scripts/setup.sh``): it pins an older ``langgraph-api`` than the dev extra's
``langgraph-cli[inmem]``. A missing ``langhost`` or ``redis-server`` skips the
tests locally and fails them under ``CI=true``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from fusion_graph_testing.langgraph_server import (
    LangGraphServer,
    LangGraphServerNotInstalled,
    ensure_langhost,
    ensure_redis_server,
)
from tests.plugins.requires import service_missing

#: What a test calls to get a running server: ``start(env, workers=2, **LangGraphServer kwargs)``.
StartServer = Callable[..., LangGraphServer]
#: The checkout under test: its ``langgraph.json`` names the graph the workers serve.
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def langhost_bin() -> Path:
    """The ``langhost`` launcher (``.venv-server/bin/langhost``), or skip/fail when it is missing."""
    try:
        return ensure_langhost()
    except LangGraphServerNotInstalled as exc:
        missing = str(exc)
    service_missing(missing)


@pytest.fixture(scope="session")
def redis_server_bin() -> Path:
    """The ``redis-server`` executable, or skip/fail when it is missing."""
    try:
        return ensure_redis_server()
    except LangGraphServerNotInstalled as exc:
        missing = str(exc)
    service_missing(missing)


def _database(postgres_url: str, name: str, *, create: bool) -> str:
    """Creates (or drops) database ``name`` on the session server; returns its URL."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(postgres_url, autocommit=True) as conn:
        if create:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        else:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    base, _, query = postgres_url.partition("?")
    return f"{base.rsplit('/', 1)[0]}/{name}?{query}"


@pytest.fixture
def start_langgraph_server(
    langhost_bin: Path, redis_server_bin: Path, postgres_url: str, tmp_path: Path
) -> Iterator[StartServer]:
    """A factory of running servers, each on a fresh database; all are stopped after the test."""
    databases: list[str] = []
    with ExitStack() as stack:

        def start(env: Mapping[str, str], *, workers: int = 2, **kwargs: Any) -> LangGraphServer:
            name = f"lgserver_{uuid.uuid4().hex[:12]}"
            url = _database(postgres_url, name, create=True)
            databases.append(name)
            kwargs.setdefault("config_path", ROOT / "langgraph.json")
            server = LangGraphServer(
                url,
                workers=workers,
                env=env,
                langhost=langhost_bin,
                redis_server=redis_server_bin,
                log_dir=tmp_path / name,
                **kwargs,
            )
            started = time.perf_counter()
            stack.enter_context(server)
            print(f"{server!r} ready in {time.perf_counter() - started:.1f} s")
            return server

        try:
            yield start
        finally:
            stack.close()
            for name in databases:
                _database(postgres_url, name, create=False)
