"""The isolation every test gets from tests/conftest.py: no FUSION_* settings, loopback-only network."""

from __future__ import annotations

import os
import socket

import pytest

from fusion_graph.settings import FusionSettings
from tests.conftest import NetworkBlockedError, is_loopback


def test_fusion_env_is_cleared_for_each_test() -> None:
    assert not [name for name in os.environ if name.startswith("FUSION_")]
    assert FusionSettings() == FusionSettings.model_construct()


@pytest.mark.parametrize(
    ("family", "address", "allowed"),
    [
        (socket.AF_INET, ("127.0.0.1", 80), True),
        (socket.AF_INET, ("127.8.9.10", 80), True),
        (socket.AF_INET6, ("::1", 80, 0, 0), True),
        (socket.AF_INET6, ("::ffff:127.0.0.1", 80, 0, 0), True),
        (socket.AF_UNIX, "/tmp/some.sock", True),
        (socket.AF_INET, ("203.0.113.7", 443), False),
        (socket.AF_INET, ("10.0.0.1", 80), False),
        (socket.AF_INET6, ("2001:db8::1", 443, 0, 0), False),
        (socket.AF_INET, ("api.openai.com", 443), False),
    ],
)
def test_loopback_classification(family: int, address: object, allowed: bool) -> None:
    assert is_loopback(family, address) is allowed


def test_non_loopback_connections_are_refused() -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        with pytest.raises(NetworkBlockedError, match="loopback only"):
            sock.connect(("203.0.113.7", 443))
        with pytest.raises(NetworkBlockedError):
            sock.connect_ex(("203.0.113.7", 443))
    finally:
        sock.close()


def test_loopback_connections_still_work() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            assert client.getpeername()[1] == port
