"""Pytest fixtures for several real llama-servers behind a real ``smg`` gateway.

``llama_pool`` (one per test module) starts two fresh llama-servers (the tiny
model, ``--alias local``, ``POOL_SLOTS`` slots each) behind one gateway with
``--policy manual --assignment-mode min_group --routing-key-headers
x-fusion-thread``: what a pooled fusion-graph deployment runs. ``own_llama_pool``
is the same for one test alone, for tests that stop a box. A missing ``smg``
or llama-server skips the tests locally and fails them under ``CI=true``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from fusion_graph_testing import (
    DEFAULT_ROUTING_KEY_HEADER,
    Gateway,
    GatewayNotInstalled,
    LlamaServer,
    ensure_smg,
)
from tests.plugins.requires import service_missing

#: Boxes behind the gateway.
POOL_BOXES = 2
#: ``-np`` of each box.
POOL_SLOTS = 9
#: Context per slot (``-c`` is ``POOL_SLOTS`` times this).
POOL_SLOT_CTX = 2048
#: The served model id every box answers to (``--alias``); requests send ``"model": POOL_MODEL``.
POOL_MODEL = "local"


@dataclass(frozen=True)
class LlamaPool:
    """Running boxes and the gateway in front of them."""

    gateway: Gateway
    boxes: tuple[LlamaServer, ...]

    @property
    def worker_urls(self) -> tuple[str, ...]:
        """The boxes' base URLs, in box order (what the gateway names in ``x-smg-routed-worker-id``)."""
        return tuple(box.base_url for box in self.boxes)

    @property
    def routing_key_header(self) -> str:
        """The request header that pins a routing key to a box."""
        return self.gateway.routing_key_header or DEFAULT_ROUTING_KEY_HEADER

    def box(self, url: str | None) -> LlamaServer:
        """The box a gateway response names (``served_by``)."""
        index = self.gateway.worker_index(url)
        if index is None:
            raise KeyError(f"{url!r} is none of the pool's boxes {self.worker_urls}")
        return self.boxes[index]


@contextmanager
def start_llama_pool(
    model: Path, *, llama_bin: Path, smg_bin: Path, logs: Path, boxes: int = POOL_BOXES
) -> Iterator[LlamaPool]:
    """Starts ``boxes`` llama-servers and a gateway; stops all of them on exit, also on failure."""
    with ExitStack() as stack:
        started = []
        for index in range(boxes):
            server = LlamaServer(
                model,
                binary=llama_bin,
                n_slots=POOL_SLOTS,
                ctx_size=POOL_SLOTS * POOL_SLOT_CTX,
                extra_args=["--alias", POOL_MODEL],
                log_path=logs / f"box{index}.log",
            )
            started.append(stack.enter_context(server))
        gateway = Gateway(
            [box.base_url for box in started],
            policy="manual",
            routing_key_header=DEFAULT_ROUTING_KEY_HEADER,
            assignment_mode="min_group",
            binary=smg_bin,
            log_path=logs / "smg.log",
        )
        stack.enter_context(gateway)
        yield LlamaPool(gateway, tuple(started))


@pytest.fixture(scope="session")
def smg_bin() -> Path:
    """The ``smg`` launcher, or skip/fail when it is not installed."""
    try:
        return ensure_smg()
    except GatewayNotInstalled as exc:
        service_missing(str(exc))


@pytest.fixture(scope="module")
def llama_pool(
    llama_server_bin: Path,
    tiny_model: Path,
    smg_bin: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[LlamaPool]:
    """Two fresh boxes behind one gateway (manual policy, ``min_group``), shared by one test module."""
    logs = tmp_path_factory.mktemp(f"pool-{request.module.__name__.rsplit('.', 1)[-1]}")
    with start_llama_pool(tiny_model, llama_bin=llama_server_bin, smg_bin=smg_bin, logs=logs) as pool:
        yield pool


@pytest.fixture
def own_llama_pool(
    llama_server_bin: Path, tiny_model: Path, smg_bin: Path, tmp_path: Path
) -> Iterator[LlamaPool]:
    """A pool for one test alone: it may stop a box without touching other tests."""
    with start_llama_pool(tiny_model, llama_bin=llama_server_bin, smg_bin=smg_bin, logs=tmp_path) as pool:
        yield pool
