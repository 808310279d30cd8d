"""Pytest fixtures for tests that need a real llama-server.

One server per session: starting it costs about a second, but
cache and slot tests want a warm, shared instance anyway. A missing binary
skips the tests locally and fails them under ``CI=true``, so CI cannot go
green by silently not running them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from fusion_graph_testing import (
    LlamaServer,
    LlamaServerNotBuilt,
    ensure_llama_server,
    vocab_path,
    write_tiny_model,
)
from tests.plugins.requires import service_missing

#: ``-np`` of the session server; tests pin requests to slots below this.
N_SLOTS = 4


def _unavailable(reason: str) -> NoReturn:
    """Fails under CI (the binary is a build step there), skips elsewhere."""
    service_missing(reason)


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    """The llama-server binary, or skip/fail when there is none."""
    try:
        return ensure_llama_server()
    except LlamaServerNotBuilt as exc:
        _unavailable(str(exc))
        raise


@pytest.fixture(scope="session")
def tiny_model(llama_server_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly generated tiny qwen2 model with the ChatML template."""
    try:
        vocab = vocab_path("qwen2")
    except LlamaServerNotBuilt as exc:
        _unavailable(str(exc))
        raise
    started = time.perf_counter()
    path = write_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny-qwen2.gguf", vocab_gguf=vocab)
    print(f"tiny model written in {time.perf_counter() - started:.2f} s: {path}")
    return path


@pytest.fixture(scope="session")
def llama_server(
    llama_server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServer]:
    """A running server with ``N_SLOTS`` slots of 4096 tokens each."""
    server = LlamaServer(
        tiny_model,
        binary=llama_server_bin,
        n_slots=N_SLOTS,
        log_path=tmp_path_factory.mktemp("llama-server") / "server.log",
    )
    started = time.perf_counter()
    with server:
        print(
            f"llama-server ready in {time.perf_counter() - started:.2f} s: {server!r}, log {server.log_path}"
        )
        yield server


@pytest.fixture(scope="module")
def own_llama_server(
    llama_server_bin: Path,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[LlamaServer]:
    """A server for one test module alone: other modules' unpinned requests cannot touch its slots."""
    log = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1]) / "server.log"
    with LlamaServer(tiny_model, binary=llama_server_bin, n_slots=N_SLOTS, log_path=log) as server:
        yield server


@pytest.fixture
def llama_server_9(llama_server_bin: Path, tiny_model: Path, tmp_path: Path) -> Iterator[LlamaServer]:
    """A llama-server of 9 slots (8 for conversations, 1 for memory jobs) for one test alone."""
    with LlamaServer(
        tiny_model, binary=llama_server_bin, n_slots=9, ctx_size=9 * 2048, log_path=tmp_path / "llama9.log"
    ) as server:
        yield server
