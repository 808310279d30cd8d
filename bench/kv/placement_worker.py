"""A worker process of ``bench.kv.workers``: its own ``ProviderResolver``, hence its own placer.

``python -m bench.kv.placement_worker --serve PORT`` builds a ``ProviderResolver``
from its ``FUSION_*`` environment (the deployment's operator settings: where the
local leg is, the boxes behind a gateway, whether the slot table is shared in
Postgres) and answers one JSON line per connection: ``{"op": "step", "thread",
"messages"}`` is placed (``resolver.placement.place``) and sent inside the
slot's turn (``Placement.hold``, as the graph's provider call does) as a raw
request (``max_tokens: 1``, ``temperature: 0``, the placement's ``id_slot`` +
``cache_prompt`` and headers) to the placement's box when it names one, else to
the local link's base URL. The reply has llama-server's ``timings``, the slot,
the box and the placement's notes; with ``"answer_tokens": N`` the answer has N
tokens with their top 3, and the reply has the body sent and the answer too, for
the answers check.
``{"op": "release", "thread"}`` says the thread's run ended
(``placement.release``, as the graph's run queue does).
``PlacementWorker`` starts one (``ManagedProcess``: stopped by its own PID) and
sends it steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import httpx

from bench.kv.server import MAX_TOKENS
from bench.kv.threads import REQUEST_TIMEOUT_S
from bench.traces import REPO_ROOT
from fusion_graph.context import FusionContext
from fusion_graph.providers.resolver import ProviderResolver
from fusion_graph.providers.slots import box_name
from fusion_graph_testing.answers import TOP
from fusion_graph_testing.llama_server import HOST, free_port
from fusion_graph_testing.process import ManagedProcess

#: Seconds a worker may take to build its resolver and listen.
WORKER_START_TIMEOUT_S = 120.0
#: Longest JSON line a worker or its client reads (a request carries its whole conversation).
LINE_LIMIT = 64 * 1024 * 1024
#: Seconds the client waits for a reply beyond the worker's own request timeout.
REPLY_GRACE_S = 30.0


async def serve(port: int) -> None:
    """Place and send the steps the coordinator sends, one JSON line a request and one a reply."""
    resolver = ProviderResolver()  # the operator settings from this process's FUSION_* environment
    chain = await resolver.chain(FusionContext(mode="local"))
    link = next(link for link in chain.links if link.leg == "local")
    base_url = link.base_url or resolver.settings.local_base_url
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits) as client:

        async def step(request: Mapping[str, Any]) -> dict[str, Any]:
            thread = str(request["thread"])
            placement = await resolver.placement.place(link, thread)
            async with placement.hold() as sent:  # the slot's turn, as the graph's provider call holds it
                url = f"{sent.box}/v1" if sent.box else base_url
                body = {
                    "model": resolver.settings.local_model,
                    "messages": request["messages"],
                    "max_tokens": request.get("answer_tokens") or MAX_TOKENS,
                    "temperature": 0,
                    **(sent.body("local") or {}),
                }
                if request.get(
                    "answer_tokens"
                ):  # for the answers check: the tokens and their top alternatives
                    body |= {"logprobs": True, "top_logprobs": TOP}
                try:
                    response = await client.post(
                        f"{url}/chat/completions", json=body, headers=dict(sent.headers or {})
                    )
                except httpx.TimeoutException as error:
                    raise RuntimeError(
                        f"no answer from {url} within {REQUEST_TIMEOUT_S:.0f} s (slot {sent.slot}, "
                        f"{type(error).__name__}); a stuck llama-server?"
                    ) from error
            finished = time.time()
            if response.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:500]}")
            answer = response.json()
            timings = answer["timings"]
            return {
                "prompt_n": int(timings["prompt_n"]),
                "cache_n": int(timings["cache_n"]),
                "prompt_ms": float(timings["prompt_ms"]),
                "slot": sent.slot,
                "box": box_name(sent.box or url),
                "notes": dict(sent.notes),
                "finished": finished,
                **({"body": body, "answer": answer} if request.get("answer_tokens") else {}),
            }

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                request = json.loads(await reader.readline())
                reply: dict[str, Any] = {"ok": True, "pid": os.getpid()}
                if request.get("op") == "step":
                    reply.update(await step(request))
                elif request.get("op") == "release":  # the thread's run ended (as the graph's run queue says)
                    await resolver.placement.release(str(request["thread"]))
            except Exception as error:  # noqa: BLE001 - the coordinator gets the error as its reply
                reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
            writer.write(json.dumps(reply, default=str).encode() + b"\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, HOST, port, limit=LINE_LIMIT)
        print(
            f"placement worker {os.getpid()} on {HOST}:{port}: {type(resolver.placement).__name__}",
            flush=True,
        )
        try:
            async with server:
                await server.serve_forever()
        finally:
            await resolver.aclose()


class PlacementWorker(ManagedProcess):
    """One worker process (``python -m bench.kv.placement_worker --serve PORT``), stopped by its PID."""

    def __init__(self, env: Mapping[str, str], *, log_path: Path) -> None:
        """A worker whose resolver reads its operator settings from ``env`` (``FUSION_*``)."""
        self.env = dict(env)
        self.log_path = log_path
        self.port = 0

    def args(self) -> list[str]:
        """The worker's command line."""
        return [sys.executable, "-m", "bench.kv.placement_worker", "--serve", str(self.port)]

    def launch_env(self) -> Mapping[str, str]:
        """This environment less its ``FUSION_*``, plus the worker's own; the checkout importable."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_")}
        path = os.pathsep.join(p for p in (str(REPO_ROOT), base.get("PYTHONPATH", "")) if p)
        return {**base, **self.env, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}

    def launch_cwd(self) -> Path:
        """The log's folder: no ``.env`` of the checkout is read."""
        return self.log_path.parent

    def start(self) -> Self:
        """Launch on a free port and wait until it listens (its resolver is built by then)."""
        self.port = free_port()
        self._launch()
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(self._failure("the placement worker exited while starting"))
            try:
                with socket.create_connection((HOST, self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(
            self._failure(f"the placement worker did not listen within {WORKER_START_TIMEOUT_S:g} s")
        )

    async def step(
        self, thread: str, messages: Sequence[Mapping[str, Any]], *, answer_tokens: int | None = None
    ) -> dict[str, Any]:
        """Place and send one local step of ``thread``; the reply has timings, slot and box.

        ``answer_tokens``: that many greedy tokens with their top 3, and the body and answer returned.
        """
        payload = {"op": "step", "thread": thread, "messages": list(messages), "answer_tokens": answer_tokens}
        return await self._ask(payload)

    async def release(self, thread: str) -> None:
        """``thread``'s run ended: the worker's placer may give its slot to a thread that needs one."""
        await self._ask({"op": "release", "thread": thread})

    async def _ask(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """One JSON line to the worker, one back; an error reply raises ``RuntimeError``."""
        thread = payload.get("thread")
        reader, writer = await asyncio.open_connection(HOST, self.port, limit=LINE_LIMIT)
        try:
            writer.write(json.dumps(payload).encode() + b"\n")
            await writer.drain()
            try:
                line = await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT_S + REPLY_GRACE_S)
            except TimeoutError:
                raise RuntimeError(
                    f"worker on port {self.port}: no answer for {thread} within "
                    f"{REQUEST_TIMEOUT_S + REPLY_GRACE_S:.0f} s"
                ) from None
        finally:
            writer.close()
        if not line:
            raise RuntimeError(self._failure("the placement worker closed the connection"))
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"worker on port {self.port}, {thread}: {reply.get('error')}")
        return reply


if __name__ == "__main__":  # python -m bench.kv.placement_worker --serve PORT
    parser = argparse.ArgumentParser(prog="python -m bench.kv.placement_worker")
    parser.add_argument(
        "--serve", type=int, required=True, metavar="PORT", help="listen on this loopback port"
    )
    asyncio.run(serve(parser.parse_args().serve))
