"""Socket options every FerryMQ TCP connection gets, on both ends.

* ``TCP_NODELAY``: requests and answers are whole frames written at once; Nagle would only
  hold the small answers back.
* ``SO_KEEPALIVE``: the kernel notices peers that vanished without a FIN (on top of the
  protocol's own heartbeats).
* Loopback connections get a congestion control that does not pace (``cubic``, or ``reno``
  where only the allowed list may be chosen), set before the connection is established: on a
  client's socket before ``connect``, on a listener bound to a loopback address before it
  accepts (accepted sockets inherit it). Linux's BBR paces every connection it starts on; with
  no ``fq`` qdisc (loopback has none) it paces with a timer, so part of a stream's segments go
  out from the timer's softirq and part from the writing thread, on different CPUs, and on
  loopback they arrive reordered. Each reordering starts a SACK recovery: a spurious
  retransmission, a smaller window and a pause. With BBR as the system default, one 1 GB
  produce of 10 KB messages showed 60-110 retransmitted segments and ran 10-20 % slower than
  over ``cubic`` sockets (bench/README, session 8). Switching a connected socket is too late:
  pacing, once BBR turned it on, stays on. Loopback has no congestion to control, so nothing is
  lost by not pacing; other connections keep the system's choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from typing import Any, Protocol

LOOPBACK_CONGESTION = (b"cubic", b"reno")
"""Tried in order on loopback connections; the first the kernel accepts is kept (an
unprivileged process may only pick one of ``net.ipv4.tcp_allowed_congestion_control``)."""

_TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)


class SocketLike(Protocol):
    """What :func:`tune_listener` needs: a socket, or the wrapper an event loop hands out."""

    @property
    def family(self) -> int: ...

    def getsockname(self) -> Any: ...

    def getsockopt(self, level: int, optname: int, buflen: int) -> bytes: ...

    def setsockopt(self, level: int, optname: int, value: bytes) -> None: ...


def tune(sock: socket.socket) -> None:
    """Set FerryMQ's options on a connected TCP socket; options the platform refuses are
    skipped (they tune, they are not needed for correctness)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1 or a v4-mapped loopback)."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def set_loopback_congestion(sock: SocketLike) -> bytes | None:
    """Give ``sock`` (not connected yet, or a listener) the first of
    :data:`LOOPBACK_CONGESTION` the kernel accepts; the name set, or None (not Linux, or none
    allowed: the system's choice stays)."""
    try:
        current = sock.getsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, 16).rstrip(b"\0")
    except OSError:
        return None
    if current in LOOPBACK_CONGESTION:
        return current
    for name in LOOPBACK_CONGESTION:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, _TCP_CONGESTION, name)
        except OSError:
            continue
        return name
    return None


def tune_listener(sock: SocketLike) -> None:
    """A listening socket: bound to a loopback address, its connections will not pace."""
    if sock.family in (socket.AF_INET, socket.AF_INET6) and is_loopback(sock.getsockname()[0]):
        set_loopback_congestion(sock)


def _new_socket(family: int, sockaddr: tuple[Any, ...]) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    if is_loopback(str(sockaddr[0])):
        set_loopback_congestion(sock)
    return sock


async def connect(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to ``host:port``, trying each resolved address in
    turn (a loopback one with :func:`set_loopback_congestion` before connecting).

    Raises:
        OSError: no address could be connected (the last error, or the resolver's).
    """
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    last: OSError = OSError(f"no address for {host}:{port}")
    for family, _type, _proto, _name, sockaddr in infos:
        sock = _new_socket(family, sockaddr)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, sockaddr)
        except OSError as exc:
            sock.close()
            last = exc
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise last


def connect_blocking(host: str, port: int, timeout_s: float) -> socket.socket:
    """:func:`connect` for blocking callers (``socket.create_connection`` with the loopback
    congestion control); the socket keeps ``timeout_s``."""
    last: OSError = OSError(f"no address for {host}:{port}")
    for family, _type, _proto, _name, sockaddr in socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM):
        sock = _new_socket(family, sockaddr)
        try:
            sock.settimeout(timeout_s)
            sock.connect(sockaddr)
        except OSError as exc:
            sock.close()
            last = exc
            continue
        return sock
    raise last
