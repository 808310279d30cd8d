"""Pytest fixtures for several real llama-servers behind a real ``smg`` gateway.

``llama_pool`` (one per test module) starts two fresh llama-servers (the tiny
model, ``--alias local``, ``POOL_SLOTS`` slots each) behind one gateway with
``--policy manual --assignment-mode min_group --routing-key-headers
x-fusion-thread``: what a pooled fusion-graph deployment runs. ``own_llama_pool``
is the same for one test alone, for tests that stop a box. A missing ``smg``
or llama-server skips the tests locally and fails them under ``CI=true``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from fusion_graph_testing import (
    DEFAULT_ROUTING_KEY_HEADER,
    Gateway,
    GatewayNotInstalled,
    LlamaServer,
    ensure_smg,
    served_by,
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
    model: Path,
    *,
    llama_bin: Path,
    smg_bin: Path,
    logs: Path,
    boxes: int = POOL_BOXES,
    slots: int = POOL_SLOTS,
) -> Iterator[LlamaPool]:
    """Starts ``boxes`` llama-servers of ``slots`` slots and a gateway; stops all of them on exit."""
    with ExitStack() as stack:
        started = []
        for index in range(boxes):
            server = LlamaServer(
                model,
                binary=llama_bin,
                n_slots=slots,
                ctx_size=slots * POOL_SLOT_CTX,
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


def _opening(key: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Task for {key}: rename every helper in module {key}."}]


def _wait_in_flight(pool: LlamaPool, count: int) -> None:
    """Until the gateway counts ``count`` requests in flight over all boxes."""

    def counted(workers: list[dict[str, Any]]) -> bool:
        return sum(int(w.get("load", 0)) for w in workers) == count

    pool.gateway.wait_for_workers(counted, what=f"{count} requests in flight")


def place_keys(
    pool: LlamaPool, keys: Sequence[str], messages_of: Callable[[str], list[dict[str, Any]]] = _opening
) -> dict[str, str]:
    """Pins each routing key to a box as ``min_group`` balances them; returns each key's box.

    ``min_group`` (smg 1.13) gives a new key the box with the fewest keys *in
    flight*, ties at random, and a streamed response stops counting once its
    headers are sent. So each key starts a long non-streamed generation and the
    next key is sent only once the gateway counts it (``load`` in ``GET /workers``):
    the keys split evenly. Then all are cancelled, and one short request per key
    reads where it was pinned. Call it from a thread (it runs its own event loop).
    """

    async def open_all() -> None:
        async with httpx.AsyncClient(base_url=pool.gateway.base_url, timeout=120.0) as client:
            pending: list[asyncio.Task[httpx.Response]] = []
            try:
                for key in keys:
                    body = {"model": POOL_MODEL, "messages": messages_of(key), "max_tokens": 1500}
                    request = client.post(
                        "/v1/chat/completions",
                        headers={pool.routing_key_header: key},
                        json={**body, "ignore_eos": True},
                    )
                    pending.append(asyncio.create_task(request))
                    await asyncio.to_thread(_wait_in_flight, pool, len(pending))
            finally:
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)

    asyncio.run(open_all())
    _wait_in_flight(pool, 0)
    boxes = {}
    with httpx.Client(base_url=pool.gateway.base_url, timeout=60.0) as client:
        for key in keys:
            response = client.post(
                "/v1/chat/completions",
                headers={pool.routing_key_header: key},
                json={"model": POOL_MODEL, "messages": messages_of(key), "max_tokens": 1, "temperature": 0},
            )
            response.raise_for_status()
            url = served_by(response.headers)
            assert url is not None, "the gateway did not name the box that served"
            boxes[key] = url
    return boxes
