"""Shared fixtures for every test (unit and integration): loopback-only network, no FUSION_* settings."""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any

import pytest

# Shared helpers and fixtures (tests/plugins/), registered for every test: fixtures need no import,
# helpers are imported from their module (``from tests.plugins.fakes import scripted``).
# A plugin comes after the plugins it imports, so pytest registers (and assert-rewrites) each first.
pytest_plugins = [
    "tests.plugins.requires",  # skip locally / fail under CI=true when a service is missing
    "tests.plugins.errors",  # real SDK/httpx exception instances
    "tests.plugins.fakes",  # scripted chat models and graph inputs
    "tests.plugins.served",  # a graph over two fake OpenAI-compatible servers (prices, lookup tool)
    "tests.plugins.scripted_llama",  # a real llama-server call with scripted tool calls
    "tests.plugins.llama",  # real llama-server: llama_server_bin, tiny_model, llama_server, own_llama_server
    "tests.plugins.postgres",  # real PostgreSQL: postgres_url, postgres_db
    "tests.plugins.pool",  # several real llama-servers behind a real smg gateway: llama_pool
    "tests.plugins.langgraph_server",  # langhost serve workers on Postgres + Redis: start_langgraph_server
]


class NetworkBlockedError(RuntimeError):
    """A unit test tried to open a non-loopback connection."""


def is_loopback(family: int, address: Any) -> bool:
    """Whether ``address`` (as passed to ``socket.connect``) stays on this machine."""
    if getattr(socket, "AF_UNIX", None) is not None and family == socket.AF_UNIX:
        return True
    host = address[0] if isinstance(address, tuple) else address
    if isinstance(host, bytes):
        host = host.decode()
    if not isinstance(host, str):
        return False
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refuse every connection that is not to 127.0.0.0/8, ::1 or a unix socket."""
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex

    def guard(sock: socket.socket, address: Any) -> None:
        if not is_loopback(sock.family, address):
            raise NetworkBlockedError(f"unit tests may not connect to {address!r} (loopback only)")

    def connect(self: socket.socket, address: Any) -> None:
        guard(self, address)
        return real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        guard(self, address)
        return real_connect_ex(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)


@pytest.fixture(autouse=True)
def _clear_fusion_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from the built-in defaults, whatever the shell exported."""
    for name in list(os.environ):
        if name.startswith("FUSION_"):
            monkeypatch.delenv(name)
