"""The chaos tests' TCP fault proxy on a real echo server: it forwards, blackholes (silent, no
reset), drops (reset, refused) and heals."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest

from tests.cluster.chaos.proxy import ProxyThread


@pytest.fixture
def echo() -> Iterator[str]:
    """An echo server on a loopback port, in a thread."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=pump, args=(conn,), daemon=True).start()

    def pump(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield f"127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join()
    srv.close()


def roundtrip(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    return sock.recv(4096)


def cut(sock: socket.socket) -> bool:
    """Whether the peer closed or reset the connection."""
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True


def test_the_proxy_forwards_blackholes_drops_and_heals(echo: str) -> None:
    with ProxyThread() as proxies:
        p = proxies.proxy(echo)
        a = socket.create_connection(("127.0.0.1", p.port), 2)
        assert roundtrip(a, b"one") == b"one"
        proxies.set_mode(p, "blackhole")
        a.settimeout(0.5)
        with pytest.raises(TimeoutError):  # silence, not a reset
            roundtrip(a, b"two")
        b = socket.create_connection(("127.0.0.1", p.port), 2)  # accepted, never answered
        b.settimeout(0.5)
        with pytest.raises(TimeoutError):
            roundtrip(b, b"new")
        proxies.set_mode(p, "forward")  # what was held flows on, as TCP would retransmit it
        a.settimeout(2)
        assert a.recv(4096) == b"two"
        b.settimeout(2)
        assert b.recv(4096) == b"new"
        proxies.set_mode(p, "drop")
        assert cut(a)  # reset (or closed): the peer sees the link go
        c = socket.create_connection(("127.0.0.1", p.port), 2)
        c.settimeout(2)
        assert cut(c)
        proxies.set_mode(p, "forward")
        d = socket.create_connection(("127.0.0.1", p.port), 2)
        assert roundtrip(d, b"healed") == b"healed"
        for s in (a, b, c, d):
            s.close()


def test_proxies_run_on_their_own_loop() -> None:
    with ProxyThread() as proxies:
        assert proxies.run(asyncio.sleep(0, "ok")) == "ok"
