"""The admin client's user calls: add, replace, remove and list the users of the broker (or of
the cluster), with the admin right (part of :class:`~ferrymq.client.admin.AsyncAdminClient`)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ferrymq.client._admin_results import UserInfo
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import DEFAULT_ITERATIONS, SALT_BYTES, SHA512_MECHANISM, ScramCredential

if TYPE_CHECKING:
    from ferrymq.client._session import Session


class UserAdminCalls:
    """User calls of the admin client (mixed into ``AsyncAdminClient``, whose session they
    use; the broker must have authentication on)."""

    _session: Session

    async def upsert_user(
        self, name: str, credential: ScramCredential, *, admin: bool = False,
        produce: Sequence[str] = (), consume: Sequence[str] = (), groups: Sequence[str] = (),
        produce_bytes_per_s: int = 0, replace: bool = True,
        scram_sha_512: ScramCredential | None = None,
    ) -> bool:
        """Create or replace a user of the broker's users file, from an already derived SCRAM
        credential (:meth:`add_user` derives one from a secret). The change applies to the next
        handshake at once; a replaced user's open connections keep their session and get the
        new rights with their next request.

        Args:
            name: 1..128 characters of ``A-Z a-z 0-9 . _ @ -``.
            credential: salt, iterations and the two keys (never the secret).
            admin: may do everything, including managing users.
            produce, consume: topic name patterns (``*`` and ``?``).
            groups: consumer, delivery and producer group / transactional id patterns.
            produce_bytes_per_s: produce quota (0: none).
            replace: replace an existing user (False: refuse with UserAlreadyExistsError).
            scram_sha_512: the optional SCRAM-SHA-512 credential of the same secret, for
                Kafka clients that log in with that mechanism.

        Returns:
            True when the user was created, False when an existing one was replaced.

        Raises:
            AccessDeniedError: this client's user is not an admin.
            AuthenticationDisabledError: the broker has authentication off.
            UserAlreadyExistsError: the user exists and ``replace`` is false.
            InvalidRequestError: an invalid name, credential or pattern, or the change would
                take the admin right from the last admin.
        """
        req = m.UpsertUserRequest(
            name, credential.salt, credential.iterations, credential.stored_key,
            credential.server_key, admin, list(produce), list(consume), list(groups),
            produce_bytes_per_s, replace,
            *((scram_sha_512.salt, scram_sha_512.iterations, scram_sha_512.stored_key,
               scram_sha_512.server_key) if scram_sha_512 is not None else ()))
        # a replace is idempotent (safe to retry); a create is not (a retry would see "exists")
        resp = await self._session.request(req, m.UpsertUserResponse, retry=replace)
        return resp.created

    async def add_user(
        self, name: str, secret: str, *, admin: bool = False, produce: Sequence[str] = (),
        consume: Sequence[str] = (), groups: Sequence[str] = (), produce_bytes_per_s: int = 0,
        replace: bool = False, iterations: int = DEFAULT_ITERATIONS,
    ) -> bool:
        """Add a user with a secret (``ferrymq user add``): its SCRAM-SHA-256 credential, and the
        SCRAM-SHA-512 one Kafka clients may ask for, are derived here with fresh random salts,
        so the secret never leaves this process.

        Args:
            name, admin, produce, consume, groups, produce_bytes_per_s: as in
                :meth:`upsert_user`.
            secret: the user's secret (app secret).
            replace: replace the user if it exists (default: refuse).
            iterations: PBKDF2 rounds of the credential.

        Returns:
            True when the user was created, False when it was replaced.

        Raises:
            ValueError: an empty secret or iterations out of range (nothing was sent).
            AccessDeniedError, AuthenticationDisabledError, UserAlreadyExistsError,
            InvalidRequestError: as in :meth:`upsert_user`.
        """
        cred = ScramCredential.derive(secret, secrets.token_bytes(SALT_BYTES), iterations)
        sha512 = ScramCredential.derive(secret, secrets.token_bytes(SALT_BYTES), iterations,
                                        SHA512_MECHANISM)
        return await self.upsert_user(name, cred, admin=admin, produce=produce,
                                      consume=consume, groups=groups,
                                      produce_bytes_per_s=produce_bytes_per_s, replace=replace,
                                      scram_sha_512=sha512)

    async def remove_user(self, name: str) -> int:
        """Delete a user. Its handshakes fail from now on, and the broker closes its open
        connections (with AUTHENTICATION_FAILED naming the reason; this one too, after the
        answer, if it is the user removed).

        Returns:
            How many open connections of the user the broker closed.

        Raises:
            UnknownUserError: no such user.
            InvalidRequestError: it is the last admin user (the broker would be unmanageable).
            AccessDeniedError, AuthenticationDisabledError: as in :meth:`upsert_user`.
        """
        resp = await self._session.request(m.DeleteUserRequest(name), m.DeleteUserResponse,
                                           retry=False)
        return resp.connections_closed

    async def list_users(self) -> list[UserInfo]:
        """Every user with its rights, sorted by name: ``(name, admin, produce, consume,
        groups, produce_bytes_per_s)``. Credentials are never sent.

        Raises:
            AccessDeniedError, AuthenticationDisabledError: as in :meth:`upsert_user`.
        """
        resp = await self._session.request(m.ListUsersRequest(), m.ListUsersResponse)
        return [UserInfo._make(u) for u in resp.users]
