"""A TCP fault proxy: forwards a loopback port to a target, and can cut the link on demand.

Theory of operation
-------------------
Each :class:`FaultProxy` listens on its own port and, for every connection accepted, opens one
to the target and pumps bytes both ways. :meth:`FaultProxy.blackhole` makes the link silent
the way a network partition does (packets dropped, nothing reset): open connections stay open
but carry nothing, and new ones are accepted and never answered, so the peers notice only
through their own timeouts, leases and keep-alives. :meth:`FaultProxy.drop` instead resets
every connection and refuses new ones (a peer that crashed). :meth:`FaultProxy.heal` forwards
again (connections cut by ``drop`` stay closed; blackholed ones that outlived the fault carry
on where they were: TCP would have retransmitted).

All proxies of a run live in one :class:`ProxyThread`: an event loop of their own in a
thread, so a busy workload loop does not slow the links, and the test drives them from any
thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from ferrymq.testing import free_port

__all__ = ["FaultProxy", "ProxyThread"]

T = TypeVar("T")
CHUNK = 64 * 1024


class FaultProxy:
    """Forwards ``127.0.0.1:port`` to ``target`` (host, port) until told otherwise."""

    def __init__(self, target: tuple[str, int], port: int = 0) -> None:
        self.target = target
        self.port = port or free_port()
        self.mode = "forward"
        """``forward``, ``blackhole`` or ``drop``."""
        self._healed = asyncio.Event()
        self._healed.set()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> str:
        """``127.0.0.1:port``."""
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        """Listen."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port,
                                                  reuse_address=True)

    async def close(self) -> None:
        """Stop listening and close every connection."""
        if self._server is not None:
            self._server.close()
        self._reset_all()
        self._healed.set()

    def _reset_all(self) -> None:
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def set_mode(self, mode: str) -> None:
        """``forward`` (heal), ``blackhole`` or ``drop``."""
        self.mode = mode
        if mode == "forward":
            self._healed.set()
            return
        self._healed.clear()
        if mode == "drop":
            self._reset_all()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "drop":
            writer.transport.abort()
            return
        self._writers.add(writer)
        try:
            await self._healed.wait()  # a blackholed link answers nothing, not even a connect
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                return
            self._writers.add(up_writer)
            try:
                await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
            finally:
                self._writers.discard(up_writer)
                up_writer.transport.abort()
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await src.read(CHUNK):
                await self._healed.wait()  # blackholed: what arrives is held, never delivered
                if self.mode == "drop" or dst.transport.is_closing():
                    break
                dst.write(data)
                await dst.drain()
        dst.transport.abort()  # one side gone: so is the other (no half-closed links)


class ProxyThread:
    """An event loop in a thread that runs :class:`FaultProxy` es; use as a context manager."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fault-proxies",
                                        daemon=True)
        self.proxies: list[FaultProxy] = []

    def __enter__(self) -> ProxyThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.proxies:
            self.run(p.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the proxies' loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def proxy(self, target: str) -> FaultProxy:
        """A new proxy to ``host:port``, listening."""
        host, _, port = target.rpartition(":")

        async def make() -> FaultProxy:  # the Event belongs to the proxies' loop
            p = FaultProxy((host, int(port)))
            await p.start()
            return p

        p = self.run(make())
        self.proxies.append(p)
        return p

    def set_mode(self, proxy: FaultProxy, mode: str) -> None:
        """Change ``proxy``'s mode (``forward``, ``blackhole``, ``drop``)."""
        self.run(proxy.set_mode(mode))
