"""UPSERT_USER, DELETE_USER, LIST_USERS: managing the users file over the wire.

Theory of operation
-------------------
The three requests need the ``admin`` right, checked by :func:`ferrymq.broker.acl.authorize`
before a handler runs (like CREATE_TOPIC). With authentication off there is no users file and
nobody to manage: every request is answered AUTHENTICATION_DISABLED.

A change is written with :func:`~ferrymq.broker.auth.update_users_file` (file lock, tmp, fsync,
rename, fsync dir) on a worker thread, so neither the fsyncs nor a lock held by an offline
``ferrymq user add --users-file`` stall the event loop. Checks that depend on the file's
content (the name exists, the change leaves no admin) run inside that lock, so two admins
deleting each other at once cannot both succeed. The broker's :class:`~ferrymq.broker.auth.
UserStore` is reloaded right after the write, so the next handshake and the next request of
every connection see the change; nothing waits for the housekeeping reload. Once started, a
change runs to the end (reload, closing connections) even if the requester disconnects.

Effect on open connections: rights are looked up by name on every request, so changed rights
apply to each connection's next request. A changed secret applies to the next handshake; open
connections stay authenticated. A deleted user's open connections are closed (RabbitMQ does
the same) with a connection-level AUTHENTICATION_FAILED frame naming the reason; the
requesting connection, if it is one of them, gets its answer first.

On a cluster the users live in the metadata store and every broker's file mirrors them: a
change is written there by compare-and-swap, with the same checks, and reaches the other
brokers through their watch (:mod:`ferrymq.broker.cluster_users`).

The request carries the SCRAM stored credential (salt, iterations, stored key, server key),
which the client derived from the secret: the secret never reaches the broker, and neither the
keys nor the salt are logged or listed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from ferrymq.broker.auth import MAX_USERS, Authenticator, User, check_user, update_users_file
from ferrymq.errors import (
    AuthenticationDisabledError,
    ConfigError,
    InternalBrokerError,
    InvalidRequestError,
    UnknownUserError,
    UserAlreadyExistsError,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import SHA512_MECHANISM, ScramCredential
from ferrymq.protocol.codes import ErrorCode

if TYPE_CHECKING:
    from ferrymq.broker.context import ClientConnection

log = logging.getLogger("ferrymq.broker.users")

T = TypeVar("T")


def _auth(conn: ClientConnection) -> Authenticator:
    auth = conn.server.auth
    if auth is None:
        raise AuthenticationDisabledError(
            "authentication is off on this broker (no users_file): there are no users to "
            "manage; start it with --users-file FILE to turn authentication on")
    return auth


def _by(conn: ClientConnection) -> str:
    return f"{conn.principal!r} from {conn.peer}"


def _no_admin_left(users: dict[str, User], name: str, what: str) -> None:
    if not any(u.admin for u in users.values()):
        raise InvalidRequestError(
            f"cannot {what} {name!r}: it is the last admin user and the broker would have no one "
            "left to manage it; make another user admin first")


def _run_to_the_end(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """A future of ``coro``'s result; ``coro`` itself runs to the end even when the requesting
    connection goes away and cancels the future (its answer is dropped): a written change must
    still be reloaded, and a deleted user's connections still closed."""
    inner = asyncio.ensure_future(coro)
    inner.add_done_callback(_retrieve)
    return asyncio.shield(inner)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # nobody may be left to read a refusal: not "never retrieved"


async def _write(conn: ClientConnection, auth: Authenticator, change: dict[str, User | None],
                 check: Callable[[dict[str, User]], None]) -> None:
    """Change the users file off the event loop, then reload the store at once; on a cluster,
    the cluster's users (:mod:`ferrymq.broker.cluster_users`), which this broker's file
    mirrors."""
    cluster = conn.server.cluster
    if cluster is not None:
        await cluster.users.write(change, check)
        return
    try:
        await asyncio.to_thread(update_users_file, auth.store.path, change, check)
    except (ConfigError, OSError) as exc:
        log.error("users file %s not changed: %s", auth.store.path, exc)
        raise InternalBrokerError(f"the users file was not changed: {exc}") from None
    auth.store.reload_if_changed()


def upsert_user(conn: ClientConnection, req: m.UpsertUserRequest
                ) -> asyncio.Future[m.UpsertUserResponse]:
    """UPSERT_USER: create or replace a user (credential and rights)."""
    auth = _auth(conn)
    try:
        sha512 = (ScramCredential(req.sha512_salt, req.sha512_iterations, req.sha512_stored_key,
                                  req.sha512_server_key, SHA512_MECHANISM)
                  if req.sha512_stored_key else None)
        user = check_user(User(
            req.name, ScramCredential(req.salt, req.iterations, req.stored_key, req.server_key),
            req.admin, tuple(req.produce), tuple(req.consume), tuple(req.groups),
            req.produce_bytes_per_s, sha512))
    except ValueError as exc:
        raise InvalidRequestError(f"user {req.name[:128]!r}: {exc}") from None
    existed = False

    def check(users: dict[str, User]) -> None:
        nonlocal existed
        existed = user.name in users
        if existed and not req.replace:
            raise UserAlreadyExistsError(f"user {user.name!r} exists (replace it explicitly)")
        if not existed and len(users) >= MAX_USERS:
            raise InvalidRequestError(f"the users file holds {MAX_USERS} users already "
                                      "(MAX_USERS)")
        if existed and users[user.name].admin and not user.admin:
            _no_admin_left({**users, user.name: user}, user.name, "take the admin right from")

    async def run() -> m.UpsertUserResponse:
        await _write(conn, auth, {user.name: user}, check)
        log.info("user %r %s by %s: admin=%s produce=%s consume=%s groups=%s "
                 "produce_bytes_per_s=%d", user.name, "replaced" if existed else "created",
                 _by(conn), user.admin, list(user.produce), list(user.consume),
                 list(user.groups), user.produce_bytes_per_s)
        return m.UpsertUserResponse(not existed)

    return _run_to_the_end(run())


def delete_user(conn: ClientConnection, req: m.DeleteUserRequest
                ) -> asyncio.Future[m.DeleteUserResponse]:
    """DELETE_USER: remove a user and close its open connections (never the last admin)."""
    auth = _auth(conn)
    name = req.name

    def check(users: dict[str, User]) -> None:
        if name not in users:
            raise UnknownUserError(f"no user {name[:128]!r}")
        if users[name].admin:
            _no_admin_left({n: u for n, u in users.items() if n != name}, name, "delete")

    async def run() -> m.DeleteUserResponse:
        await _write(conn, auth, {name: None}, check)
        victims = [c for c in conn.server.connections if c.principal == name and not c.closed]
        reason = f"user {name!r} was deleted by {conn.principal!r}: connection closed"
        for c in victims:
            if c is not conn:
                c.fail(ErrorCode.AUTHENTICATION_FAILED, reason)
        log.info("user %r deleted by %s; %d open connections of it closed", name, _by(conn),
                 len(victims))
        return m.DeleteUserResponse(len(victims))

    fut = _run_to_the_end(run())
    if conn.principal == name:  # deleting oneself: the answer goes out, then the close
        loop = asyncio.get_running_loop()

        def close_own(f: asyncio.Future[m.DeleteUserResponse]) -> None:
            if not f.cancelled() and f.exception() is None:
                # call_soon: after the connection's own done-callback has written the answer
                loop.call_soon(conn.fail, ErrorCode.AUTHENTICATION_FAILED,
                               f"user {name!r} was deleted by itself: connection closed")

        fut.add_done_callback(close_own)
    return fut


def list_users(conn: ClientConnection, req: m.ListUsersRequest) -> m.ListUsersResponse:
    """LIST_USERS: names and rights, sorted by name; never credentials."""
    auth = _auth(conn)
    return m.ListUsersResponse([
        (u.name, u.admin, list(u.produce), list(u.consume), list(u.groups),
         u.produce_bytes_per_s)
        for u in sorted(auth.store.users.values(), key=lambda u: u.name)
    ])
