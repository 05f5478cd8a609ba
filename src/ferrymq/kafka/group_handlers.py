"""The Kafka group APIs: OffsetCommit and OffsetFetch onto FerryMQ's committed offsets (a
Kafka group's offsets are the FerryMQ consumer group's of the same name), JoinGroup, SyncGroup,
Heartbeat and LeaveGroup onto the Kafka port's own membership (:mod:`ferrymq.kafka.groups`),
ListGroups and DescribeGroups over both. On a cluster each is refused away from the group's
coordinator (:func:`ferrymq.kafka.cluster.check_group`)."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Any

from kio.schema.errors import ErrorCode as KafkaError

from ferrymq.broker.acl import may
from ferrymq.broker.handlers import offsets
from ferrymq.errors import AccessDeniedError, BrokerError
from ferrymq.kafka import cluster as kafka_cluster
from ferrymq.kafka.answers import later
from ferrymq.kafka.rights import authorize, group_denied
from ferrymq.protocol import messages as m
from ferrymq.protocol.kafka import apis
from ferrymq.protocol.messages import ApiKey

if TYPE_CHECKING:
    from ferrymq.kafka.groups import JoinResult
    from ferrymq.kafka.handlers import KafkaPeer

_NO_TIME = datetime.timedelta(0)


def offset_commit(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """Store a group's offsets through FerryMQ's COMMIT_OFFSETS: the same committed offsets a
    FerryMQ consumer group of that name has. Without group membership on the Kafka port, only
    commits outside a generation (-1, what ``assign()`` consumers send) can succeed."""
    entries = [(t.name, p.partition_index, p.committed_offset)
               for t in req.topics for p in t.partitions]
    fenced = kafka_cluster.check_group(peer, req.group_id)
    if fenced == KafkaError.none:
        fenced = peer.groups.check_commit(req.group_id, req.member_id,
                                          req.generation_id_or_member_epoch,
                                          getattr(req, "group_instance_id", None))
    answer: Any = None
    if fenced == KafkaError.none:
        freq = m.CommitOffsetsRequest(req.group_id, "", -1, entries)
        try:  # the Kafka generation is checked above: stored outside FerryMQ's generations
            authorize(peer, ApiKey.COMMIT_OFFSETS, freq)
            answer = offsets.commit_offsets(peer.conn, freq)
        except AccessDeniedError:
            fenced = KafkaError.group_authorization_failed
        except BrokerError as exc:
            answer = m.CommitOffsetsResponse([(t, q, exc.code) for t, q, _o in entries])

    def respond(res: m.CommitOffsetsResponse | None) -> Any:
        rows: dict[str, list[dict[str, Any]]] = {}
        results = ([(t, q, apis.kafka_error(code)) for t, q, code in res.results]
                   if res is not None else [(t, q, fenced) for t, q, _o in entries])
        for topic, q, error in results:
            rows.setdefault(topic, []).append({"partition_index": q, "error_code": error})
        return apis.build(cls, {"throttle_time": _NO_TIME, "topics": [
            {"name": t, "partitions": p} for t, p in rows.items()]})

    if answer is None or isinstance(answer, m.CommitOffsetsResponse):
        return respond(answer)
    return later(answer, respond)


def offset_fetch(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """A group's committed offsets through FerryMQ's FETCH_OFFSETS (-1: none committed); with
    ``require_stable``, a partition whose offsets wait in an open transaction is
    UNSTABLE_OFFSET_COMMIT."""
    names = None if req.topics is None else [t.name for t in req.topics]
    freq = m.FetchOffsetsRequest(req.group_id, names)
    if group_denied(peer, req.group_id):
        return apis.build(cls, {"throttle_time": _NO_TIME,
                                "error_code": KafkaError.group_authorization_failed,
                                "topics": []})
    res = offsets.fetch_offsets(peer.conn, freq)
    committed = {(t, q): o for t, q, o in res.offsets}
    unstable = set(res.unstable) if getattr(req, "require_stable", False) else set()
    wanted: list[tuple[str, int]] = (
        sorted(committed) if req.topics is None
        else [(t.name, q) for t in req.topics for q in t.partition_indexes])
    rows: dict[str, list[dict[str, Any]]] = {}
    for topic, q in wanted:
        rows.setdefault(topic, []).append({
            "partition_index": q, "committed_offset": committed.get((topic, q), -1),
            "committed_leader_epoch": -1, "metadata": "",
            "error_code": (KafkaError.unstable_offset_commit if (topic, q) in unstable
                           else KafkaError.none)})
    return apis.build(cls, {"throttle_time": _NO_TIME, "error_code": KafkaError.none,
                            "topics": [{"name": t, "partitions": p} for t, p in rows.items()]})


def join_group(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """Join (or rejoin) a group; answered when the rebalance completes
    (:mod:`ferrymq.kafka.groups`)."""
    if group_denied(peer, req.group_id):
        return apis.build(cls, {"throttle_time": _NO_TIME,
                                "error_code": KafkaError.group_authorization_failed,
                                "protocol_name": "", "leader": "", "member_id": "",
                                "members": []})
    error = kafka_cluster.check_group(peer, req.group_id)
    if error != KafkaError.none:
        return apis.build(cls, {"throttle_time": _NO_TIME, "error_code": error,
                                "generation_id": -1, "protocol_type": req.protocol_type,
                                "protocol_name": "", "leader": "", "member_id": req.member_id,
                                "members": []})
    cfg = peer.conn.server.config
    session_ms = cfg.session_timeout_ms(int(req.session_timeout.total_seconds() * 1000))
    # v0 has no rebalance timeout: the session timeout bounds the rebalance, as in Kafka
    rebalance = getattr(req, "rebalance_timeout", None)
    rebalance_ms = int(rebalance.total_seconds() * 1000) if rebalance is not None else 0
    fut = peer.groups.join(req.group_id, req.member_id, peer.conn.client_id, req.protocol_type,
                           [(p.name, p.metadata) for p in req.protocols], session_ms / 1000,
                           (rebalance_ms if rebalance_ms > 0 else session_ms) / 1000,
                           peer.conn.peer.rsplit(":", 1)[0],
                           getattr(req, "group_instance_id", None))  # v5+: static membership

    def respond(res: JoinResult) -> Any:
        return apis.build(cls, {
            "throttle_time": _NO_TIME, "error_code": res.error,
            "generation_id": res.generation, "protocol_type": req.protocol_type,
            "protocol_name": res.protocol, "leader": res.leader, "member_id": res.member_id,
            "members": [{"member_id": mid, "group_instance_id": res.instance_ids.get(mid),
                         "metadata": meta} for mid, meta in res.members]})

    return later(fut, respond)


def sync_group(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """The member's assignment, once the group's leader has sent everyone's."""
    error = kafka_cluster.check_group(peer, req.group_id)
    if error != KafkaError.none:
        return apis.build(cls, {"throttle_time": _NO_TIME, "error_code": error,
                                "protocol_type": getattr(req, "protocol_type", None),
                                "protocol_name": getattr(req, "protocol_name", None),
                                "assignment": b""})
    fut = peer.groups.sync(req.group_id, req.member_id, req.generation_id,
                           {a.member_id: a.assignment for a in req.assignments},
                           getattr(req, "group_instance_id", None))

    def respond(res: tuple[KafkaError, bytes]) -> Any:
        return apis.build(cls, {
            "throttle_time": _NO_TIME, "error_code": res[0],
            "protocol_type": getattr(req, "protocol_type", None),
            "protocol_name": getattr(req, "protocol_name", None), "assignment": res[1]})

    return later(fut, respond)


def heartbeat(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """NONE, or REBALANCE_IN_PROGRESS (rejoin), UNKNOWN_MEMBER_ID, ILLEGAL_GENERATION;
    NOT_COORDINATOR (or the like) away from the group's coordinator."""
    error = kafka_cluster.check_group(peer, req.group_id)
    if error == KafkaError.none:
        error = peer.groups.heartbeat(req.group_id, req.member_id, req.generation_id,
                                      getattr(req, "group_instance_id", None))
    return apis.build(cls, {"throttle_time": _NO_TIME, "error_code": error})


def leave_group(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """Remove the member (v0-2) or members (v3+, by member id or instance id); the others
    rebalance."""
    who: list[tuple[str, str | None]] = (
        [(x.member_id, x.group_instance_id) for x in req.members] if hasattr(req, "members")
        else [(req.member_id, None)])
    error = kafka_cluster.check_group(peer, req.group_id)
    if error != KafkaError.none:
        return apis.build(cls, {"throttle_time": _NO_TIME, "error_code": error, "members": []})
    errors = peer.groups.leave(req.group_id, who)
    return apis.build(cls, {
        "throttle_time": _NO_TIME,
        "error_code": errors[0] if not hasattr(req, "members") else KafkaError.none,
        "members": [{"member_id": mid, "group_instance_id": iid, "error_code": e}
                    for (mid, iid), e in zip(who, errors, strict=True)]})


def list_groups(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """The Kafka port's groups (protocol type and state), and the FerryMQ consumer groups that
    have no Kafka members (protocol type "", as Kafka lists groups that only hold offsets)."""
    states = set(getattr(req, "states_filter", ()) or ())
    rows = [{"group_id": g.name, "protocol_type": g.protocol_type,
             "group_state": g.state.value} for g in peer.groups.groups.values()]
    rows += [{"group_id": name, "protocol_type": "", "group_state": "Empty"}
             for name in sorted(peer.conn.server.consumer_groups.groups)
             if name not in peer.groups.groups]
    return apis.build(cls, {"throttle_time": _NO_TIME, "error_code": KafkaError.none,
                            "groups": [r for r in rows
                                       if (not states or r["group_state"] in states)
                                       and may(peer.conn.server, peer.conn.principal,
                                               ("group", r["group_id"]))]})


def describe_groups(peer: KafkaPeer, cls: type[Any], req: Any) -> Any:
    """State, protocol and members of Kafka groups; a FerryMQ group without Kafka members is
    "Empty", a name neither knows is "Dead" (as Kafka answers)."""
    out: list[dict[str, Any]] = []
    for name in req.groups:
        if group_denied(peer, name):
            out.append({"error_code": KafkaError.group_authorization_failed, "group_id": name,
                        "group_state": "", "protocol_type": "", "protocol_data": "",
                        "members": []})
            continue
        error = kafka_cluster.check_group(peer, name)
        if error != KafkaError.none:
            out.append({"error_code": error, "group_id": name, "group_state": "",
                        "protocol_type": "", "protocol_data": "", "members": []})
            continue
        g = peer.groups.groups.get(name)
        row: dict[str, Any] = {"error_code": KafkaError.none, "group_id": name,
                               "protocol_type": "", "protocol_data": "", "members": []}
        if g is not None:
            row.update(group_state=g.state.value, protocol_type=g.protocol_type,
                       protocol_data=g.protocol, members=[{
                           "member_id": m.member_id, "group_instance_id": m.instance_id,
                           "client_id": m.client_id, "client_host": m.client_host,
                           "member_metadata": dict(m.protocols).get(g.protocol, b""),
                           "member_assignment": m.assignment} for m in g.members.values()])
        else:
            known = name in peer.conn.server.consumer_groups.groups
            row["group_state"] = "Empty" if known else "Dead"
        out.append(row)
    return apis.build(cls, {"throttle_time": _NO_TIME, "groups": out})
