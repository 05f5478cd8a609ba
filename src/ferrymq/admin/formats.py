"""How the ``ferrymq`` CLI shows values: times, durations, one-line text, and the JSON shape of
each result.

The ``*_to_dict`` functions are the CLI's ``--json`` contract (scripts parse it): one function
per result type, JSON-ready dicts with the names the docs use, unknown values as ``null``. They
take the admin client's typed results (:mod:`ferrymq.client.admin`) and the clients' messages
and send results; :class:`~ferrymq.admin.output.Printer` prints them.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from ferrymq.client.admin import (
    ClusterDescription,
    DeadLetter,
    DeliveryGroupDescription,
    DeliveryStatus,
    GroupDescription,
    KeySearch,
    MessageStatus,
    TopicDescription,
)
from ferrymq.client.message import ReceivedMessage, SendResult


def format_ms(ms: int) -> str:
    """A wall-clock time in ms since the epoch as ISO-8601 UTC (``-`` when unknown)."""
    if ms < 0:
        return "-"
    return _dt.datetime.fromtimestamp(ms / 1000, _dt.UTC).isoformat(timespec="milliseconds")


def format_duration_ms(ms: int) -> str:
    """A duration for people: ``250ms``, ``10s``, ``1.5s``, ``2m``, ``1h30m``, ``2d``."""
    if ms < 0:
        return "-"
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f}".rstrip("0").rstrip(".") + "s"
    units = (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000))
    parts: list[str] = []
    rest = ms
    for name, size in units:
        if rest >= size:
            parts.append(f"{rest // size}{name}")
            rest %= size
        if len(parts) == 2:
            break
    return "".join(parts)


def one_line(text: str) -> str:
    """``text`` on one line: backslashes, newlines and carriage returns escaped."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def format_properties(props: dict[str, str]) -> str:
    """``k=v`` pairs sorted by key (``-`` when none)."""
    return " ".join(f"{k}={v}" for k, v in sorted(props.items())) or "-"


def _opt(value: int) -> int | None:
    return value if value >= 0 else None


# -- data --------------------------------------------------------------------------------------


def message_to_dict(msg: ReceivedMessage) -> dict[str, Any]:
    """A consumed message as a JSON-ready dict (body decoded as UTF-8 with replacement)."""
    return {
        "topic": msg.topic,
        "queue": msg.queue,
        "offset": msg.offset,
        "msg_id": msg.msg_id,
        "tag": msg.tags,
        "keys": list(msg.keys),
        "sharding_key": msg.sharding_key,
        "properties": msg.properties,
        "born_ms": msg.born_ms,
        "stored_ms": msg.stored_ms,
        "body": msg.body.decode("utf-8", errors="replace"),
    }


def send_result_to_dict(res: SendResult) -> dict[str, Any]:
    """A send result as a JSON-ready dict."""
    return {
        "msg_id": res.msg_id,
        "topic": res.topic,
        "queue": res.queue,
        "offset": res.offset,
        "durability": res.durability.value if res.durability is not None else None,
        "duplicate": res.duplicate,
    }


# -- topics and groups ---------------------------------------------------------------------------


def topic_to_dict(topic: TopicDescription) -> dict[str, Any]:
    """A topic description as a JSON-ready dict; ``last_offset`` is null for an empty queue."""
    return {
        "name": topic.name,
        "topic_id": topic.topic_id,
        "config": topic.config,
        "queues": [
            {
                "queue": q.queue,
                "first_offset": q.first_offset,
                "last_offset": q.last_offset,
                "end_offset": q.end_offset,
                "bytes": q.size_bytes,
                "segments": q.segments,
                "last_append_ms": _opt(q.last_append_ms),
            }
            for q in topic.queues
        ],
        "scheduled_pending": topic.scheduled_pending,
        "next_due_ms": _opt(topic.next_due_ms),
        "dedup_window_ms": topic.dedup_window_ms,
        "dedup_keys": topic.dedup_keys,
    }


def cluster_to_dict(desc: ClusterDescription) -> dict[str, Any]:
    """A cluster description as a JSON-ready dict: ``leader`` is null for an offline queue,
    ``cluster`` "" for a single broker; queues in the description's order (offline first,
    then under-replicated)."""
    return {
        "cluster": desc.cluster,
        "controller": _opt(desc.controller),
        "brokers": [{"broker_id": b.broker_id, "address": b.address or None, "alive": b.alive}
                    for b in desc.brokers],
        "offline": len(desc.offline),
        "under_replicated": len(desc.under_replicated),
        "queues": [
            {
                "topic": q.topic,
                "queue": q.queue,
                "leader": None if q.offline else q.leader,
                "leader_epoch": q.leader_epoch,
                "replicas": q.replicas,
                "isr": q.isr,
                "min_insync": q.min_insync,
                "offline": q.offline,
                "under_replicated": q.under_replicated,
            }
            for q in desc.queues
        ],
    }


def group_to_dict(group: GroupDescription) -> dict[str, Any]:
    """A group description as a JSON-ready dict; ``committed`` is null when nothing is."""
    return {
        "group": group.group,
        "state": group.state,
        "generation": group.generation,
        "members": [
            {
                "member_id": x.member_id,
                "client_id": x.client_id,
                "host": x.host,
                "queues": [{"topic": t, "queue": q} for t, q in x.queues],
            }
            for x in group.members
        ],
        "offsets": [
            {
                "topic": o.topic,
                "queue": o.queue,
                "committed": _opt(o.committed),
                "end_offset": o.end_offset,
                "lag": o.lag,
            }
            for o in group.offsets
        ],
    }


def delivery_to_dict(group: DeliveryGroupDescription) -> dict[str, Any]:
    """A delivery group description as a JSON-ready dict. Per queue ``lag`` is the messages of
    the queue the group has not finished (see
    :meth:`~ferrymq.client.admin.DeliveryGroupDescription.queue_lags`); the group's ``lag``
    adds the retry queue's (pending and in flight). ``oldest_age_ms`` is the age of the oldest
    unfinished message (null when none)."""
    return {
        "group": group.group,
        "kind": "delivery",
        "lag": group.total_lag,
        "members": [
            {
                "member_id": x.member_id,
                "client_id": x.client_id,
                "host": x.host,
                "last_heartbeat_ms_ago": x.last_heartbeat_ms_ago,
                "in_flight": x.in_flight,
            }
            for x in group.members
        ],
        "queues": [
            {
                "topic": q.topic,
                "queue": q.queue,
                "acked_below": q.acked_below,
                "next": q.next_offset,
                "end_offset": q.end_offset,
                "in_flight": q.in_flight,
                "lag": lag,
                "oldest_age_ms": _opt(q.oldest_age_ms),
            }
            for q, lag in zip(group.queues, group.queue_lags(), strict=True)
        ],
        "retry_pending": group.retry_pending,
        "retry_in_flight": group.retry_in_flight,
        "dlq_size": group.dlq_size,
        "retry_policy": {"max_reconsume": group.max_reconsume,
                         "retry_delays_ms": list(group.retry_delays_ms)},
        "orderly": group.orderly,
        "blocked_keys": [
            {"topic": b.topic, "queue": b.queue, "key": b.key, "msg_id": b.msg_id,
             "attempts": b.attempts, "since_ms": b.since_ms,
             "next_attempt_ms": _opt(b.next_attempt_ms), "reason": b.reason or None}
            for b in group.blocked
        ],
    }


# -- messages ------------------------------------------------------------------------------------


def status_to_dict(msg_id: str, status: MessageStatus) -> dict[str, Any]:
    """A message status as a JSON-ready dict (unknown times are null; ``offset`` is null for a
    half message that is not committed: it is not in the queue)."""
    return {
        "msg_id": msg_id,
        "topic": status.topic,
        "queue": status.queue,
        "offset": _opt(status.offset),
        "groups": [
            {
                "group": s.group,
                "state": s.state,
                "member": s.member or None,
                "lease_until_ms": _opt(s.lease_until_ms),
                "reconsume_times": s.reconsume_times,
                "next_attempt_ms": _opt(s.next_attempt_ms),
                "reason": s.reason or None,
                "at_ms": _opt(s.at_ms),
            }
            for s in status.statuses
        ],
    }


def status_detail(s: DeliveryStatus) -> str:
    """The DETAIL column of ``message status``: what the state means for this group."""
    state, reason, reconsume = s.state, s.reason, s.reconsume_times
    failed = f"failed {reconsume} times" if reconsume != 1 else "failed once"
    if state == "DELIVERED":
        text = f"to {s.member} until {format_ms(s.lease_until_ms)}"
        return f"{text} ({failed} before)" if reconsume else text
    if state == "RETRYING":
        return (f"{failed}; next attempt at {format_ms(s.next_attempt_ms)}; last failure: "
                f"{reason or '-'}")
    when = f" at {format_ms(s.at_ms)}" if s.at_ms >= 0 else ""
    if state == "DEAD":
        return f"in %DLQ%{s.group}{when}: {reason or '-'}"
    if state == "WAITING":
        return "not delivered yet"
    if state == "PREPARED":  # a half message
        return f"{reason}; next check-back at {format_ms(s.next_attempt_ms)}"
    if state in ("COMMITTED", "ROLLED_BACK"):
        return f"{reason}{when}"
    if state == "CONSUMED":
        return reason or f"acknowledged{when or ' (time no longer kept)'}"
    if state == "FILTERED":
        return reason or "filtered out by the group's tag expression"
    return "-"


def key_search_to_dict(topic: str, key: str, found: KeySearch) -> dict[str, Any]:
    """The messages found by key as a JSON-ready dict (``unindexed``: offsets not searched)."""
    return {
        "topic": topic, "key": key, "unindexed": found.unindexed,
        "messages": [
            {"queue": x.queue, "offset": x.offset, "msg_id": x.msg_id,
             "stored_ms": x.stored_ms, "keys": list(x.keys)}
            for x in found.messages
        ],
    }


def dead_letter_to_dict(d: DeadLetter) -> dict[str, Any]:
    """A dead letter as a JSON-ready dict (body decoded as UTF-8 with replacement)."""
    return {
        "group": d.group,
        "dlq_offset": d.dlq_offset,
        "dlq_msg_id": d.dlq_msg_id,
        "topic": d.topic,
        "queue": d.queue,
        "offset": d.offset,
        "msg_id": d.msg_id,
        "attempts": d.attempts,
        "reason": d.reason,
        "dead_ms": _opt(d.dead_ms),
        "born_ms": d.born_ms,
        "tag": d.tag,
        "keys": list(d.keys),
        "sharding_key": d.sharding_key,
        "properties": d.properties,
        "body": d.body.decode("utf-8", errors="replace"),
    }
