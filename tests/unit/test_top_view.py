"""``ferrymq top``'s arithmetic (:func:`ferrymq.admin.top.build_view`), without a broker."""

from __future__ import annotations

import pytest

from ferrymq.admin.top import ConsumerGroupRow, DeliveryGroupRow, Sample, build_view


def test_rates_new_queues_shrinking_sizes_sort_and_limit() -> None:
    before = Sample(10.0, {("a", 0): (100, 10_000), ("a", 1): (50, 5_000), ("b", 0): (7, 700)})
    after = Sample(12.0, {("a", 0): (140, 14_000), ("a", 1): (50, 1_000), ("b", 0): (7, 700),
                          ("c", 0): (10, 900)},  # c is new: counted from zero
                   [ConsumerGroupRow("g1", "STABLE", 1, 5, 1.0),
                    ConsumerGroupRow("g2", "EMPTY", 0, 50, 9.0)],
                   [DeliveryGroupRow("d1", 1, 3, 1, 0, 0, 0.5)])
    view = build_view(before, after)
    assert view.interval_s == 2.0
    assert [(t.topic, t.queues, t.end_offset, t.size_bytes, t.messages_per_s, t.bytes_per_s)
            for t in view.topics] == [
        ("a", 2, 190, 15_000, 20.0, 2_000.0),  # a/1 shrank (retention): no bytes, not negative
        ("c", 1, 10, 900, 5.0, 450.0),
        ("b", 1, 7, 700, 0.0, 0.0),
    ]
    assert [g.group for g in view.consumer_groups] == ["g2", "g1"]  # most lag first
    assert [t.topic for t in build_view(before, after, sort="bytes").topics] == ["a", "c", "b"]
    named = build_view(before, after, sort="name", limit=2)
    assert [t.topic for t in named.topics] == ["a", "b"]
    assert [g.group for g in named.consumer_groups] == ["g1", "g2"]
    assert build_view(before, after, limit=1).to_json()["topics"] == [
        {"topic": "a", "queues": 2, "end_offset": 190, "size_bytes": 15_000,
         "messages_per_s": 20.0, "bytes_per_s": 2_000.0}]


def test_a_deleted_and_recreated_topic_never_shows_a_negative_rate() -> None:
    before = Sample(0.0, {("a", 0): (100, 1_000)})
    after = Sample(1.0, {("a", 0): (3, 300)})
    (row,) = build_view(before, after).topics
    assert (row.messages_per_s, row.bytes_per_s) == (0.0, 0.0)
    assert row.end_offset == pytest.approx(3)


def test_groups_are_ordered_by_lag_then_name_or_by_name() -> None:
    from ferrymq.admin.top import _group_order

    rows = [("b", 5), ("a", 5), ("c", 9)]
    assert sorted(rows, key=lambda r: _group_order(r[0], r[1], "rate")) == [
        ("c", 9), ("a", 5), ("b", 5)]
    assert sorted(rows, key=lambda r: _group_order(r[0], r[1], "name")) == [
        ("a", 5), ("b", 5), ("c", 9)]
