"""llama-server's addresses."""

from __future__ import annotations

from fusion_graph.providers.llama_server import server_root


def test_server_root() -> None:
    assert server_root("http://127.0.0.1:8080/v1") == "http://127.0.0.1:8080"
    assert server_root("http://127.0.0.1:8080/v1/") == "http://127.0.0.1:8080"
