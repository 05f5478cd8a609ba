"""Consumer groups (offset-based pull groups): JOIN_GROUP, HEARTBEAT, LEAVE_GROUP; and for both
kinds of group (consumer and delivery groups) LIST_GROUPS, DESCRIBE_GROUP, DELETE_GROUP.

In a cluster only a group's coordinator serves its requests (others answer NOT_COORDINATOR:
:func:`check_coordinator`), and LIST_GROUPS lists the groups this broker coordinates."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from ferrymq.broker.acl import may
from ferrymq.broker.topics import check_topic_name
from ferrymq.errors import InvalidRequestError, UnknownGroupError
from ferrymq.protocol import messages as m

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from ferrymq.broker.context import ClientConnection

_Body = TypeVar("_Body")


def check_coordinator(conn: ClientConnection, group: str) -> None:
    """In a cluster, raise NotCoordinatorError unless this broker coordinates ``group``
    (:mod:`ferrymq.broker.cluster_groups`); a single broker coordinates every group."""
    if conn.server.cluster is not None:
        conn.server.cluster.groups.check_coordinator(group)


def _queue_counts(conn: ClientConnection) -> dict[str, int]:
    return {name: len(t.queues) for name, t in conn.server.topics.topics.items()}


def join_group(conn: ClientConnection, req: m.JoinGroupRequest
               ) -> m.JoinGroupResponse | Awaitable[m.JoinGroupResponse]:
    """Join or rejoin; returns the member's queues for the current generation. A topic that
    does not exist yet may be subscribed to: its queues are assigned once it is created (the
    coordinator rebalances, see :meth:`ConsumerGroupCoordinator.sync_queue_counts`).

    Raises:
        InvalidTopicNameError: no topic can have one of the names.
        InvalidRequestError: more than ``max_member_topics`` topics.
    """
    srv = conn.server
    check_coordinator(conn, req.group)
    timeout = srv.config.session_timeout_ms(req.session_timeout_ms)
    limit = srv.config.max_member_topics
    if len(req.topics) > limit and len(set(req.topics)) > limit:
        raise InvalidRequestError(f"a member may subscribe to at most max_member_topics="
                                  f"{limit} topics, not {len(set(req.topics))}")
    for t in req.topics:
        if t not in srv.topics.topics:
            check_topic_name(t, internal_ok=True)
    g, member = srv.consumer_groups.join(req.group, req.member_id, req.client_id or conn.client_id,
                                         conn.peer, req.topics, timeout, srv.now_monotonic_ms(),
                                         _queue_counts(conn))
    resp = m.JoinGroupResponse(g.generation, member.member_id, list(member.assignment),
                               len(g.members))
    if srv.cluster is None:
        return resp
    return _after(srv.cluster.groups.persist(req.group), resp)


async def _after(persisting: Awaitable[None], resp: _Body) -> _Body:
    """``resp`` once the group's membership is replicated: a member never learns a
    generation a new coordinator would not know."""
    await persisting
    return resp


def heartbeat(conn: ClientConnection, req: m.HeartbeatRequest) -> m.Empty:
    """Keep the membership alive (REBALANCE_IN_PROGRESS: rejoin)."""
    check_coordinator(conn, req.group)
    conn.server.consumer_groups.heartbeat(req.group, req.member_id, req.generation,
                                          conn.server.now_monotonic_ms())
    return m.Empty()


def leave_group(conn: ClientConnection, req: m.LeaveGroupRequest
                ) -> m.Empty | Awaitable[m.Empty]:
    """Leave at once (in a cluster, answered once the membership without it is replicated:
    a new coordinator must not bring a member that left back until its session times out)."""
    srv = conn.server
    check_coordinator(conn, req.group)
    srv.consumer_groups.leave(req.group, req.member_id, _queue_counts(conn))
    if srv.cluster is None:
        return m.Empty()
    return _after(srv.cluster.groups.persist(req.group), m.Empty())


def list_groups(conn: ClientConnection, req: m.ListGroupsRequest) -> m.ListGroupsResponse:
    """Every known group the user has the ``group`` right on: consumer groups, delivery
    groups (state ``DELIVERY``) and the Kafka port's groups (``KAFKA_STABLE``, ...; they
    share a consumer group's offsets, so a consumer group without members of the same name is
    listed as the Kafka group); a name used by two kinds is listed twice."""
    srv = conn.server
    kafka = srv.kafka_groups.native_listing() if srv.kafka_groups is not None else []
    named = {row[0] for row in kafka}
    rows = [(g.name, g.state, len(g.members)) for g in srv.consumer_groups.groups.values()
            if g.members or g.name not in named]
    rows += kafka
    rows += [(g.name, m.DELIVERY_GROUP_STATE, len(g.members)) for g in srv.delivery.groups.values()]
    if conn.principal is not None:
        rows = [r for r in rows if may(srv, conn.principal, ("group", r[0]))]
    return m.ListGroupsResponse(sorted(rows))


def describe_group(conn: ClientConnection, req: m.DescribeGroupRequest) -> m.DescribeGroupResponse:
    """Members, assignment, committed offsets, end offsets and lag per queue. A Kafka group of
    the name (the Kafka port's) shows its members, their partitions, state and generation,
    unless the consumer group has members of its own (then both groups' members are listed)."""
    srv = conn.server
    check_coordinator(conn, req.group)
    kafka = srv.kafka_groups.native_view(req.group) if srv.kafka_groups is not None else None
    g = srv.consumer_groups.groups.get(req.group)
    if g is None and kafka is None:
        g = srv.consumer_groups.group(req.group)  # raises UnknownGroupError
    members: list[m.MemberInfo] = [] if g is None else [
        (mm.member_id, mm.client_id, mm.host, list(mm.assignment)) for mm in g.members.values()
    ]
    state, generation = (g.state, g.generation) if g is not None else ("", 0)
    if kafka is not None:
        if not members:
            state, generation = kafka[0], kafka[1]
        members += kafka[2]
    offsets_of = g.offsets if g is not None else {}
    topics = {t for t, _ in offsets_of} | {t for mm in members for t, _q in mm[3]}
    if g is not None:  # a member's subscribed topics may have no queue assigned to it yet
        topics |= {t for mm in g.members.values() for t in mm.topics}
    offsets: list[m.GroupOffset] = []
    for name in sorted(topics):
        t = srv.topics.topics.get(name)
        if t is None:
            continue
        for qs in t.queues:
            committed = offsets_of.get((name, qs.queue), -1)
            end = qs.visible_end
            lag = end - (committed if committed >= 0 else qs.log.start_offset)
            offsets.append((name, qs.queue, committed, end, max(lag, 0)))
    return m.DescribeGroupResponse(req.group, state, generation, members, offsets)


def delete_group(conn: ClientConnection, req: m.DeleteGroupRequest
                 ) -> m.DeleteGroupResponse | Awaitable[m.DeleteGroupResponse]:
    """Delete the consumer group and the delivery group of this name (whichever exist, of the
    ``kinds`` asked), only when neither has a live member; nothing is deleted when either
    refuses. In a cluster see :func:`_delete_in_cluster`."""
    srv = conn.server
    kinds = req.kinds & m.GroupKinds.BOTH
    if not kinds:
        raise InvalidRequestError(f"DELETE_GROUP kinds must name a kind of group (1 consumer, "
                                  f"2 delivery, 3 both), not {req.kinds}")
    if srv.cluster is not None:
        return _delete_in_cluster(conn, req, kinds)
    pull = bool(kinds & m.GroupKinds.CONSUMER) and req.group in srv.consumer_groups.groups
    delivery = bool(kinds & m.GroupKinds.DELIVERY) and req.group in srv.delivery.groups
    if not pull and not delivery:
        raise _unknown(req.group)
    if pull:
        srv.consumer_groups.check_deletable(req.group)
    dead = srv.delivery.check_deletable(req.group, req.delete_dlq) if delivery else 0
    if req.validate_only:
        return m.DeleteGroupResponse(pull, delivery, dead)
    if delivery:
        dead = srv.delivery.delete(req.group, req.delete_dlq) or 0
    if kinds & m.GroupKinds.CONSUMER:
        srv.consumer_groups.delete(req.group)
    return m.DeleteGroupResponse(pull, delivery, dead)


def _unknown(group: str) -> UnknownGroupError:
    return UnknownGroupError(f"unknown group {group[:249]!r}: no consumer group or delivery "
                             "group has this name")


async def _delete_in_cluster(conn: ClientConnection, req: m.DeleteGroupRequest,
                             kinds: int) -> m.DeleteGroupResponse:
    """A cluster: the consumer group is deleted by its coordinator (the leader of its queue of
    ``%GROUPS%offsets``: a tombstone in that replicated log first), the delivery group by its
    own (the leader of ``%RETRY%<group>``). A client's request goes to the consumer group's
    coordinator, which asks the delivery group's coordinator, when that is another broker, to
    check its part (``validate_only``), checks its own, then has it delete its part and deletes
    its own; a request for the delivery part alone (from another broker) is refused with
    NOT_COORDINATOR by any broker but the delivery group's coordinator."""
    srv = conn.server
    link = srv.cluster
    assert link is not None
    group = req.group
    if kinds & m.GroupKinds.CONSUMER:
        check_coordinator(conn, group)
    else:
        link.delivery.check_coordinator(group)
    pull = bool(kinds & m.GroupKinds.CONSUMER) and group in srv.consumer_groups.groups
    here = bool(kinds & m.GroupKinds.DELIVERY) and group in srv.delivery.groups
    away = None
    if kinds == m.GroupKinds.BOTH and not here:
        away = link.delivery.coordinator_elsewhere(group)
    if pull:
        srv.consumer_groups.check_deletable(group)
    dead = srv.delivery.check_deletable(group, req.delete_dlq) if here else 0
    delivery = here
    if away is not None:
        try:
            checked = await link.delivery.delete_at(away, group, req.delete_dlq,
                                                    validate_only=True)
        except UnknownGroupError:
            away = None
        else:
            delivery, dead = checked.delivery_group, checked.dead_letters
    if not pull and not delivery:
        raise _unknown(group)
    if req.validate_only:
        return m.DeleteGroupResponse(pull, delivery, dead)
    if away is not None:  # first: a refusal there leaves everything as it was
        dead = (await link.delivery.delete_at(away, group, req.delete_dlq,
                                              validate_only=False)).dead_letters
    if kinds & m.GroupKinds.CONSUMER:
        await link.groups.delete(group)
    if here:
        dead = srv.delivery.delete(group, req.delete_dlq) or 0
    return m.DeleteGroupResponse(pull, delivery, dead)
