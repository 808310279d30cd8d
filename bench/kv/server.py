"""The llama-server the benchmark replays against, and its tokenization of every request.

One setup starts identical servers, so each run gets a fresh process with no
KV or prompt cache; the minimum is computed from the server's own tokens.
"""

from __future__ import annotations

import asyncio
import subprocess
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from fusion_graph_testing import LlamaServer

#: ``-np`` of the benchmark server (explicit, so every slot has its own KV cache).
N_SLOTS = 4
#: A tool-capable template matching the qwen2 vocab (renders tool_calls and tool messages).
TEMPLATE = "Qwen-Qwen2.5-7B-Instruct"
#: Training context written into the tiny model; the per-slot context must not exceed it.
MODEL_N_CTX = 131072
#: Room above the longest prompt in each slot (the one generated token, rounding).
CTX_MARGIN = 64
#: Tokens sent per local request beyond the prompt.
MAX_TOKENS = 1


@dataclass(frozen=True)
class ServerSetup:
    """Everything needed to start an identical server for each run."""

    model: Path
    template: Path
    logs: Path

    def server(self, *, n_slots: int, ctx_size: int, name: str) -> LlamaServer:
        """A configured (not yet started) server; the log lands in ``logs/name.log``."""
        from fusion_graph_testing import LlamaServer

        return LlamaServer(
            self.model,
            n_slots=n_slots,
            ctx_size=ctx_size,
            jinja=True,
            extra_args=["--chat-template-file", str(self.template)],
            log_path=self.logs / f"{name}.log",
        )


def prepare_server(workdir: Path) -> ServerSetup:
    """Write the tiny qwen2 model and the tool-capable template into ``workdir``."""
    from fusion_graph_testing import ensure_llama_server, vocab_path, write_chat_template, write_tiny_model

    ensure_llama_server()
    model = write_tiny_model(workdir / "tiny-qwen2.gguf", vocab_gguf=vocab_path("qwen2"), n_ctx=MODEL_N_CTX)
    template = write_chat_template(workdir, TEMPLATE)
    logs = workdir / "logs"
    logs.mkdir()
    return ServerSetup(model, template, logs)


def per_slot_ctx(longest_prompt: int) -> int:
    """Per-slot context for the longest prompt plus margin, rounded up to 256 (llama.cpp pads to it)."""
    need = longest_prompt + MAX_TOKENS + CTX_MARGIN
    return -(-need // 256) * 256


def server_version(binary: Path) -> str:
    """First line of ``llama-server --version`` that names the version."""
    result = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "version" in line]
    return lines[0].strip() if lines else "unknown"


async def tokenize_requests(
    base_url: str, requests: Sequence[Sequence[Mapping[str, Any]]]
) -> list[array[int]]:
    """Render each request with the server's chat template, then tokenize it as the server does."""
    results: list[array[int]] = [array("i") for _ in requests]
    semaphore = asyncio.Semaphore(4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(120.0)) as client:

        async def one(index: int) -> None:
            async with semaphore:
                rendered = await client.post("/apply-template", json={"messages": list(requests[index])})
                rendered.raise_for_status()
                tokenized = await client.post(
                    "/tokenize",
                    json={"content": rendered.json()["prompt"], "add_special": True, "parse_special": True},
                )
                tokenized.raise_for_status()
                results[index] = array("i", tokenized.json()["tokens"])

        await asyncio.gather(*(one(i) for i in range(len(requests))))
    return results
