"""The ``/metrics`` endpoint: one thread, a bounded number of connections, each with a deadline.

Why not ``prometheus_client.start_http_server``: it starts a thread per
connection and never times a connection out, so every idle connection (a port
scanner, a load balancer's half-open check, a slow client) holds a thread for
good: 300 of them took a worker from 5 threads to 305. Here one thread runs an
asyncio server, so an idle connection costs a socket, never a thread, and:

- at most ``MAX_CONNECTIONS`` connections are open at once: a new one closes the
  oldest (a scrape sends its request as soon as it connects, so the oldest is
  the idlest), so a real scrape is answered however many idle ones are held;
- a connection that has not sent its request within ``TIMEOUT_S`` seconds, or
  not taken its answer within ``TIMEOUT_S`` more, is closed;
- a request head over ``MAX_REQUEST_BYTES`` is refused (no scrape sends one).

It answers as prometheus-client's own server does (any path but
``/favicon.ico``, the text or OpenMetrics format the ``Accept`` header asks
for, gzip when accepted, ``name[]`` filters) and closes each connection after
its answer (``Connection: close``, as prometheus-client's HTTP/1.0 server did).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import socket
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

from prometheus_client.exposition import choose_encoder, gzip_accepted

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

logger = logging.getLogger(__name__)

#: Connections open at once; a new one past this closes the oldest.
MAX_CONNECTIONS = 64
#: Seconds a connection has to send its request, and then to take its answer.
TIMEOUT_S = 10.0
#: Longest request head (request line and headers) read.
MAX_REQUEST_BYTES = 16 * 1024
#: Threads the endpoint runs, however many connections it holds.
THREADS = 1


class MetricsEndpoint:
    """``/metrics`` of one registry on ``host:port``, served from a daemon thread (``THREADS``).

    Attributes:
        host: The address it listens on, as configured.
        port: The port it listens on (the one bound, when ``0`` asked for a free one).
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        """Configure it; nothing listens until ``start``."""
        self.registry = registry
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._open: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()

    def start(self) -> None:
        """Bind the socket here (so a taken port raises here), then serve it from a new thread.

        Raises:
            OSError: The address cannot be bound (the port is taken, the host is not this machine's).
        """
        family, kind, proto, _, address = socket.getaddrinfo(
            self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(128)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self.port = int(listener.getsockname()[1])
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._loop = loop
        self._thread = threading.Thread(
            target=self._serve, args=(loop, listener, ready), name="fusion-graph-metrics", daemon=True
        )
        self._thread.start()
        ready.wait()
        if loop.is_closed():
            self._loop = self._thread = None
            raise OSError(f"the /metrics server on {self.host}:{self.port} did not start")

    def close(self) -> None:
        """Stop listening, close every connection and end the thread (tests; an app that shuts down)."""
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=TIMEOUT_S)

    def _serve(
        self, loop: asyncio.AbstractEventLoop, listener: socket.socket, ready: threading.Event
    ) -> None:
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(
                asyncio.start_server(self._connection, sock=listener, limit=MAX_REQUEST_BYTES)
            )
        except BaseException:
            listener.close()
            loop.close()
            raise
        finally:
            ready.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            for writer in list(self._open):
                writer.transport.abort()
            self._open.clear()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, server.wait_closed(), return_exceptions=True))
            loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open[writer] = None
        while len(self._open) > MAX_CONNECTIONS:
            oldest, _ = self._open.popitem(last=False)
            oldest.transport.abort()
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT_S)
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
                return  # idle past the deadline, gone, or a head no scrape sends
            writer.write(self._answer(head))
            with contextlib.suppress(TimeoutError, OSError):
                await asyncio.wait_for(writer.drain(), TIMEOUT_S)
        finally:
            self._open.pop(writer, None)
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()  # an answer it never took
            else:
                writer.close()

    def _answer(self, head: bytes) -> bytes:
        """The whole HTTP response to one request head."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return _response("400 Bad Request", [], b"")
        method, target, _ = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        allow = [("Allow", "OPTIONS,GET,HEAD")]
        if method == "OPTIONS":
            return _response("200 OK", allow, b"")
        if method not in ("GET", "HEAD"):
            return _response("405 Method Not Allowed", allow, f"# use GET, not {method[:16]}\n".encode())
        url = urlsplit(target)
        if url.path == "/favicon.ico":
            return _response("200 OK", [], b"")
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        params = parse_qs(url.query)
        registry = self.registry
        names = params.get("name[]")
        try:
            body = encoder(registry.restricted_registry(names) if names else registry)
        except Exception:  # a failing collector is this scrape's 500, not the server's end
            logger.exception("collecting /metrics failed")
            return _response("500 Internal Server Error", [], b"# collecting the metrics failed\n")
        extra = [("Content-Type", content_type)]
        if gzip_accepted(headers.get("accept-encoding", "")):
            body = gzip.compress(body)
            extra.append(("Content-Encoding", "gzip"))
        return _response("200 OK", extra, b"" if method == "HEAD" else body, length=len(body))


def _response(status: str, headers: list[tuple[str, str]], body: bytes, length: int | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers)]
    lines += [f"Content-Length: {len(body) if length is None else length}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1") + body
