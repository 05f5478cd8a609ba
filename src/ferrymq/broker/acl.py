"""Authorisation: what each request needs, and whether a user has it (default deny).

Theory of operation
-------------------
Every request type maps to a list of *needs* in :data:`NEEDS`: ``(right, name)`` pairs where
the right is one of

* ``produce`` / ``consume`` on a topic name,
* ``describe`` on a topic (produce or consume on it is enough),
* ``group`` on a group name (consumer groups, delivery groups, producer groups, transactional
  ids and sinks all share this namespace),
* ``admin`` (no name): topic create/delete, group deletion, offset resets, dead-letter
  redrive/purge, skips, user changes and listing users (UPSERT_USER, DELETE_USER,
  LIST_USERS).

Listing every topic (METADATA and CLUSTER_METADATA without names) or every group (LIST_GROUPS)
needs no right: the answer holds only the topics the user may ``describe`` and the groups it
has the ``group`` right on (:func:`may`, applied by those handlers), as Kafka's Metadata and
ListGroups leave unauthorised names out. An admin sees everything. A dry run of DLQ_ADMIN
changes nothing and needs only the ``group`` right (browsing a group's dead letters reads the
DLQ's floor with it, then its ``%DLQ%`` topic).

:func:`authorize` is called by :mod:`ferrymq.broker.connection` for every request after it is
decoded and before its handler runs: one place, so a handler cannot forget it. A request type
missing from the table needs ``admin`` (default deny), and a unit test checks the table covers
every API. A user with ``admin = true`` may do everything. Internal topics (``%``-prefixed)
need admin, except a group's own retry and dead-letter topics (``%RETRY%g``, ``%DLQ%g``),
which need the ``group`` right on ``g``. Patterns are shell-style (``*``, ``?``) and matched
case-sensitively against the exact name.

When authentication is off there is no principal and nothing is checked.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ferrymq.errors import AccessDeniedError
from ferrymq.protocol import messages as m
from ferrymq.protocol.records import decode_msg_id

if TYPE_CHECKING:
    from ferrymq.broker.auth import User
    from ferrymq.broker.context import BrokerContext

log = logging.getLogger("ferrymq.broker.acl")

Need = tuple[str, str]
"""(right, resource name): right is produce, consume, describe, group or admin ("" name)."""
ADMIN: Need = ("admin", "")
RIGHTS = ("produce", "consume", "describe", "group", "admin")

_INTERNAL_GROUP_TOPICS = ("%RETRY%", "%DLQ%")


def _topics(right: str, names: Any) -> list[Need]:
    return [(right, n) for n in names]


def _topic_of_msg_id(srv: BrokerContext, msg_id: str) -> str | None:
    try:
        topic_id, _, _ = decode_msg_id(msg_id)
    except ValueError:
        return None
    topic = srv.topics.by_id.get(topic_id)
    return None if topic is None else str(topic.name)


def _metadata(req: m.MetadataRequest, srv: BrokerContext) -> list[Need]:
    if req.topics is None:
        return []  # every topic the user may describe (the handler leaves the others out)
    needs: list[Need] = []
    for name in req.topics:
        exists = name in srv.topics.topics
        needs.append(("describe", name) if exists or not req.auto_create else ("produce", name))
    return needs


def _by_msg_id(right: str) -> Callable[[Any, BrokerContext], list[Need]]:
    def needs(req: Any, srv: BrokerContext) -> list[Need]:
        topic = _topic_of_msg_id(srv, req.msg_id)
        return [ADMIN] if topic is None or topic.startswith("%") else [(right, topic)]
    return needs


def _staged(req: Any, srv: BrokerContext) -> list[Need]:
    return [("group", req.sink_id), *(("group", str(mem[0])) for mem in req.members)]


def _describe_txns(req: Any, srv: BrokerContext) -> list[Need]:
    if not req.transactional_id and not req.sink_id:
        return [ADMIN]
    return [("group", n) for n in (req.transactional_id, req.sink_id) if n]


_Rule = Callable[[Any, "BrokerContext"], list[Need]]

NEEDS: dict[int, _Rule] = {
    m.ApiKey.HELLO: lambda r, s: [],
    m.ApiKey.PING: lambda r, s: [],
    m.ApiKey.AUTH_START: lambda r, s: [],
    m.ApiKey.AUTH_FINISH: lambda r, s: [],
    m.ApiKey.WHOAMI: lambda r, s: [],
    m.ApiKey.UPSERT_USER: lambda r, s: [ADMIN],
    m.ApiKey.DELETE_USER: lambda r, s: [ADMIN],
    m.ApiKey.LIST_USERS: lambda r, s: [ADMIN],
    m.ApiKey.METADATA: _metadata,
    m.ApiKey.CLUSTER_METADATA: lambda r, s: [] if r.topics is None  # filtered, as METADATA
    else _topics("describe", set(r.topics)),
    m.ApiKey.REPLICA_FETCH: lambda r, s: [ADMIN],  # brokers of the cluster
    m.ApiKey.OFFSET_FOR_EPOCH: lambda r, s: [ADMIN],
    m.ApiKey.TXN_ADD_QUEUE: lambda r, s: [ADMIN],  # brokers of the cluster
    m.ApiKey.TXN_MARKERS: lambda r, s: [ADMIN],
    m.ApiKey.ELECT_PREFERRED_LEADERS: lambda r, s: [ADMIN],
    m.ApiKey.DRAIN_BROKER: lambda r, s: [ADMIN],
    m.ApiKey.REASSIGN_QUEUE: lambda r, s: [ADMIN],
    m.ApiKey.CREATE_TOPIC: lambda r, s: [ADMIN],
    m.ApiKey.DELETE_TOPIC: lambda r, s: [ADMIN],
    m.ApiKey.DESCRIBE_TOPIC: lambda r, s: [("describe", r.name)],
    m.ApiKey.INIT_PRODUCER: lambda r, s: [("group", r.transactional_id)] if r.transactional_id
    else [],
    m.ApiKey.PRODUCE: lambda r, s: _topics("produce", {e[0] for e in r.entries}),
    m.ApiKey.FETCH: lambda r, s: _topics("consume", {e[0] for e in r.entries}),
    m.ApiKey.LIST_OFFSETS: lambda r, s: _topics("describe", {e[0] for e in r.entries}),
    m.ApiKey.COMMIT_OFFSETS: lambda r, s: [("group", r.group),
                                           *_topics("consume", {e[0] for e in r.entries})],
    m.ApiKey.FETCH_OFFSETS: lambda r, s: [("group", r.group)],
    m.ApiKey.JOIN_GROUP: lambda r, s: [("group", r.group), *_topics("consume", set(r.topics))],
    m.ApiKey.HEARTBEAT: lambda r, s: [("group", r.group)],
    m.ApiKey.LEAVE_GROUP: lambda r, s: [("group", r.group)],
    m.ApiKey.LIST_GROUPS: lambda r, s: [],  # the groups the user has the group right on
    m.ApiKey.DESCRIBE_GROUP: lambda r, s: [("group", r.group)],
    m.ApiKey.RESET_OFFSETS: lambda r, s: [ADMIN],
    m.ApiKey.DELETE_GROUP: lambda r, s: [ADMIN],
    m.ApiKey.DELIVERY_HEARTBEAT: lambda r, s: [
        ("group", r.group), *_topics("consume", {t for t, _ in r.subscriptions})],
    m.ApiKey.RECEIVE: lambda r, s: [
        ("group", r.group), *_topics("consume", {t for t, _ in r.subscriptions})],
    m.ApiKey.ACK: lambda r, s: [("group", r.group),
                                *_topics("consume", {e[0] for e in r.entries})],
    m.ApiKey.NACK: lambda r, s: [("group", r.group),
                                 *_topics("consume", {e[0] for e in r.entries})],
    m.ApiKey.CHANGE_INVISIBLE: lambda r, s: [("group", r.group),
                                             *_topics("consume", {e[0] for e in r.entries})],
    m.ApiKey.DELIVERY_LEAVE: lambda r, s: [("group", r.group)],
    m.ApiKey.DESCRIBE_DELIVERY: lambda r, s: [("group", r.group)],
    m.ApiKey.MESSAGE_STATUS: _by_msg_id("consume"),
    m.ApiKey.DLQ_ADMIN: lambda r, s: [("group", r.group)] if r.dry_run else [ADMIN],
    m.ApiKey.FIND_BY_KEY: lambda r, s: [("consume", r.topic)],
    m.ApiKey.CANCEL_SCHEDULED: _by_msg_id("produce"),
    m.ApiKey.SKIP_MESSAGE: lambda r, s: [ADMIN],
    m.ApiKey.PREPARE_HALF: lambda r, s: [("group", r.group), ("produce", r.topic)],
    m.ApiKey.END_HALF: lambda r, s: [("group", r.group)],
    m.ApiKey.HALF_CHECK_POLL: lambda r, s: [("group", r.group)],
}

# Kafka-style transactions (their ApiKeys may not exist yet in every tree: look them up by name)
for _name, _rule in (
    ("INIT_TXN", lambda r, s: [("group", r.transactional_id)]),
    ("END_TXN", lambda r, s: [("group", r.transactional_id)]),
    ("TXN_OFFSET_COMMIT", lambda r, s: [
        ("group", r.transactional_id), ("group", r.group),
        *_topics("consume", {e[0] for e in r.entries})]),
    ("COMMIT_STAGED", _staged),
    ("ABORT_STAGED", _staged),
    ("DESCRIBE_TXNS", _describe_txns),
):
    if _name in m.ApiKey.__members__:
        NEEDS[m.ApiKey[_name]] = _rule


def _match(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def allows(user: User, need: Need) -> bool:
    """Whether ``user`` has ``need`` (admins have everything)."""
    if user.admin:
        return True
    right, name = need
    if right == "admin":
        return False
    if right != "group" and name.startswith("%"):
        for prefix in _INTERNAL_GROUP_TOPICS:
            if name.startswith(prefix) and len(name) > len(prefix):
                return _match(name[len(prefix):], user.groups)
        return False
    if right == "produce":
        return _match(name, user.produce)
    if right == "consume":
        return _match(name, user.consume)
    if right == "describe":
        return _match(name, user.produce) or _match(name, user.consume)
    if right == "group":
        return _match(name, user.groups)
    return False


def may(srv: BrokerContext, principal: str | None, need: Need) -> bool:
    """Whether ``principal`` has ``need`` now (None: authentication is off, so yes): what the
    listings (every topic, every group) keep of their answer."""
    if principal is None:
        return True
    auth = srv.auth
    user = auth.store.get(principal) if auth is not None else None
    return user is not None and allows(user, need)


def needs_of(api_key: int, req: Any, srv: BrokerContext) -> list[Need]:
    """What a request needs; admin for request types not in the table (default deny)."""
    rule = NEEDS.get(api_key)
    return [ADMIN] if rule is None else rule(req, srv)


def authorize(srv: BrokerContext, principal: str, peer: str, api_key: int, req: Any) -> None:
    """Check a request of ``principal`` against its current rights.

    Raises:
        AccessDeniedError: a need is not met (the first one is named; an audit line is logged).
    """
    auth = srv.auth
    user = auth.store.get(principal) if auth is not None else None
    for need in needs_of(api_key, req, srv):
        if user is None or not allows(user, need):
            right, name = need
            what = f"{right} on {name!r}" if name else right
            key = m.ApiKey(api_key).name if api_key in m.ApiKey._value2member_map_ else api_key
            log.warning("access denied: user %r from %s: %s needs %s", principal, peer, key, what)
            raise AccessDeniedError(f"user {principal!r} may not {key}: needs {what}")
