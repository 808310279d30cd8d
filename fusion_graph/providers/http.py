"""HTTP clients for the graph's own providers that work from any event loop.

An ``httpx.AsyncClient`` keeps its connections (and their locks) bound to the
event loop that opened them; one compiled graph used from several loops (web
apps, notebooks, test suites, ``asyncio.run`` per OS thread) would fail with
"bound to a different event loop". ``loop_safe_client`` gives each loop its
own connection pool behind one client object. The TLS context is built once,
when the client is, so no certificate file is read on an event loop.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
import weakref

import httpx


class LoopTransport(httpx.AsyncBaseTransport):
    """An ``httpx`` transport with one connection pool per running event loop."""

    def __init__(self, verify: ssl.SSLContext) -> None:
        """Share ``verify`` (a ready TLS context) among the per-loop pools."""
        self._verify = verify
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncHTTPTransport] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def _pool(self) -> httpx.AsyncHTTPTransport:
        loop = asyncio.get_running_loop()
        with self._lock:
            pool = self._pools.get(loop)
            if pool is None:
                pool = self._pools[loop] = httpx.AsyncHTTPTransport(verify=self._verify)
            return pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` through the running loop's own pool."""
        return await self._pool().handle_async_request(request)

    async def aclose(self) -> None:
        """Close the running loop's pool; pools of other loops go with their loops."""
        loop = asyncio.get_running_loop()
        with self._lock:
            pool = self._pools.pop(loop, None)
        if pool is not None:
            await pool.aclose()


def loop_safe_client(timeout: float) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` usable from any event loop (see the module docstring)."""
    return httpx.AsyncClient(timeout=timeout, transport=LoopTransport(ssl.create_default_context()))
