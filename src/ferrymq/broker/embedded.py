"""An in-process broker for users' own tests and scripts: ``with Broker(tmp_path) as b: ...``."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from ferrymq._time import SYSTEM_CLOCK, Clock
from ferrymq.broker.config import load
from ferrymq.broker.server import BrokerServer


class Broker:
    """A real broker running on its own event loop in a background thread.

    Args:
        data_dir: where the broker keeps its data.
        host: address to listen on.
        port: port; 0 picks a free one (see :attr:`address`).
        **config: any :class:`~ferrymq.broker.config.BrokerConfig` field. ``http_port`` is 0
            (no HTTP listener) unless given: brokers of tests must not all take 9877.

    Example::

        with Broker(tmp_path) as broker:
            with Producer(broker.address) as p:
                p.send(Message("orders", b"hi"))
    """

    def __init__(
        self, data_dir: str | Path, host: str = "127.0.0.1", port: int = 0, *,
        clock: Clock = SYSTEM_CLOCK, **config: Any,
    ) -> None:
        self.clock = clock
        self.config = load(overrides={"data_dir": str(data_dir), "host": host, "port": port,
                                      "http_port": 0, **config})
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: BrokerServer | None = None

    @property
    def address(self) -> str:
        """``host:port`` the broker listens on."""
        if self._server is None:
            raise RuntimeError("broker not started")
        host, port = self._server.address
        return f"{host}:{port}"

    @property
    def server(self) -> BrokerServer:
        """The running server (for tests that look inside)."""
        if self._server is None:
            raise RuntimeError("broker not started")
        return self._server

    def start(self) -> Broker:
        """Start the broker and wait until it listens."""
        started = threading.Event()
        error: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = BrokerServer(self.config, self.clock)
                loop.run_until_complete(self._server.start())
            except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
                error.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            loop.run_until_complete(self._server.wait_stopped())
            loop.close()

        self._thread = threading.Thread(target=main, name="ferrymq-broker", daemon=True)
        self._thread.start()
        started.wait()
        if error:
            raise error[0]
        return self

    def stop(self) -> None:
        """Shut down gracefully and wait for it."""
        if self._loop is None or self._server is None or self._thread is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._server.stop(), self._loop)
        fut.result(timeout=60)
        self._thread.join(timeout=60)
        self._loop = None

    def __enter__(self) -> Broker:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
