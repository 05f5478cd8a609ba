"""The admin client's typed results (made from wire answers, no broker needed) and the CLI's
renderers of them: named fields, the wire's attribute names and tuple rows kept for callers
that index or unpack them, and the same output as before."""

from __future__ import annotations

import io
import json

from ferrymq.admin.output import Printer
from ferrymq.client._admin_results import merge_message_statuses
from ferrymq.client.admin import (
    DeliveryGroupDescription,
    GroupDescription,
    MessageStatus,
    TopicDescription,
    TxnsDescription,
)
from ferrymq.protocol import messages as m

WIRE_TOPIC = m.DescribeTopicResponse(
    "orders", 7, [(0, 0, 10, 1234, 1, 1_700_000_000_123), (1, 5, 5, 0, 1, -1)],
    {"retention_ms": "1000"}, 2, 1_700_000_005_000, 60_000, 17)


def test_a_topic_keeps_the_wire_attributes_and_rows() -> None:
    topic = TopicDescription.from_wire(WIRE_TOPIC)
    for name in ("name", "topic_id", "config", "scheduled_pending", "next_due_ms",
                 "dedup_window_ms", "dedup_keys"):
        assert getattr(topic, name) == getattr(WIRE_TOPIC, name)
    assert topic.queues == WIRE_TOPIC.queues  # rows equal the wire's tuples
    full, empty = topic.queues
    assert (full.queue, full.first_offset, full.end_offset, full.size_bytes) == (0, 0, 10, 1234)
    assert full.last_offset == 9 and empty.last_offset is None
    q, first, end, *_ = empty  # unpacking, as callers of the wire type did
    assert (q, first, end) == (1, 5, 5) and empty[2] == 5


def test_a_group_has_named_members_and_offsets() -> None:
    group = GroupDescription.from_wire(m.DescribeGroupResponse(
        "g", "STABLE", 3, [("m-1", "cid", "/h", [("orders", 0)])],
        [("orders", 0, 5, 10, 5), ("orders", 1, -1, 3, 3)]))
    assert group.members[0].member_id == "m-1" and group.members[0].queues == [("orders", 0)]
    assert [(o.queue, o.committed, o.lag) for o in group.offsets] == [(0, 5, 5), (1, -1, 3)]


def test_delivery_lag_comes_from_the_broker_or_is_estimated() -> None:
    queues = [("o", 0, 3, 7, 10, 2, 4500), ("o", 1, 9, 5, 4, 1, -1)]
    new = DeliveryGroupDescription.from_wire(m.DescribeDeliveryResponse(
        "g", [], queues, 4, 1, 0, [1000], 2, lag=[6, 1]))
    assert new.queue_lags() == [6, 1] and new.total_lag == 6 + 1 + 4 + 1
    # a broker that predates per-queue lag: end - next (never below 0) + in flight
    old = DeliveryGroupDescription.from_wire(m.DescribeDeliveryResponse(
        "g", [], queues, 4, 1, 0, [1000], 2))
    assert old.lag == [] and old.queue_lags() == [3 + 2, 0 + 1]
    assert old.queues[0].next_offset == 7 and old.queues[1].oldest_age_ms == -1


def test_statuses_and_transactions_have_named_rows() -> None:
    status = MessageStatus.from_wire(m.MessageStatusResponse(
        "orders", 1, 42, [("g", "RETRYING", "", -1, 3, 1_700_000_001_000, "boom", -1)]))
    (s,) = status.statuses
    assert (s.group, s.state, s.reconsume_times, s.reason) == ("g", "RETRYING", 3, "boom")
    assert status.statuses[0][1] == "RETRYING"
    txns = TxnsDescription.from_wire(m.DescribeTxnsResponse(
        [("tx", 5, 1, 2, 0, 60_000, [("o", 0)], ["g"], "", -1)], [("sink-1", 7, 1_700)]))
    assert txns.txns[0].producer_epoch == 1 and txns.txns[0].queues == [("o", 0)]
    assert txns.sinks[0][:2] == ("sink-1", 7) and txns.sinks[0].batch_id == 7


def _render(json_mode: bool, call: str, *args: object) -> str:
    out = io.StringIO()
    getattr(Printer(json_mode, file=out), call)(*args)
    return out.getvalue()


def test_topic_rendering() -> None:
    topic = TopicDescription.from_wire(WIRE_TOPIC)
    d = json.loads(_render(True, "topic", topic))
    assert d["queues"][1] == {"queue": 1, "first_offset": 5, "last_offset": None,
                              "end_offset": 5, "bytes": 0, "segments": 1,
                              "last_append_ms": None}
    lines = _render(False, "topic", topic).splitlines()
    assert lines[:3] == [
        "topic orders (id 7, 2 queues, config: retention_ms=1000)",
        "scheduled: 2 pending, next due 2023-11-14T22:13:25.000+00:00 UTC",
        "dedup: window 60000 ms, 17 keys remembered",
    ]
    assert lines[4].split() == ["0", "0", "9", "10", "1234", "1",
                                "2023-11-14T22:13:20.123+00:00"]
    assert lines[5].split() == ["1", "5", "-", "5", "0", "1", "-"]


def test_delivery_group_rendering_uses_the_estimated_lag() -> None:
    old = DeliveryGroupDescription.from_wire(m.DescribeDeliveryResponse(
        "g", [("m1", "", "", 90_000, 3)], [("o", 0, 3, 7, 10, 2, 4500)], 4, 1, 0,
        [10_000, 60_000], 16))
    text = _render(False, "delivery_group", old)
    assert text.splitlines()[:2] == [
        "delivery group g: 1 members online, lag 10, retry pending 4, retry in flight 1, DLQ 0",
        "retry policy: max_reconsume 16, delays 10s 1m",
    ]
    member_row = next(line for line in text.splitlines() if line.startswith("m1 "))
    assert member_row.split() == ["m1", "-", "-", "1m30s", "ago", "3"]
    d = json.loads(_render(True, "groups_described", None, old))
    assert (d["lag"], d["queues"][0]["lag"], d["queues"][0]["next"]) == (10, 5, 7)


def test_message_statuses_of_several_brokers_merge_into_one_row_per_group() -> None:
    none = ("-", "SCHEDULED", "", -1, 0, 5, "not due yet", -1)
    a = ("a", "CONSUMED", "", -1, 0, -1, "", 7)
    b = ("b", "DELIVERED", "m1", 9, 1, -1, "", -1)
    merged = merge_message_statuses([
        m.MessageStatusResponse("t", 0, 3, [b]),
        m.MessageStatusResponse("t", 0, 3, [none]),
        m.MessageStatusResponse("t", 0, 3, [a, ("b", "WAITING", "", -1, 0, -1, "", -1)]),
    ])
    assert merged == m.MessageStatusResponse("t", 0, 3, [a, b])
    alone = merge_message_statuses([m.MessageStatusResponse("t", 0, 3, [none])] * 2)
    assert alone.statuses == [none]
