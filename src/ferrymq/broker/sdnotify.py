"""systemd's readiness protocol (``Type=notify``): a few words sent to ``$NOTIFY_SOCKET``.

systemd starts a ``Type=notify`` service and waits for the service to say ``READY=1`` before it
starts the units ordered after it; ``STOPPING=1`` tells it a shutdown has begun. The message is
one datagram of ``KEY=VALUE`` lines on the AF_UNIX socket named by ``$NOTIFY_SOCKET`` (a path,
or an abstract-namespace name written with a leading ``@``), see sd_notify(3). It is this small,
so FerryMQ writes it itself: no libsystemd, no Python dependency. Without ``$NOTIFY_SOCKET``
(not under systemd, or another ``Type=``) nothing is sent; a send that fails is logged and
never stops the broker: readiness reporting must not take the service down.

``ferrymq broker`` reads ``$NOTIFY_SOCKET`` once at start (the command line is the edge that
reads the environment); the broker says
``READY=1`` after recovery, once it accepts connections (and has joined its cluster), and
``STOPPING=1`` when a graceful shutdown begins.
"""

from __future__ import annotations

import logging
import socket

log = logging.getLogger("ferrymq.broker")

READY = "READY=1"
STOPPING = "STOPPING=1"


def _address(notify_socket: str) -> str | bytes:
    if notify_socket.startswith("@"):  # abstract namespace: a leading NUL byte instead of '@'
        return b"\0" + notify_socket[1:].encode()
    return notify_socket


def sd_notify(notify_socket: str | None, *lines: str) -> bool:
    """Send ``lines`` (``READY=1``, ``STATUS=...``) to systemd; True if a datagram was sent.

    Args:
        notify_socket: the value of ``$NOTIFY_SOCKET`` (None or empty: not under systemd, a
            no-op). Only paths (``/run/...``) and abstract names (``@...``) are AF_UNIX
            sockets; anything else is logged and ignored.
    """
    if not notify_socket:
        return False
    if not notify_socket.startswith(("/", "@")):
        log.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract socket name: not "
                    "notifying systemd", notify_socket)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(lines).encode(), _address(notify_socket))
    except OSError as exc:
        log.warning("cannot notify systemd on %s: %s", notify_socket, exc)
        return False
    return True
