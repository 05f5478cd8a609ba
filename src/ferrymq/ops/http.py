"""The broker's HTTP listener: ``/metrics``, ``/healthz``, ``/readyz`` and the web console
(``/``, :mod:`ferrymq.ops.console`) on ``http_port``.

Theory of operation
-------------------
:class:`HttpListener` is aiohttp's low-level server (``aiohttp.web.Server``: a protocol factory
and one handler coroutine, no application or router) on the broker's own event loop, bound to
the broker's ``host``. The server binds it together with the wire port (so a taken port fails the
start before anything is written), serves it before it recovers the data directory (``/readyz``
answers 503 "recovering" meanwhile), and closes it at the end of a graceful shutdown: during the
drain ``/readyz`` answers 503 "shutting down".

Limits, each a setting and each checked before anything is allocated for it:

* ``http_max_connections``: the protocol factory hands a connection beyond it a protocol that
  writes a 503 and closes it (aiohttp never sees it);
* ``http_max_header_bytes``: aiohttp's parser limits on the request line and header fields
  (400 or 431; at most 128 header fields);
* ``http_max_body_bytes``: a request whose Content-Length is larger is answered 413 and its
  connection closed, its body unread; a body without a length (chunked) is 411;
* ``http_idle_timeout_ms``: aiohttp's keep-alive timeout.

An unknown path is 404, a method other than GET or HEAD on a known path 405 (with ``Allow``;
the console's forms take POST: its routes say their methods).
The handlers only read the broker's state; ``/metrics`` renders its text on a worker thread
(:mod:`ferrymq.ops.metrics`), so a scrape holds the event loop only while it copies numbers.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from ferrymq.errors import ConfigError
from ferrymq.ops.health import not_ready_reasons
from ferrymq.ops.metrics import AppendTimes, render, take_snapshot

if TYPE_CHECKING:
    from ferrymq.broker.server import BrokerServer
    from ferrymq.ops.console import Console

__all__ = ["HttpListener"]

log = logging.getLogger("ferrymq.http")

METHODS = ("GET", "HEAD")
"""The methods every path answers (others: 405)."""
MAX_HEADER_FIELDS = 128
"""Most header fields of one request."""
SHUTDOWN_GRACE_S = 1.0
"""How long closing the listener waits for requests being answered."""
REFUSED_LINGER_S = 1.0
"""Longest a refused connection stays open (for the client to read its 503)."""
_QUIET = logging.getLogger("ferrymq.http.requests")
_QUIET.setLevel(logging.CRITICAL)  # malformed requests are answered 400, not logged
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n"
         b"Content-Length: 33\r\n\r\ntoo many connections (try again)\n")

Route = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class _Refused(asyncio.Protocol):
    """A connection beyond ``http_max_connections``: a 503, closed once the request arrived
    (closing over unread bytes would reset the connection before the client reads the 503)
    or after ``REFUSED_LINGER_S``."""

    transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(_BUSY)
        asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.close()


class HttpListener:
    """The operations listener of one broker (see the module docstring)."""

    def __init__(self, srv: BrokerServer) -> None:
        self.srv = srv
        cfg = srv.config
        self._web = web.Server(
            self._handle, keepalive_timeout=cfg.http_idle_timeout_ms / 1000,
            max_line_size=cfg.http_max_header_bytes, max_field_size=cfg.http_max_header_bytes,
            max_headers=MAX_HEADER_FIELDS, access_log=None, logger=_QUIET)
        self._server: asyncio.Server | None = None
        self._render = ThreadPoolExecutor(1, "ferrymq-metrics")
        """One scrape renders at a time; others queue (their snapshots are taken already)."""
        self._times = AppendTimes()
        self.routes: dict[str, Route] = {
            "/healthz": self._healthz, "/readyz": self._readyz, "/metrics": self._metrics}
        self.methods: dict[str, tuple[str, ...]] = {}
        """Methods of the paths that answer others than ``METHODS``."""
        self.console: Console | None = None
        if cfg.console:
            from ferrymq.ops.console import Console  # aiohttp pages: only when used
            self.console = Console(srv)
            for path, (route, methods) in self.console.routes().items():
                self.routes[path] = route
                self.methods[path] = methods
        self.refused = 0
        """Connections refused over ``http_max_connections`` (for logs and tests)."""
        self.address: tuple[str, int] = (cfg.host, cfg.http_port)

    async def bind(self) -> None:
        """Bind the port without serving yet.

        Raises:
            ConfigError: the port cannot be bound (in use, not an address of this host).
        """
        cfg = self.srv.config
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                self._protocol, cfg.host, cfg.http_port, reuse_address=True, backlog=128,
                start_serving=False)
        except OSError as exc:
            reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
            if exc.errno == errno.EADDRINUSE:
                reason += " (another broker or program listens on it; http_port = 0 turns " \
                          "the HTTP listener off)"
            raise ConfigError(f"cannot listen for HTTP on {cfg.host}:{cfg.http_port}: "
                              f"{reason}") from exc
        sock = self._server.sockets[0].getsockname()
        self.address = (sock[0], sock[1])

    async def start(self) -> None:
        """Start answering (after :meth:`bind`)."""
        assert self._server is not None
        await self._server.start_serving()  # the server logs the URL with its start lines

    async def close(self) -> None:
        """Stop listening, close the connections, stop the render thread."""
        if self._server is not None:
            self._server.close()
            self._server = None
            await self._web.shutdown(SHUTDOWN_GRACE_S)
        if self.console is not None:
            await self.console.close()
        self._render.shutdown(wait=False, cancel_futures=True)

    def _protocol(self) -> asyncio.BaseProtocol:
        if len(self._web.connections) >= self.srv.config.http_max_connections:
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                log.warning("HTTP connection refused: http_max_connections=%d reached "
                            "(%d refused so far)", self.srv.config.http_max_connections,
                            self.refused)
            return _Refused()
        return self._web()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        route = self.routes.get(request.path)
        if route is None:
            return _text(404, f"no such path: {request.path[:200]} (try /, /metrics, "
                              f"/healthz, /readyz)\n")
        methods = self.methods.get(request.path, METHODS)
        if request.method not in methods:
            resp = _text(405, f"{request.method} is not allowed on {request.path}\n")
            resp.headers["Allow"] = ", ".join(methods)
            return resp
        cap = self.srv.config.http_max_body_bytes
        if request.content_length is not None and request.content_length > cap:
            resp = _text(413, f"request body of {request.content_length} bytes is over "
                              f"http_max_body_bytes={cap}\n")
            resp.force_close()
            return resp
        if request.content_length is None and request.body_exists:
            resp = _text(411, "a request body needs a Content-Length\n")
            resp.force_close()
            return resp
        try:
            return await route(request)
        except Exception:  # a bug here must not be a client's traceback, nor stop the broker
            log.exception("HTTP %s %s failed", request.method, request.path)
            return _text(500, "internal error (see the broker log)\n")

    async def _healthz(self, request: web.BaseRequest) -> web.StreamResponse:
        return _text(200, "ok\n")

    async def _readyz(self, request: web.BaseRequest) -> web.StreamResponse:
        reasons = not_ready_reasons(self.srv)
        body = {"ready": not reasons, "reasons": reasons}
        return web.Response(status=503 if reasons else 200, text=json.dumps(body) + "\n",
                            content_type="application/json")

    async def _metrics(self, request: web.BaseRequest) -> web.StreamResponse:
        srv = self.srv
        if not srv.recovered:
            return _text(503, "metrics are not available: the broker is not open\n")
        snap = take_snapshot(srv, self._times, ready=not not_ready_reasons(srv))
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(self._render, render, snap)
        resp = web.Response(body=body)
        resp.headers["Content-Type"] = CONTENT_TYPE_PLAIN_0_0_4
        return resp


def _text(status: int, text: str) -> web.Response:
    return web.Response(status=status, text=text, content_type="text/plain")
