"""The listener's TLS context, built once from the broker config.

TLS 1.2 is the minimum; the ``ssl`` module's defaults choose the ciphers. Client certificates
are off (``tls_client_auth = "none"``), verified when sent (``optional``) or required
(``required``) against ``tls_ca_file``. Certificates are read at start: a missing or mismatched
file stops the broker with a clear error instead of failing every handshake later.
"""

from __future__ import annotations

import ssl

from ferrymq._connect import client_tls_context
from ferrymq.broker.config import BrokerConfig
from ferrymq.errors import ConfigError


def peer_context(cfg: BrokerConfig) -> ssl.SSLContext | None:
    """The TLS context of this broker's connections to other brokers (a follower fetching from
    its leader), or None when ``tls_cert_file`` is not set (the listeners are plain TCP).

    The peer's certificate is checked against ``tls_ca_file`` (the system's CAs when unset) and
    its advertised host name; with ``tls_client_auth`` on, this broker presents its own
    certificate, which then needs both the serverAuth and clientAuth key usages.

    Raises:
        ConfigError: a certificate, key or CA file cannot be loaded.
    """
    if not cfg.tls_cert_file:
        return None
    return client_tls_context(
        cfg.tls_ca_file or True,
        cert_file=cfg.tls_cert_file if cfg.tls_client_auth != "none" else None,
        key_file=cfg.tls_key_file if cfg.tls_client_auth != "none" else None)


def server_context(cfg: BrokerConfig) -> ssl.SSLContext | None:
    """The listener's TLS context, or None when ``tls_cert_file`` is not set.

    Raises:
        ConfigError: a certificate, key or CA file cannot be loaded.
    """
    if not cfg.tls_cert_file:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load tls_cert_file {cfg.tls_cert_file} / tls_key_file "
                          f"{cfg.tls_key_file}: {exc}") from None
    if cfg.tls_client_auth != "none":
        try:
            ctx.load_verify_locations(cafile=cfg.tls_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load tls_ca_file {cfg.tls_ca_file}: {exc}") from None
        ctx.verify_mode = (ssl.CERT_REQUIRED if cfg.tls_client_auth == "required"
                           else ssl.CERT_OPTIONAL)
    return ctx
