"""How a client reaches a broker: server lists, TLS contexts, why an attempt failed.

Shared by every client that opens its own sockets: the asyncio clients
(:mod:`ferrymq.client._transport`, :mod:`ferrymq.client._session`), the Spark connector's
blocking connection (:mod:`ferrymq.spark._wire`) and the CLI. What is said on the connection
once it is open is :mod:`ferrymq.protocol.client`'s; the options every TCP socket gets are
:mod:`ferrymq._sockets`'.

TLS: :func:`client_tls_context` turns the clients' ``tls=`` option into an ``ssl.SSLContext``
(``True``: the system's CAs; a path: that CA bundle; a context: as given). The broker's
certificate is always verified, host name included.
"""

from __future__ import annotations

import socket
import ssl

from ferrymq.errors import ConfigError

DEFAULT_PORT = 9876
"""The broker's port when a server address names none."""

TLSOption = bool | str | ssl.SSLContext | None
"""The clients' ``tls=``: None/False plain TCP; True verify with the system's CAs; a path to a
CA bundle (PEM) to verify with; or a ready ``ssl.SSLContext`` (client certificates, pinning)."""


def parse_servers(servers: str | list[str] | tuple[str, ...]) -> list[tuple[str, int]]:
    """``"h1:p1,h2:p2"`` or a list of ``host:port`` into address pairs.

    Raises:
        ConfigError: an address that does not parse.
    """
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    out: list[tuple[str, int]] = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        host, _, port = item.rpartition(":")
        if not host:
            host, port = item, str(DEFAULT_PORT)
        try:
            p = int(port)
        except ValueError:
            raise ConfigError(f"bad server address {item!r}: expected host:port") from None
        if not 0 < p < 65536:
            raise ConfigError(f"bad port in {item!r}")
        out.append((host.strip("[]"), p))
    if not out:
        raise ConfigError("no server address given")
    return out


def client_tls_context(tls: TLSOption = True, *, cert_file: str | None = None,
                       key_file: str | None = None) -> ssl.SSLContext | None:
    """Build the client's TLS context from a ``tls=`` option.

    Args:
        tls: see :data:`TLSOption`.
        cert_file: a client certificate (PEM) to present (with ``key_file``).
        key_file: its private key.

    Raises:
        ConfigError: a file cannot be loaded, or ``tls`` is of the wrong type.
    """
    if isinstance(tls, ssl.SSLContext):
        return tls
    if tls is None or tls is False:
        if cert_file:
            raise ConfigError("a TLS client certificate needs tls=")
        return None
    if not isinstance(tls, bool | str):
        raise ConfigError(f"tls= must be a bool, a CA file path or an ssl.SSLContext, "
                          f"not {type(tls).__name__}")
    try:
        ctx = ssl.create_default_context(cafile=None if tls is True else tls)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if cert_file:
            ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS files: {exc}") from None
    return ctx


TIMED_OUT = "timed out"
"""What :func:`connect_failure` says of an attempt that ran out of time."""
REFUSED = "connection refused"
"""What :func:`connect_failure` says of a port nobody listens on (a broker that is down)."""


def connect_failure(exc: BaseException) -> str:
    """Why a connection attempt failed, in the words a user looks for: "connection refused",
    "timed out", "name not resolved", or the system's message for other socket errors."""
    if isinstance(exc, socket.gaierror):
        return "name not resolved"
    if isinstance(exc, TimeoutError):  # asyncio's timeout and a socket's ETIMEDOUT alike
        return TIMED_OUT
    if isinstance(exc, ConnectionRefusedError):
        return REFUSED
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[:1].lower() + exc.strerror[1:]
    return str(exc) or type(exc).__name__
