"""The llama-server harness: discovery, the tiny model, and a live server.

The live tests double as documentation of what this llama-server version
returns (``usage``, ``timings``, streaming chunks); run with ``-s`` to see the
printed field lists.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest

from fusion_graph_testing import (
    LlamaServer,
    LlamaServerError,
    LlamaServerNotBuilt,
    ensure_llama_server,
    find_llama_server,
    read_tokenizer_metadata,
    supports_flag,
    vocab_dir,
    write_tiny_model,
)
from tests.plugins.llama import N_SLOTS, _unavailable

# -- discovery (no binary needed) -------------------------------------------


def _fake_binary(path: Path, help_text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{help_text}\nEOF\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No LLAMA_SERVER_BIN, an empty cache root and an empty PATH."""
    monkeypatch.delenv("LLAMA_SERVER_BIN", raising=False)
    monkeypatch.delenv("LLAMA_CPP_PYTHON_VERSION", raising=False)
    monkeypatch.setenv("FUSION_GRAPH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))
    return tmp_path


def test_find_prefers_llama_server_bin(isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit = _fake_binary(isolated_env / "elsewhere" / "llama-server")
    _fake_binary(isolated_env / "cache" / "llama-server-0.3.36" / "bin" / "llama-server")
    monkeypatch.setenv("LLAMA_SERVER_BIN", str(explicit))
    assert find_llama_server() == explicit


def test_find_uses_versioned_cache_dir(isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_CPP_PYTHON_VERSION", "9.9.9")
    cached = _fake_binary(isolated_env / "cache" / "llama-server-9.9.9" / "bin" / "llama-server")
    assert find_llama_server() == cached


def test_find_falls_back_to_path(isolated_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    on_path = _fake_binary(isolated_env / "bin" / "llama-server")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_llama_server() == on_path


def test_ensure_without_binary_explains_how_to_build(isolated_env: Path) -> None:
    assert find_llama_server() is None
    with pytest.raises(LlamaServerNotBuilt, match=r"build_llama_server\.sh"):
        ensure_llama_server()
    with pytest.raises(LlamaServerNotBuilt, match=r"build_llama_server\.sh"):
        vocab_dir()


def test_supports_flag_reads_help(tmp_path: Path) -> None:
    binary = _fake_binary(
        tmp_path / "llama-server",
        "--slots, --no-slots      expose slots monitoring endpoint\n-np,   --parallel N   slots",
    )
    assert supports_flag(binary, "--slots")
    assert supports_flag(binary, "-np")
    assert not supports_flag(binary, "--slot")


def test_missing_binary_fails_under_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        _unavailable("no binary")
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception):
        _unavailable("no binary")


# -- tiny model ---------------------------------------------------------------


def test_tiny_model_copies_tokenizer_and_is_deterministic(tiny_model: Path, tmp_path: Path) -> None:
    vocab = vocab_dir() / "ggml-vocab-qwen2.gguf"
    assert read_tokenizer_metadata(tiny_model) == read_tokenizer_metadata(vocab)
    again = write_tiny_model(tmp_path / "again.gguf", vocab_gguf=vocab)
    assert again.read_bytes() == tiny_model.read_bytes()
    other = write_tiny_model(tmp_path / "other.gguf", vocab_gguf=vocab, seed=1)
    assert other.read_bytes() != tiny_model.read_bytes()


def test_the_tiny_model_recipe_writes_the_tests_model(tiny_model: Path, tmp_path: Path) -> None:
    """``python -m fusion_graph_testing.tiny_model OUT`` (testing/README.md): a model llama-server serves."""
    import subprocess
    import sys

    out = tmp_path / "recipe.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "fusion_graph_testing.tiny_model", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out)
    vocab = vocab_dir() / "ggml-vocab-qwen2.gguf"
    assert read_tokenizer_metadata(out) == read_tokenizer_metadata(vocab)
    assert out.read_bytes()[:4] == b"GGUF"


def test_tiny_model_chat_template_override(llama_server_bin: Path, tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = write_tiny_model(
        tmp_path / "t.gguf", vocab_gguf=vocab_dir() / "ggml-vocab-qwen2.gguf", chat_template=template
    )
    fields = {key: value for key, value, *_ in read_tokenizer_metadata(path)}
    assert fields["tokenizer.chat_template"] == template.encode()


def test_tiny_model_rejects_unknown_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not supported"):
        write_tiny_model(tmp_path / "x.gguf", vocab_gguf=tmp_path / "v.gguf", arch="mamba")


# -- live server --------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "You are a terse assistant for harness tests."},
    {"role": "user", "content": "Name one prime number between ten and twenty."},
]


def _chat(server: LlamaServer, **body: Any) -> dict[str, Any]:
    response = httpx.post(f"{server.openai_base_url}/chat/completions", json=body, timeout=120.0)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


@pytest.mark.llama
def test_health_and_urls(llama_server: LlamaServer) -> None:
    assert llama_server.health()
    response = httpx.get(f"{llama_server.base_url}/health", timeout=5.0)
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}
    assert llama_server.openai_base_url == llama_server.base_url + "/v1"
    models = httpx.get(f"{llama_server.openai_base_url}/models", timeout=5.0).json()
    assert models["data"], models


@pytest.mark.llama
def test_props_and_slots_match_np(llama_server: LlamaServer) -> None:
    props = llama_server.props()
    assert props["total_slots"] == N_SLOTS
    slots = llama_server.slots()
    assert [slot["id"] for slot in slots] == list(range(N_SLOTS))
    # -c is 4096 * np and the cache is per slot, so each slot gets 4096.
    assert {slot["n_ctx"] for slot in slots} == {4096}
    print("props keys:", sorted(props))
    print("slot keys:", sorted(slots[0]))


@pytest.mark.llama
def test_prompt_cache_reused_on_pinned_slot(llama_server: LlamaServer) -> None:
    body: dict[str, Any] = {"id_slot": 1, "cache_prompt": True, "max_tokens": 8, "temperature": 0}
    first = _chat(llama_server, messages=MESSAGES, **body)
    usage, timings = first["usage"], first["timings"]
    print("usage keys:", sorted(usage), "timings keys:", sorted(timings))
    assert usage["prompt_tokens"] > 0
    assert {"prompt_n", "cache_n"} <= set(timings)
    assert timings["prompt_n"] + timings["cache_n"] == usage["prompt_tokens"]

    followup = [*MESSAGES, {"role": "user", "content": "And one between twenty and thirty?"}]
    second = _chat(llama_server, messages=followup, **body)
    usage, timings = second["usage"], second["timings"]
    print("second call usage:", usage, "timings:", timings)
    assert timings["cache_n"] > 0, "the shared prefix should come from slot 1's cache"
    assert timings["prompt_n"] + timings["cache_n"] == usage["prompt_tokens"]
    assert timings["prompt_n"] < usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details")
    if details is not None:  # present in llama.cpp builds from late 2025 on
        assert details["cached_tokens"] == timings["cache_n"]


@pytest.mark.llama
def test_stream_final_chunk_carries_usage_and_timings(llama_server: LlamaServer) -> None:
    body = {
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks: list[dict[str, Any]] = []
    with httpx.stream(
        "POST", f"{llama_server.openai_base_url}/chat/completions", json=body, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    last = chunks[-1]
    print("final chunk keys:", sorted(last))
    assert last["choices"] == []  # OpenAI shape: usage arrives in its own chunk
    assert last["usage"]["prompt_tokens"] > 0
    assert {"prompt_n", "cache_n", "predicted_n"} <= set(last["timings"])
    assert chunks[-2]["choices"][0]["finish_reason"] in {"stop", "length"}


@pytest.mark.llama
def test_json_schema_response_format_is_enforced(llama_server: LlamaServer) -> None:
    schema = {
        "type": "object",
        "properties": {
            "verdict": {"type": "string", "enum": ["yes", "no", "maybe"]},
            "note": {"type": "string", "maxLength": 12},
        },
        "required": ["verdict", "note"],
        "additionalProperties": False,
    }
    data = _chat(
        llama_server,
        messages=MESSAGES,
        max_tokens=256,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    parsed = json.loads(choice["message"]["content"])
    assert set(parsed) == {"verdict", "note"}
    assert parsed["verdict"] in {"yes", "no", "maybe"}
    assert len(parsed["note"]) <= 12


@pytest.mark.llama
def test_async_context_manager_starts_and_stops(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    server = LlamaServer(tiny_model, binary=llama_server_bin, n_slots=1, log_path=tmp_path / "s.log")

    async def run() -> int:
        async with server:
            assert server.running
            assert server.props()["total_slots"] == 1
            assert server.pid is not None
            return server.pid

    pid = asyncio.run(run())
    assert not server.running and server.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "--port" in server.log_path.read_text()


@pytest.mark.llama
def test_startup_failure_reports_log_tail(llama_server_bin: Path, tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF not really")
    server = LlamaServer(bogus, binary=llama_server_bin, log_path=tmp_path / "fail.log", startup_timeout=30)
    with pytest.raises(LlamaServerError, match="exited with code") as excinfo:
        server.start()
    assert not server.running
    assert "failed to load model" in str(excinfo.value)  # the log tail is in the message
