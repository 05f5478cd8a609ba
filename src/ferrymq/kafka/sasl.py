"""SaslHandshake and SaslAuthenticate: SCRAM-SHA-256 and SCRAM-SHA-512 on the Kafka port,
against the broker's users file (the same users, secrets and ACLs as the native port).

A broker with a users file starts each Kafka connection unauthenticated: only ApiVersions,
SaslHandshake and SaslAuthenticate are served (anything else closes the connection, as a Kafka
broker does during the SASL handshake), frames are limited to ``max_pre_auth_frame_bytes`` and
the exchange must end within ``auth_timeout_ms``. SaslHandshake (v0-v1) names the mechanism:
SCRAM-SHA-256 or SCRAM-SHA-512 (UNSUPPORTED_SASL_MECHANISM otherwise). SCRAM-SHA-512 checks
the user's second credential (``scram_sha_512`` in the users file); a user without one fails
as a wrong secret would, and the log says why. Two SaslAuthenticate rounds carry the
SCRAM messages (:mod:`ferrymq.protocol.kafka.scram`); a failure is logged like a native one,
answered SASL_AUTHENTICATION_FAILED after ``auth_failure_delay_ms``, and the connection closed.
Once authenticated, every request is checked against the user's ACLs
(:func:`ferrymq.kafka.handlers.authorize`).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
from typing import TYPE_CHECKING, Any, Protocol

from kio.schema.errors import ErrorCode as KafkaError

from ferrymq.errors import AuthenticationFailedError
from ferrymq.protocol.auth import NONCE_BYTES, SHA512_MECHANISM
from ferrymq.protocol.kafka import apis
from ferrymq.protocol.kafka.scram import MECHANISMS, KafkaScramServer, parse_client_first

if TYPE_CHECKING:
    from ferrymq.broker.context import ClientConnection

log = logging.getLogger("ferrymq.kafka")

_NO_TIME = datetime.timedelta(0)


class SaslPeer(Protocol):
    """What the SASL handlers read and change on a Kafka connection."""

    sasl_mechanism: str | None
    """The mechanism SaslHandshake agreed on (None: no handshake yet)."""
    sasl: KafkaScramServer | None
    """The exchange in progress (between the two SaslAuthenticate rounds)."""

    @property
    def conn(self) -> ClientConnection:
        """The connection as FerryMQ's handlers see it."""

    def close_after_answer(self) -> None:
        """Read nothing more; close once the pending answers are written."""


def sasl_handshake(peer: SaslPeer, cls: type[Any], req: Any) -> Any:
    """Agree on SCRAM-SHA-256 or SCRAM-SHA-512."""
    if peer.conn.server.auth is None:
        return apis.build(cls, {"error_code": KafkaError.illegal_sasl_state, "mechanisms": ()})
    if req.mechanism not in MECHANISMS:
        return apis.build(cls, {"error_code": KafkaError.unsupported_sasl_mechanism,
                                "mechanisms": MECHANISMS})
    peer.sasl_mechanism = req.mechanism
    return apis.build(cls, {"error_code": KafkaError.none, "mechanisms": MECHANISMS})


def sasl_authenticate(peer: SaslPeer, cls: type[Any], req: Any) -> Any:
    """The SCRAM rounds: client-first -> server-first, client-final -> server-final."""
    conn = peer.conn
    auth = conn.server.auth
    user = peer.sasl.user if peer.sasl is not None else ""
    try:
        if auth is None or peer.sasl_mechanism is None or conn.authenticated:
            raise AuthenticationFailedError("SaslAuthenticate before SaslHandshake, on an "
                                            "authenticated connection, or with authentication "
                                            "off")
        if peer.sasl is None:
            user, nonce, bare = parse_client_first(req.auth_bytes)
            known = auth.store.get(user)
            mechanism = peer.sasl_mechanism
            credential = (None if known is None else known.scram_sha_512
                          if mechanism == SHA512_MECHANISM else known.credential)
            peer.sasl = KafkaScramServer(
                user, credential if credential is not None else auth.decoy(user, mechanism),
                credential is not None, nonce, bare, secrets.token_bytes(NONCE_BYTES))
            return _answer(cls, KafkaError.none, None, peer.sasl.server_first.encode())
        scram, peer.sasl = peer.sasl, None  # one attempt per connection
        final = scram.finish(req.auth_bytes)
        known = auth.store.get(scram.user)
        if known is None:
            raise AuthenticationFailedError("authentication failed: unknown user or wrong secret")
        conn.authenticated_as(known.name)
        auth.successes += 1
        log.info("Kafka connection %s authenticated as %r", conn.peer, known.name,
                 extra={"peer": conn.peer})
        return _answer(cls, KafkaError.none, None, final)
    except AuthenticationFailedError as exc:
        if auth is not None:
            auth.failed(conn, user, str(exc) + _why_not(peer, user))
        peer.close_after_answer()
        delay = auth.failure_delay_s if auth is not None else 0.0
        return _later(delay, _answer(cls, KafkaError.sasl_authentication_failed, str(exc), b""))


def _why_not(peer: SaslPeer, user: str) -> str:
    """What the log adds to a failure (never the client: it would tell which users exist)."""
    auth = peer.conn.server.auth
    known = auth.store.get(user) if auth is not None and user else None
    if (peer.sasl_mechanism == SHA512_MECHANISM and known is not None
            and known.scram_sha_512 is None):
        return (f" (the user has no {SHA512_MECHANISM} credential: `ferrymq user add "
                f"{user} --replace` derives one from its secret)")
    return ""


def _answer(cls: type[Any], error: KafkaError, message: str | None, data: bytes) -> Any:
    return apis.build(cls, {"error_code": error, "error_message": message, "auth_bytes": data,
                            "session_lifetime": _NO_TIME})


async def _later(delay_s: float, answer: Any) -> Any:
    await asyncio.sleep(delay_s)
    return answer
