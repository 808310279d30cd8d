"""The gateway harness: ``smg`` discovery, and two live llama-servers behind a live gateway.

What the pool tests pin down (smg 1.13, ``--policy manual --assignment-mode
min_group --routing-key-headers x-fusion-thread``):

* a routing key sticks to one box, and the response says which
  (``x-smg-routed-worker-id``);
* ``min_group`` gives a new key the box with the fewest keys *in flight* (ties
  at random; a streamed response stops counting once its headers are sent),
  so the keys are opened here while the others are still generating;
* ``id_slot`` and ``cache_prompt`` pass through: a key's second request reuses
  its own slot's KV cache, more than the prefix all keys share;
* a stopped box is marked unhealthy within seconds and its keys move to the
  other box, where they stay.
"""

from __future__ import annotations

import stat
import sys
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from fusion_graph_testing import (
    Gateway,
    GatewayError,
    GatewayNotInstalled,
    ensure_smg,
    find_smg,
    free_port,
    served_by,
)
from tests.plugins.pool import POOL_MODEL, LlamaPool, place_keys

# -- discovery (no gateway needed) --------------------------------------------


def _fake_smg(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho smg 0.0.0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No SMG_BIN, an empty PATH and an interpreter with no ``smg`` beside it."""
    monkeypatch.delenv("SMG_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    return tmp_path


def test_find_prefers_smg_bin(isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = _fake_smg(isolated_env / "elsewhere" / "smg")
    _fake_smg(isolated_env / "venv" / "bin" / "smg")
    monkeypatch.setenv("SMG_BIN", str(explicit))
    assert find_smg() == explicit


def test_find_uses_path_then_the_interpreters_bin(
    isolated_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    beside = _fake_smg(isolated_env / "venv" / "bin" / "smg")
    assert find_smg() == beside
    on_path = _fake_smg(isolated_env / "bin" / "smg")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_smg() == on_path


def test_ensure_without_smg_says_how_to_install(isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(GatewayNotInstalled, match=r"pip install 'fusion-graph\[pool\]'"):
        ensure_smg()
    monkeypatch.setenv("SMG_BIN", str(isolated_env / "missing" / "smg"))
    with pytest.raises(GatewayNotInstalled, match="SMG_BIN"):
        ensure_smg()


def test_command_line_keeps_the_metrics_listener_on_loopback(tmp_path: Path) -> None:
    binary = _fake_smg(tmp_path / "smg")
    manual = Gateway(["http://127.0.0.1:1", "http://127.0.0.1:2"], binary=binary, log_path=tmp_path / "m.log")
    args = manual.args()
    assert args[1] == "launch"
    assert args[args.index("--routing-key-headers") + 1] == "x-fusion-thread"
    assert args[args.index("--assignment-mode") + 1] == "min_group"
    assert args[args.index("--prometheus-host") + 1] == "127.0.0.1"
    assert args[args.index("--health-check-interval-secs") + 1] == "1"
    # other policies take no routing key; extra arguments come last, so they win
    other = Gateway(
        ["http://127.0.0.1:1"],
        policy="round_robin",
        extra_args=["--health-check-interval-secs", "5"],
        binary=binary,
        log_path=tmp_path / "r.log",
    )
    args = other.args()
    assert "--routing-key-headers" not in args and "--assignment-mode" not in args
    assert args[-2:] == ["--health-check-interval-secs", "5"]
    assert served_by(httpx.Headers({"X-SMG-Routed-Worker-Id": "http://127.0.0.1:2"})) == "http://127.0.0.1:2"
    assert served_by({"x-smg-routed-worker-id": "http://127.0.0.1:1"}) == "http://127.0.0.1:1"
    assert served_by({}) is None


def test_a_gateway_whose_worker_never_answers_fails_and_is_stopped(smg_bin: Path, tmp_path: Path) -> None:
    gateway = Gateway(
        [f"http://127.0.0.1:{free_port()}"], binary=smg_bin, startup_timeout=3, log_path=tmp_path / "smg.log"
    )
    with pytest.raises(GatewayError, match="every worker registered and healthy"):
        gateway.start()
    assert not gateway.running and gateway.pid is None
    assert "--worker-urls" in gateway.log_path.read_text(encoding="utf-8")  # the log is kept


# -- a live pool -----------------------------------------------------------------

#: Long enough that the prefix all keys share is clearly measurable.
SHARED_SYSTEM = (
    "You are a careful software agent. Read the task, plan, then act one tool call at a time. " * 6
)
KEYS = tuple(f"thread-{i}" for i in range(8))


def _first_turn(key: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SHARED_SYSTEM},
        {
            "role": "user",
            "content": f"Task for {key}: rename every helper in module {key} and run its tests.",
        },
    ]


def _second_turn(key: str) -> list[dict[str, Any]]:
    return [
        *_first_turn(key),
        {"role": "assistant", "content": f"I will list the files of {key} first."},
        {"role": "user", "content": "The listing shows a.py, b.py and tests/. Continue."},
    ]


def _chat(
    client: httpx.Client, pool: LlamaPool, key: str, messages: Sequence[Mapping[str, Any]], **fields: Any
) -> httpx.Response:
    response = client.post(
        "/v1/chat/completions",
        headers={pool.routing_key_header: key},
        json={"model": POOL_MODEL, "messages": list(messages), "max_tokens": 1, "temperature": 0, **fields},
    )
    assert response.status_code == 200, response.text[:500]
    return response


def _open_keys(pool: LlamaPool, keys: Sequence[str]) -> dict[str, str]:
    """The keys pinned over the boxes as ``min_group`` balances them (``pool.place_keys``)."""
    return place_keys(pool, keys, _first_turn)


def _tokens(box_url: str, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The prompt as a box renders and tokenizes it (the gateway does not proxy these endpoints)."""
    with httpx.Client(base_url=box_url, timeout=30.0) as client:
        rendered = client.post("/apply-template", json={"messages": list(messages)})
        rendered.raise_for_status()
        tokenized = client.post(
            "/tokenize",
            json={"content": rendered.json()["prompt"], "add_special": True, "parse_special": True},
        )
        tokenized.raise_for_status()
        return list(tokenized.json()["tokens"])


@pytest.fixture
def client(llama_pool: LlamaPool) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=llama_pool.gateway.base_url, timeout=60.0) as http:
        yield http


@pytest.mark.llama
def test_the_gateway_lists_both_boxes_healthy(llama_pool: LlamaPool) -> None:
    workers = llama_pool.gateway.workers()
    assert sorted(w["url"] for w in workers) == sorted(llama_pool.worker_urls)
    assert all(w["is_healthy"] for w in workers)
    # /props and friends are not proxied: they are asked of the boxes themselves
    assert llama_pool.boxes[0].props()["total_slots"] == len(llama_pool.boxes[0].slots())


@pytest.mark.llama
def test_keys_spread_over_both_boxes_and_stick(llama_pool: LlamaPool, client: httpx.Client) -> None:
    boxes = _open_keys(llama_pool, KEYS)
    per_box = Counter(boxes.values())
    assert set(per_box) == set(llama_pool.worker_urls)
    assert min(per_box.values()) >= 2, per_box
    for _ in range(2):
        for key in KEYS:
            assert served_by(_chat(client, llama_pool, key, _first_turn(key)).headers) == boxes[key]


@pytest.mark.llama
def test_a_keys_second_request_reuses_its_slot_beyond_the_shared_prefix(
    llama_pool: LlamaPool, client: httpx.Client
) -> None:
    keys = [f"reuse-{i}" for i in range(4)]  # a slot of its own each, whichever box a key lands on
    box_url = llama_pool.worker_urls[0]
    first = {key: _tokens(box_url, _first_turn(key)) for key in keys}
    second = {key: _tokens(box_url, _second_turn(key)) for key in keys}
    shared = len(_common_prefix(first[keys[0]], first[keys[1]]))
    assert 0 < shared < len(first[keys[0]])

    served = {}
    for slot, key in enumerate(keys):
        response = _chat(client, llama_pool, key, _first_turn(key), id_slot=slot, cache_prompt=True)
        served[key] = served_by(response.headers)
    for slot, key in enumerate(keys):  # other keys ran in between, on the same boxes
        response = _chat(client, llama_pool, key, _second_turn(key), id_slot=slot, cache_prompt=True)
        assert served_by(response.headers) == served[key]
        timings = response.json()["timings"]
        assert timings["cache_n"] > shared, (key, timings, shared)
        assert timings["cache_n"] >= len(_common_prefix(first[key], second[key])) - 1
        assert timings["prompt_n"] + timings["cache_n"] == len(second[key])


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return list(a[:n])


@pytest.mark.llama
def test_stopping_a_box_moves_its_keys_to_the_other(own_llama_pool: LlamaPool) -> None:
    pool = own_llama_pool
    with httpx.Client(base_url=pool.gateway.base_url, timeout=60.0) as client:
        boxes = _open_keys(pool, KEYS)
        assert set(boxes.values()) == set(pool.worker_urls)
        stopped, survivor = pool.worker_urls
        pool.box(stopped).stop()
        pool.gateway.wait_worker_down(stopped)
        assert pool.gateway.healthy_workers() == [survivor]

        moved = [key for key in KEYS if boxes[key] == stopped]
        assert moved
        for _ in range(2):  # every key is served, by the survivor, and stays there
            for key in KEYS:
                response = _chat(client, pool, key, _first_turn(key), cache_prompt=True)
                assert served_by(response.headers) == survivor
