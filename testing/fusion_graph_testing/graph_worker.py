"""Worker processes that each embed the compiled graph on one shared Postgres, as an app scaled out would.

``GraphWorker`` starts ``python -m fusion_graph_testing.graph_worker``: a
process that builds the graph from its ``FUSION_*`` environment with an
``AsyncPostgresSaver`` and ``AsyncPostgresStore`` on ``DATABASE_URI``, and
runs turns it is sent over a loopback socket (one JSON line a request, one a
reply). Tests and benchmarks send a thread's consecutive turns to different
workers, kill one mid-run, and read each turn's ``route_log`` back.

Run ``prepare_database`` once before starting workers: the savers' own
``setup()`` is not safe to run from two processes at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from fusion_graph_testing.llama_server import HOST, free_port
from fusion_graph_testing.process import ManagedProcess

#: Seconds a worker may take to build its graph and listen.
START_TIMEOUT_S = 120.0


async def prepare_database(url: str) -> None:
    """Create the checkpoint and store tables on ``url`` (once, before any worker starts)."""
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from langgraph.store.postgres.aio import AsyncPostgresStore

    async with AsyncPostgresSaver.from_conn_string(url) as saver:
        await saver.setup()
    async with AsyncPostgresStore.from_conn_string(url) as store:
        await store.setup()


class GraphWorker(ManagedProcess):
    """One worker process: the compiled graph, its settings from ``env``, turns over a socket."""

    def __init__(self, database_url: str, *, env: Mapping[str, str], log_path: Path) -> None:
        """A worker on ``database_url`` whose graph reads its operator settings from ``env``."""
        self.database_url = database_url
        self.env = dict(env)
        self.log_path = log_path
        self.port = 0

    def args(self) -> list[str]:
        """The worker's command line."""
        return [sys.executable, "-m", "fusion_graph_testing.graph_worker", str(self.port)]

    def launch_env(self) -> Mapping[str, str]:
        """This interpreter's environment without its ``FUSION_*``, plus the worker's own."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_")}
        return {**base, **self.env, "DATABASE_URI": self.database_url, "PYTHONUNBUFFERED": "1"}

    def start(self) -> Self:
        """Launch on a free port and wait until it answers."""
        self.port = free_port()
        self._launch()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(self._failure("the graph worker exited while starting"))
            try:
                with socket.create_connection((HOST, self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(self._failure(f"the graph worker did not listen within {START_TIMEOUT_S:g} s"))

    async def request(self, payload: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        """Send one request and return its reply (raises ``ConnectionError`` when the worker died)."""
        reader, writer = await asyncio.open_connection(HOST, self.port)
        try:
            writer.write(json.dumps(payload).encode() + b"\n")
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), timeout)
        finally:
            writer.close()
        if not line:
            raise ConnectionError(self._failure("the graph worker closed the connection"))
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"the worker failed the request: {reply.get('error')}")
        return reply

    async def turn(
        self, thread: str, text: str, context: Mapping[str, Any] | None = None, *, stream: bool = False
    ) -> dict[str, Any]:
        """One turn of ``thread``: the reply has the thread's whole ``route_log`` and messages.

        ``stream``: run it as ``astream(stream_mode="messages")`` (the reply also has the
        streamed messages' ids as ``streamed``), else as ``ainvoke``.
        """
        request = {
            "op": "turn",
            "thread": thread,
            "text": text,
            "context": dict(context or {}),
            "stream": stream,
        }
        return await self.request(request)

    async def sweep(self) -> int:
        """Run the store's pending memory jobs nobody is doing, and wait for them (``drain``)."""
        return int((await self.request({"op": "sweep"}))["swept"])


async def _serve(port: int) -> None:
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
    from langgraph.store.postgres.aio import AsyncPostgresStore

    from fusion_graph import FusionContext, build_graph
    from fusion_graph.memory import drain, sweep

    url = os.environ["DATABASE_URI"]
    async with (
        AsyncPostgresSaver.from_conn_string(url) as saver,
        AsyncPostgresStore.from_conn_string(url) as store,
    ):
        graph = build_graph(tools=[], checkpointer=saver, store=store)

        async def run(request: dict[str, Any]) -> dict[str, Any]:
            if request["op"] == "sweep":
                swept = await sweep(graph)
                await drain(60)
                return {"swept": swept}
            config: Any = {"configurable": {"thread_id": request["thread"]}}
            context = FusionContext(**request.get("context", {}))
            turn_input: Any = {"messages": [HumanMessage(request["text"])]}
            streamed: list[str | None] = []
            if request.get("stream"):
                async for chunk, _ in graph.astream(
                    turn_input, config, context=context, stream_mode="messages"
                ):
                    if chunk.id not in streamed:
                        streamed.append(chunk.id)
            else:
                await graph.ainvoke(turn_input, config, context=context)
            values = (await graph.aget_state(config)).values
            return {
                "route_log": values.get("route_log", []),
                "messages": [{"type": m.type, "id": m.id, "text": m.text} for m in values["messages"]],
                "streamed": streamed,
            }

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                request = json.loads(await reader.readline())
                reply = {"ok": True, "pid": os.getpid(), **(await run(request))}
            except Exception as error:  # noqa: BLE001 - the client gets the error as its reply
                reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
            writer.write(json.dumps(reply, default=str).encode() + b"\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, HOST, port)
        async with server:
            await server.serve_forever()


if __name__ == "__main__":  # python -m fusion_graph_testing.graph_worker PORT
    asyncio.run(_serve(int(sys.argv[1])))
