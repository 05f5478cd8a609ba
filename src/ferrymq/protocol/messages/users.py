"""User administration (admin right; see broker/handlers/users.py and docs/security.md):
UPSERT_USER, DELETE_USER, LIST_USERS."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrymq.protocol.messages.schema import BOOL, BYTES, INT, STR, ApiKey, Body, Request, lst, tup


@dataclass(frozen=True, slots=True)
class UpsertUserResponse(Body):
    """Whether the user was created (False: an existing user was replaced)."""

    created: bool
    SCHEMA = (BOOL,)


@dataclass(frozen=True, slots=True)
class UpsertUserRequest(Request):
    """Create or replace a user: its SCRAM-SHA-256 stored credential (derived from the secret
    by the client: the secret never crosses the wire) and its rights. ``replace`` false refuses
    an existing name (USER_ALREADY_EXISTS). The ``sha512_*`` fields (added later: empty from an
    older client) carry the optional SCRAM-SHA-512 credential, for Kafka clients."""

    name: str
    salt: bytes
    iterations: int
    stored_key: bytes = field(repr=False)
    server_key: bytes = field(repr=False)
    admin: bool
    produce: list[str]
    consume: list[str]
    groups: list[str]
    produce_bytes_per_s: int
    replace: bool
    sha512_salt: bytes = b""
    sha512_iterations: int = 0
    sha512_stored_key: bytes = field(default=b"", repr=False)
    sha512_server_key: bytes = field(default=b"", repr=False)
    API_KEY = ApiKey.UPSERT_USER
    RESPONSE = UpsertUserResponse
    SCHEMA = (STR, BYTES, INT, BYTES, BYTES, BOOL, lst(STR), lst(STR), lst(STR), INT, BOOL,
              BYTES, INT, BYTES, BYTES)


@dataclass(frozen=True, slots=True)
class DeleteUserResponse(Body):
    """How many open connections of the deleted user the broker closed."""

    connections_closed: int
    SCHEMA = (INT,)


@dataclass(frozen=True, slots=True)
class DeleteUserRequest(Request):
    """Delete a user; its open connections are closed."""

    name: str
    API_KEY = ApiKey.DELETE_USER
    RESPONSE = DeleteUserResponse
    SCHEMA = (STR,)


UserInfo = tuple[str, bool, list[str], list[str], list[str], int]
"""(name, admin, produce patterns, consume patterns, group patterns, produce_bytes_per_s):
a user's rights, never its credential."""


@dataclass(frozen=True, slots=True)
class ListUsersResponse(Body):
    """Every user with its rights, sorted by name (no credential material)."""

    users: list[UserInfo]
    SCHEMA = (lst(tup(STR, BOOL, lst(STR), lst(STR), lst(STR), INT)),)


@dataclass(frozen=True, slots=True)
class ListUsersRequest(Request):
    """The broker's users and their rights."""

    API_KEY = ApiKey.LIST_USERS
    RESPONSE = ListUsersResponse
