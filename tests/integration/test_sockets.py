"""Socket options on real connections: loopback connections do not pace (ferrymq._sockets)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from ferrymq import Broker, Message, Producer, _sockets
from ferrymq.client._transport import Transport
from ferrymq.protocol import messages as m

pytestmark = pytest.mark.integration

_TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)


def _available() -> set[bytes]:
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control", encoding="ascii") as f:
            return {name.encode() for name in f.read().split()}
    except OSError:
        return set()


def _congestion(sock: socket.socket | _sockets.SocketLike) -> bytes:
    return sock.getsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, 16).rstrip(b"\0")


linux_cc = pytest.mark.skipif(not _available() & set(_sockets.LOOPBACK_CONGESTION),
                              reason="needs Linux with cubic or reno")


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "::ffff:127.0.0.1"])
def test_loopback_addresses(host: str) -> None:
    assert _sockets.is_loopback(host)


@pytest.mark.parametrize("host", ["10.0.0.1", "192.168.1.2", "::", "0.0.0.0", "fe80::1%lo",
                                  "example.com", ""])
def test_other_addresses(host: str) -> None:
    assert not _sockets.is_loopback(host)


@linux_cc
def test_client_and_listener_sockets_do_not_pace(broker: Broker) -> None:
    server = broker.server
    assert server._server is not None
    for listener in server._server.sockets:
        assert _congestion(listener) in _sockets.LOOPBACK_CONGESTION

    async def main() -> tuple[bytes, bool, bool]:
        host, port = server.address
        t = await Transport.connect(host, port, 5.0)
        try:
            resp = await t.request(m.HelloRequest("test-sockets", "0"), m.HelloResponse, 5.0)
            assert t._transport is not None
            sock = t._transport.get_extra_info("socket")
            nodelay = bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            keepalive = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE))
            assert resp.max_frame_bytes > 0
            return _congestion(sock), nodelay, keepalive
        finally:
            t.close()

    cc, nodelay, keepalive = asyncio.run(main())
    assert cc in _sockets.LOOPBACK_CONGESTION
    assert nodelay and keepalive


def test_set_loopback_congestion_on_unconnected_socket() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        got = _sockets.set_loopback_congestion(sock)
        if not _available() & set(_sockets.LOOPBACK_CONGESTION):
            assert got is None
        else:
            assert got in _sockets.LOOPBACK_CONGESTION
            assert _congestion(sock) == got


def test_connect_tries_every_address(tmp_path: Path) -> None:
    """``localhost`` may resolve to ::1 first; a broker listening on 127.0.0.1 only is still
    reached (the next address is tried), and a dead port gives the connect error."""
    with Broker(tmp_path / "data", host="127.0.0.1", port=0) as b:
        port = int(b.address.rsplit(":", 1)[1])
        with Producer(f"localhost:{port}") as p:
            assert p.send(Message("t", b"x")).offset == 0

    async def dead() -> None:
        await _sockets.connect("127.0.0.1", port)

    with pytest.raises(OSError):
        asyncio.run(dead())
