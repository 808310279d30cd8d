"""Pytest fixtures for tests that need a real PostgreSQL server.

One throwaway server per session (``fusion_graph_testing.postgres.PostgresCluster``:
``initdb`` into a fresh temporary folder, ``pg_ctl start`` on a free loopback
port, run as the ``postgres`` OS user under root), stopped and removed at the
end. Each test gets a database of its own.

Missing binaries skip the tests locally and fail them under ``CI=true``, so CI
cannot go green by silently not running them. ``tests/conftest.py`` registers
this module as a plugin, so a test just asks for ``postgres_url`` or
``postgres_db`` (the fixture functions are named ``*_fixture``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import NoReturn

import pytest

from fusion_graph_testing.postgres import (
    INSTALL_HINT,
    PostgresCluster,
    PostgresError,
    PostgresUnavailableError,
    check_os_user,
    find_bin_dir,
)
from tests.plugins.requires import service_missing


def unavailable(reason: str) -> NoReturn:
    """Fail under ``CI=true`` (Postgres is a set-up step there), skip elsewhere."""
    service_missing(reason, fix=INSTALL_HINT)


def start_cluster(prefix: str = "fusion-pg-") -> PostgresCluster:
    """A started throwaway server (skip locally / fail under CI when there is none); the caller stops it."""
    try:
        bin_dir = find_bin_dir()
        check_os_user()
    except PostgresUnavailableError as error:
        missing = str(error)
    else:
        missing = ""
    if missing:  # outside the except block: the skip/fail message stands alone
        unavailable(missing)
    cluster = PostgresCluster(bin_dir=bin_dir, prefix=prefix)
    try:
        cluster.start()
    except PostgresError as error:
        failure = str(error)
    else:
        failure = ""
    if failure:
        pytest.fail(failure, pytrace=False)
    print(f"postgres ready in {cluster.start_s:.2f} s on port {cluster.port}, log {cluster.log}")
    return cluster


@pytest.fixture(scope="session", name="postgres_cluster")
def postgres_cluster_fixture() -> Iterator[PostgresCluster]:
    """A running throwaway PostgreSQL server for the session."""
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session", name="postgres_url")
def postgres_url_fixture(postgres_cluster: PostgresCluster) -> str:
    """A running throwaway PostgreSQL server: the superuser's connection URL (loopback TCP)."""
    return postgres_cluster.url


@pytest.fixture(name="postgres_db")
def postgres_db_fixture(postgres_cluster: PostgresCluster) -> Iterator[str]:
    """A fresh, empty database on the session server for one test: its connection URL."""
    name = f"test_{uuid.uuid4().hex[:12]}"
    yield postgres_cluster.create_database(name)
    postgres_cluster.drop_database(name)
