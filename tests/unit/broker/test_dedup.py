"""The dedup table and the broker's dedup rules, on real logs in ``tmp_path`` with explicit times
(no sockets, no sleeps)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrymq.broker.dedup import Deduplicator, DedupTable
from ferrymq.broker.topics import TopicRegistry
from ferrymq.errors import BusyError, InvalidConfigError, InvalidRequestError
from ferrymq.protocol.dedup import DEDUP_KEY
from ferrymq.protocol.records import (
    ATTR_DEDUP,
    RecordInput,
    decode_header,
    decode_records,
    encode_batch,
    encode_properties,
)
from ferrymq.storage import LogConfig

T0 = 1_700_000_000_000


def batch(*keys: str, producer_id: int = -1) -> bytearray:
    return encode_batch(
        [RecordInput(k.encode(), T0, properties=encode_properties({DEDUP_KEY: k})) for k in keys],
        attributes=ATTR_DEDUP, producer_id=producer_id,
        producer_epoch=0 if producer_id >= 0 else -1,
        base_sequence=0 if producer_id >= 0 else -1)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[TopicRegistry]:
    reg = _open(tmp_path)
    try:
        yield reg
    finally:
        reg.close()


def _open(path: Path, default_window: int = 0) -> TopicRegistry:
    reg = TopicRegistry(path, LogConfig(retention_ms=None), sync_visibility=True,
                        clean_shutdown=False,
                        max_queues=8, default_dedup_window_ms=default_window)
    reg.open_all(T0)
    return reg


# --- the table ------------------------------------------------------------------------------


def test_table_window_is_half_open() -> None:
    t = DedupTable(window_ms=100, max_keys=10)
    t.remember("k", 1, 7, T0)
    assert t.lookup("k", T0) == (1, 7)
    assert t.lookup("k", T0 + 99) == (1, 7)
    assert t.lookup("k", T0 + 100) is None  # now - t < window, as in NATS
    assert t.lookup("other", T0) is None


def test_table_expires_in_insertion_order_and_keeps_a_key_stored_again() -> None:
    t = DedupTable(window_ms=100, max_keys=10)
    t.remember("a", 0, 0, T0)
    t.remember("b", 0, 1, T0 + 50)
    assert t.expire(T0 + 99) == 0 and len(t) == 2
    assert t.expire(T0 + 100) == 1 and len(t) == 1
    t.remember("b", 2, 9, T0 + 200)  # stored again after its window ended
    assert t.expire(T0 + 150) == 0  # the old entry of "b" goes, the new one stays
    assert t.lookup("b", T0 + 250) == (2, 9)
    assert t.expire(T0 + 300) == 1 and len(t) == 0 and not t.order


# --- the broker's rules -----------------------------------------------------------------------


def test_topic_without_window_is_not_checked(registry: TopicRegistry) -> None:
    registry.create("plain", 1, {}, T0)
    d = Deduplicator(registry)
    b = batch("a", "a")
    assert d.check(registry.queue("plain", 0), b, decode_header(b), T0) is None
    assert d.keys(registry.get("plain").topic_id) == 0


def test_check_and_on_append(registry: TopicRegistry) -> None:
    registry.create("t", 2, {"dedup_window_ms": "1000"}, T0)
    d = Deduplicator(registry)
    q0, q1 = registry.queue("t", 0), registry.queue("t", 1)
    b = batch("a", "b")
    plan = d.check(q0, b, decode_header(b), T0)
    assert plan is not None and plan.batch is b and not plan.duplicates  # untouched
    res = q0.log.append(b, now_ms=T0)
    assert d.on_append(plan, q0, res.base_offset, res.append_time_ms) == []
    b2 = batch("c", "a", "c", "d")
    plan = d.check(q1, b2, decode_header(b2), T0 + 10)
    assert plan is not None and plan.batch is not None and plan.header is not None
    assert plan.keys == ["c", "d"] and plan.header.record_count == 2
    assert [r.body for r in decode_records(plan.batch)] == [b"c", b"d"]
    res = q1.log.append(plan.batch, now_ms=T0 + 10)
    assert d.on_append(plan, q1, res.base_offset, res.append_time_ms) == [(1, 0, 0), (2, 1, 0)]
    b3 = batch("d", "b")
    plan = d.check(q0, b3, decode_header(b3), T0 + 20)
    assert plan is not None and plan.batch is None
    assert plan.duplicates == [(0, 1, 1), (1, 0, 1)]
    assert d.keys(registry.get("t").topic_id) == 4


def test_check_refuses_before_storing_anything(registry: TopicRegistry) -> None:
    registry.create("t", 1, {"dedup_window_ms": "1000"}, T0)
    d = Deduplicator(registry, max_keys=3)
    q = registry.queue("t", 0)
    b = batch("a", producer_id=3)
    with pytest.raises(InvalidRequestError, match="producer id"):
        d.check(q, b, decode_header(b), T0)
    b = batch("a", "b")
    plan = d.check(q, b, decode_header(b), T0)
    assert plan is not None
    d.on_append(plan, q, q.log.append(b, now_ms=T0).base_offset, T0)
    b = batch("a", "c", "d")  # two new keys: one too many
    with pytest.raises(BusyError, match="remembers 2 dedup keys, max 3"):
        d.check(q, b, decode_header(b), T0 + 1)
    b = batch("a", "c", "c")
    assert d.check(q, b, decode_header(b), T0 + 1) is not None  # one new key fits
    b = batch("c", "d")
    assert d.check(q, b, decode_header(b), T0 + 1000) is not None  # a and b expired


def test_create_checks_the_window(registry: TopicRegistry) -> None:
    with pytest.raises(InvalidConfigError, match="MAX_DEDUP_WINDOW_MS"):
        registry.create("t", 1, {"dedup_window_ms": str(86_400_001)}, T0)
    with pytest.raises(InvalidConfigError, match="retention_ms 1000"):
        registry.create("t", 1, {"dedup_window_ms": "1001", "retention_ms": "1000"}, T0)
    assert "t" not in registry.topics
    assert registry.create("t", 1, {"dedup_window_ms": "1000", "retention_ms": "1000"},
                           T0).dedup_window_ms == 1000


def test_default_window_is_written_into_new_topics_only(tmp_path: Path) -> None:
    reg = _open(tmp_path, default_window=5000)
    try:
        assert reg.create("a", 1, {}, T0).config == {"dedup_window_ms": "5000"}
        assert reg.create("b", 1, {"dedup_window_ms": "0"}, T0).dedup_window_ms == 0
        assert reg.create("%RETRY%g", 1, {}, T0, internal_ok=True).dedup_window_ms == 0
    finally:
        reg.close()
    reg = _open(tmp_path, default_window=0)  # the broker default changed: "a" keeps its window
    try:
        assert reg.get("a").dedup_window_ms == 5000
        assert reg.create("c", 1, {}, T0).dedup_window_ms == 0
    finally:
        reg.close()


# --- rebuild at start ---------------------------------------------------------------------------


def test_load_rebuilds_only_what_is_within_the_window(tmp_path: Path) -> None:
    reg = _open(tmp_path)
    reg.create("t", 2, {"dedup_window_ms": "1000"}, T0)
    reg.create("off", 1, {}, T0)
    q0, q1 = reg.queue("t", 0), reg.queue("t", 1)
    q0.log.append(batch("old"), now_ms=T0)  # exactly one window before "now": expired
    q0.log.append(encode_batch([RecordInput(b"plain", T0)]), now_ms=T0 + 1)
    q1.log.append(batch("young", "x"), now_ms=T0 + 1)
    q0.log.append(batch("x"), now_ms=T0 + 500)  # a later copy: the first one is the original
    reg.queue("off", 0).log.append(batch("off"), now_ms=T0 + 1)
    reg.close()
    reg = _open(tmp_path)
    try:
        d = Deduplicator(reg)
        report = d.load(T0 + 1000)
        assert (report.topics, report.keys, report.dropped) == (1, 2, 0)
        t = d._tables[reg.get("t").topic_id]
        assert t.lookup("old", T0 + 1000) is None
        assert t.lookup("young", T0 + 1000) == (1, 0)
        assert t.lookup("x", T0 + 1000) == (1, 1)  # the earliest copy is the original
        assert [k for _t, k in t.order] == ["young", "x"]
        small = Deduplicator(reg, max_keys=1)
        assert small.load(T0 + 1000).dropped == 2  # "young", "x" at q1, "x" at q0: keep newest
    finally:
        reg.close()
