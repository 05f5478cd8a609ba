"""What a connection says about itself: HELLO, PING, AUTH_START, AUTH_FINISH, WHOAMI.

HELLO is the first request of every connection; with authentication on, the SCRAM exchange
(:mod:`ferrymq.protocol.auth`, docs/security.md) follows; PING keeps an idle connection alive.
The client's side of this sequence is :class:`ferrymq.protocol.client.ClientHandshake`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferrymq.protocol.messages.schema import BOOL, BYTES, INT, STR, ApiKey, Body, Empty, Request, lst


@dataclass(frozen=True, slots=True)
class HelloResponse(Body):
    """What the broker tells a new connection about itself and its limits."""

    broker_version: str
    broker_id: int
    max_frame_bytes: int
    max_message_bytes: int
    max_batch_records: int
    flush_mode: str
    max_delay_ms: int = 0
    SCHEMA = (STR, INT, INT, INT, INT, STR, INT)


@dataclass(frozen=True, slots=True)
class HelloRequest(Request):
    """First request on a connection: who the client is."""

    client_id: str
    client_version: str
    API_KEY = ApiKey.HELLO
    RESPONSE = HelloResponse
    SCHEMA = (STR, STR)


@dataclass(frozen=True, slots=True)
class PingRequest(Request):
    """Keepalive; answered with an empty body."""

    API_KEY = ApiKey.PING
    RESPONSE = Empty


@dataclass(frozen=True, slots=True)
class AuthStartResponse(Body):
    """The broker's challenge: the user's salt and PBKDF2 rounds, and a fresh server nonce."""

    salt: bytes
    iterations: int
    server_nonce: bytes
    SCHEMA = (BYTES, INT, BYTES)


@dataclass(frozen=True, slots=True)
class AuthStartRequest(Request):
    """First step of authentication: mechanism (``SCRAM-SHA-256``), user name, client nonce."""

    mechanism: str
    user: str
    client_nonce: bytes
    API_KEY = ApiKey.AUTH_START
    RESPONSE = AuthStartResponse
    SCHEMA = (STR, STR, BYTES)


@dataclass(frozen=True, slots=True)
class AuthFinishResponse(Body):
    """Authenticated: the broker's signature (the client checks it) and who the client is now."""

    server_signature: bytes
    user: str
    admin: bool
    SCHEMA = (BYTES, STR, BOOL)


@dataclass(frozen=True, slots=True)
class AuthFinishRequest(Request):
    """Second step: the client proof (``ClientKey XOR HMAC(StoredKey, AuthMessage)``)."""

    client_proof: bytes
    API_KEY = ApiKey.AUTH_FINISH
    RESPONSE = AuthFinishResponse
    SCHEMA = (BYTES,)


@dataclass(frozen=True, slots=True)
class WhoAmIResponse(Body):
    """The connection's principal and rights ("" and admin when authentication is off)."""

    user: str
    admin: bool
    produce: list[str]
    consume: list[str]
    groups: list[str]
    SCHEMA = (STR, BOOL, lst(STR), lst(STR), lst(STR))


@dataclass(frozen=True, slots=True)
class WhoAmIRequest(Request):
    """Who this connection is authenticated as, with the user's ACL patterns."""

    API_KEY = ApiKey.WHOAMI
    RESPONSE = WhoAmIResponse
