"""A TCP proxy on loopback that can freeze what passes through it: a database that stalls.

Put between a client and a server (``FaultProxy(port).start()``, then connect
to ``proxy.port``), it forwards bytes both ways until told otherwise:

- ``freeze()``: every open connection stops forwarding, and new ones are
  accepted but never answered (a server that stalls after connect);
- ``freeze(new=False)``: only the open connections go silent, new ones work
  (pooled connections a NAT or a failover dropped without a word);
- ``thaw()``: everything forwards again;
- ``stop()`` then ``start(proxy.port)``: the server is gone (its connections
  dropped, new ones refused), then back on the same port: a restart.

It runs on an event loop thread of its own, so a test on any loop (or none)
can drive it. Loopback only.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import TracebackType
from typing import Self

from fusion_graph_testing.llama_server import HOST

#: Bytes read at a time from either side.
CHUNK = 65_536


class FaultProxy:
    """Forwards ``HOST:port`` to ``target_port`` on loopback; see the module docstring."""

    def __init__(self, target_port: int, *, target_host: str = HOST) -> None:
        """A proxy to ``target_host:target_port``; nothing listens until ``start``."""
        self.target = (target_host, target_port)
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._gates: set[asyncio.Event] = set()
        self._connections: set[asyncio.Task[None]] = set()
        self._new_frozen = False
        #: Connections accepted so far.
        self.accepted = 0

    def start(self, port: int = 0) -> Self:
        """Listen on ``port`` (0: a free loopback port; ``port`` says which) and forward from now on."""
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(port), loop).result(timeout=10)
        return self

    async def _listen(self, port: int) -> None:
        self._server = await asyncio.start_server(self._accept, HOST, port, reuse_address=True)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        gate = asyncio.Event()
        if not self._new_frozen:
            gate.set()
        self._gates.add(gate)
        try:
            await gate.wait()  # a stalled server: the connection is accepted, nothing comes back
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            self._gates.discard(gate)
            return
        try:
            await asyncio.gather(
                self._pump(reader, upstream_writer, gate), self._pump(upstream_reader, writer, gate)
            )
        finally:
            self._gates.discard(gate)
            for end in (writer, upstream_writer):
                with contextlib.suppress(Exception):
                    end.close()

    @staticmethod
    async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter, gate: asyncio.Event) -> None:
        try:
            while data := await source.read(CHUNK):
                await gate.wait()
                sink.write(data)
                await sink.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(Exception):
                sink.close()

    def _call(self, action: str, new: bool = True) -> None:
        loop = self._loop
        if loop is None:
            raise RuntimeError("the proxy is not started")

        async def apply() -> None:
            if action == "freeze":
                for gate in self._gates:
                    gate.clear()
                self._new_frozen = new
            else:
                self._new_frozen = False
                for gate in self._gates:
                    gate.set()

        asyncio.run_coroutine_threadsafe(apply(), loop).result(timeout=10)

    def freeze(self, *, new: bool = True) -> None:
        """Stop forwarding on every open connection; ``new``: also stall connections made from now on."""
        self._call("freeze", new)

    def thaw(self) -> None:
        """Forward again, on every connection."""
        self._call("thaw")

    def stop(self) -> None:
        """Stop listening and end the loop thread (idempotent)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        self._gates, self._new_frozen = set(), False

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in self._connections:
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._connections = set()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()
