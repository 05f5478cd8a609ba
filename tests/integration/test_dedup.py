"""Per-topic dedup windows against a real broker: a message whose dedup key the topic stored
within its window is acknowledged as a duplicate (with the stored message's place) and not
stored again; after the window it is stored again; batches mixing new and duplicate messages;
restart; bad input."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ferrymq import (
    AdminClient,
    AsyncProducer,
    Broker,
    Message,
    Producer,
    ReceivedMessage,
)
from ferrymq.admin.cli import cli
from ferrymq.client._transport import Transport
from ferrymq.client.partitioner import queue_for_key
from ferrymq.errors import ConfigError, FerryMQTimeoutError, InvalidConfigError
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.dedup import DEDUP_KEY, MAX_DEDUP_WINDOW_MS
from ferrymq.protocol.records import (
    ATTR_DEDUP,
    RecordInput,
    encode_batch,
    encode_properties,
    iter_batches,
)
from tests.helpers import read_topic

pytestmark = pytest.mark.integration

WINDOW = {"dedup_window_ms": "60000"}


def read_all(address: str, topic: str, expect: int, timeout: float = 10.0) -> list[ReceivedMessage]:
    """Every message of ``topic`` from the start, in (queue, offset) order."""
    return sorted(read_topic(address, topic, expect, timeout=timeout, quiet=0.3),
                  key=lambda x: (x.queue, x.offset))


def create(address: str, topic: str, queues: int = 3,
           config: dict[str, str] | None = None) -> None:
    with AdminClient(address) as admin:
        admin.create_topic(topic, queues, WINDOW if config is None else config)


def produce_raw(address: str, topic: str, queue: int, batch: bytes) -> m.ProduceResult:
    async def go() -> m.ProduceResult:
        host, port = address.split(":")
        conn = await Transport.connect(host, int(port), 5)
        try:
            await conn.request(m.HelloRequest("t", "0"), m.HelloResponse, 5)
            resp = await conn.request(m.ProduceRequest(5000, [(topic, queue, batch)]),
                                      m.ProduceResponse, 5)
            return resp.results[0]
        finally:
            conn.close()

    return asyncio.run(go())


def dedup_batch(*keys: str, producer_id: int = -1) -> bytes:
    return bytes(encode_batch(
        [RecordInput(k.encode(), 1, properties=encode_properties({DEDUP_KEY: k})) for k in keys],
        attributes=ATTR_DEDUP, producer_id=producer_id, producer_epoch=0 if producer_id >= 0
        else -1, base_sequence=0 if producer_id >= 0 else -1))


# --- the happy paths ----------------------------------------------------------------------


def test_duplicate_within_window_is_acknowledged_and_stored_once(broker: Broker) -> None:
    create(broker.address, "orders")
    with Producer(broker.address) as p:
        first = p.send(Message("orders", b"v1", dedup_key="order-42"))
        again = p.send(Message("orders", b"v2", dedup_key="order-42"))
        by_async = p.send_async(Message("orders", b"v3", dedup_key="order-42")).result(10)
        (in_batch,) = p.send_batch([Message("orders", b"v4", dedup_key="order-42")])
    assert not first.duplicate
    for dup in (again, by_async, in_batch):
        assert dup.duplicate
        assert (dup.msg_id, dup.queue, dup.offset) == (first.msg_id, first.queue, first.offset)
        assert dup.durability == first.durability
    got = read_all(broker.address, "orders", 1)
    assert [(x.body, x.dedup_key, x.msg_id) for x in got] == [(b"v1", "order-42", first.msg_id)]
    assert got[0].properties[DEDUP_KEY] == "order-42"


def test_async_producer_reports_duplicates(broker: Broker) -> None:
    create(broker.address, "aio")

    async def go() -> None:
        async with AsyncProducer(broker.address) as p:
            a = await p.send(Message("aio", b"1", dedup_key="k"))
            b = await p.send(Message("aio", b"2", dedup_key="k"))
            fut = p.send_nowait(Message("aio", b"3", dedup_key="k"))
            assert fut is not None
            c = await fut
            batch = await p.send_batch([Message("aio", b"4", dedup_key="k"),
                                        Message("aio", b"5", dedup_key="k2")])
        assert not a.duplicate and b.duplicate and c.duplicate
        assert b.msg_id == c.msg_id == a.msg_id == batch[0].msg_id
        assert batch[0].duplicate and not batch[1].duplicate

    asyncio.run(go())
    assert [x.body for x in read_all(broker.address, "aio", 2)] in ([b"1", b"5"], [b"5", b"1"])


def test_keys_are_per_topic_across_queues(broker: Broker) -> None:
    create(broker.address, "shard", queues=4)
    a, b = "a", next(k for k in "bcdefgh" if queue_for_key(k, 4) != queue_for_key("a", 4))
    with Producer(broker.address) as p:
        first = p.send(Message("shard", b"1", dedup_key="same", sharding_key=a))
        dup = p.send(Message("shard", b"2", dedup_key="same", sharding_key=b))
    assert first.queue == queue_for_key(a, 4)
    assert dup.duplicate and (dup.queue, dup.offset) == (first.queue, first.offset)
    assert len(read_all(broker.address, "shard", 1)) == 1


def test_different_topics_are_independent(broker: Broker) -> None:
    create(broker.address, "left")
    create(broker.address, "right")
    with Producer(broker.address) as p:
        left = p.send(Message("left", b"x", dedup_key="k"))
        right = p.send(Message("right", b"x", dedup_key="k"))
        assert not left.duplicate and not right.duplicate
        assert p.send(Message("right", b"y", dedup_key="k")).duplicate
    assert len(read_all(broker.address, "left", 1)) == 1
    assert len(read_all(broker.address, "right", 1)) == 1


def test_mixed_batch_stores_only_the_new_messages(broker: Broker) -> None:
    create(broker.address, "mixed", queues=1)
    with Producer(broker.address) as p:
        old = p.send(Message("mixed", b"old", dedup_key="k-old"))
        res = p.send_batch([
            Message("mixed", b"n1", dedup_key="k-new-1"),
            Message("mixed", b"dup-old", dedup_key="k-old"),
            Message("mixed", b"n2", dedup_key="k-new-2"),
            Message("mixed", b"dup-n1", dedup_key="k-new-1"),  # repeats a key of this batch
            Message("mixed", b"plain"),  # no key: a plain batch of its own
            Message("mixed", b"n3", dedup_key="k-new-3"),
        ])
        # the producer's idempotent sequence is intact after a batch stored in part
        after = p.send_batch([Message("mixed", b"p2"), Message("mixed", b"p3")])
    assert [r.duplicate for r in res] == [False, True, False, True, False, False]
    assert res[1].offset == old.offset
    assert res[3].offset == res[0].offset
    stored = {r.msg_id for r in res if not r.duplicate}
    assert len(stored) == 4
    got = read_all(broker.address, "mixed", 7)
    assert [x.body for x in got] == [b"old", b"n1", b"n2", b"n3", b"plain", b"p2", b"p3"]
    assert [x.offset for x in got] == list(range(7))  # contiguous: nothing left a gap
    by_body = {x.body: x.msg_id for x in got}
    assert [by_body[b] for b in (b"n1", b"n2", b"plain", b"n3")] == [
        res[0].msg_id, res[2].msg_id, res[4].msg_id, res[5].msg_id]
    assert [r.offset for r in after] == [5, 6]


def test_after_the_window_the_key_is_stored_again(broker: Broker) -> None:
    create(broker.address, "short", config={"dedup_window_ms": "300"})
    with Producer(broker.address) as p:
        first = p.send(Message("short", b"1", dedup_key="k"))
        assert p.send(Message("short", b"2", dedup_key="k")).duplicate
        time.sleep(0.4)
        later = p.send(Message("short", b"3", dedup_key="k"))
        assert not later.duplicate and later.msg_id != first.msg_id
        assert p.send(Message("short", b"4", dedup_key="k")).msg_id == later.msg_id
    assert [x.body for x in read_all(broker.address, "short", 2)] in ([b"1", b"3"], [b"3", b"1"])
    with AdminClient(broker.address) as admin:  # housekeeping forgets expired keys
        deadline = time.monotonic() + 5
        while admin.describe_topic("short").dedup_keys and time.monotonic() < deadline:
            time.sleep(0.1)
        d = admin.describe_topic("short")
    assert (d.dedup_window_ms, d.dedup_keys) == (300, 0)


def test_scheduled_message_with_a_dedup_key_is_scheduled_once(broker: Broker) -> None:
    create(broker.address, "later", queues=1)
    with Producer(broker.address) as p:
        first = p.send(Message("later", b"remind", delay=0.3, dedup_key="remind-42"))
        again = p.send(Message("later", b"remind", delay=0.3, dedup_key="remind-42"))
    assert again.duplicate and again.msg_id == first.msg_id
    got = read_all(broker.address, "later", 1, timeout=10)
    assert [(x.body, x.dedup_key) for x in got] == [(b"remind", "remind-42")]


# --- topics without a window, broker default -----------------------------------------------


def test_topic_without_window_just_stores_the_keys(broker: Broker) -> None:
    create(broker.address, "plain", queues=1, config={})
    with Producer(broker.address) as p:
        a = p.send(Message("plain", b"1", dedup_key="k"))
        b = p.send(Message("plain", b"2", dedup_key="k"))
    assert not a.duplicate and not b.duplicate and a.msg_id != b.msg_id
    assert [x.dedup_key for x in read_all(broker.address, "plain", 2)] == ["k", "k"]
    # sent as ordinary idempotent batches: the producer's sequence still guards retries
    data = broker.server.topics.queue("plain", 0).log.read(0, 1 << 20)
    headers = [h for _pos, h in iter_batches(data)]
    assert all(h.producer_id >= 0 and not h.attributes & ATTR_DEDUP for h in headers)


def test_broker_default_window_applies_to_new_topics(tmp_path: Path) -> None:
    with Broker(tmp_path / "d", port=0, dedup_window_ms=120_000) as b:
        with AdminClient(b.address) as admin:
            admin.create_topic("explicit-off", 1, {"dedup_window_ms": "0"})
            admin.create_topic("own", 1, {"dedup_window_ms": "5000"})
        with Producer(b.address) as p:  # auto-created with the broker's default
            p.send(Message("auto", b"x", dedup_key="k"))
            assert p.send(Message("auto", b"y", dedup_key="k")).duplicate
            assert not p.send(Message("explicit-off", b"y", dedup_key="k")).duplicate
            assert not p.send(Message("explicit-off", b"y", dedup_key="k")).duplicate
        with AdminClient(b.address) as admin:
            auto = admin.describe_topic("auto")
            assert auto.config == {"dedup_window_ms": "120000"}
            assert (auto.dedup_window_ms, auto.dedup_keys) == (120_000, 1)
            assert admin.describe_topic("own").dedup_window_ms == 5000
            assert admin.describe_topic("explicit-off").dedup_window_ms == 0
            windows = {t[0]: t[4] for t in admin.list_topics()}
    assert windows == {"auto": 120_000, "explicit-off": 0, "own": 5000}


def test_window_survives_a_clean_restart(tmp_path: Path) -> None:
    with Broker(tmp_path / "d", port=0) as b:
        create(b.address, "keep")
        with Producer(b.address) as p:
            first = [p.send(Message("keep", f"{i}".encode(), dedup_key=f"k{i}")) for i in range(20)]
    with Broker(tmp_path / "d", port=0) as b:
        with Producer(b.address) as p:
            again = p.send_batch([Message("keep", b"x", dedup_key=f"k{i}") for i in range(25)])
        assert [r.duplicate for r in again] == [True] * 20 + [False] * 5
        assert [r.msg_id for r in again[:20]] == [r.msg_id for r in first]
        assert len(read_all(b.address, "keep", 25)) == 25


def test_keys_older_than_the_window_are_not_rebuilt(tmp_path: Path) -> None:
    with Broker(tmp_path / "d", port=0) as b:
        create(b.address, "brief", config={"dedup_window_ms": "1000"})
        create(b.address, "long", config={"dedup_window_ms": "60000"})
        with Producer(b.address) as p:
            p.send(Message("brief", b"1", dedup_key="k"))
            p.send(Message("long", b"1", dedup_key="k"))
    time.sleep(1.1)
    with Broker(tmp_path / "d", port=0) as b:
        assert b.server.dedup.keys(b.server.topics.get("brief").topic_id) == 0
        with Producer(b.address) as p:
            assert not p.send(Message("brief", b"2", dedup_key="k")).duplicate
            assert p.send(Message("long", b"2", dedup_key="k")).duplicate


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(("config", "match"), [
    ({"dedup_window_ms": str(MAX_DEDUP_WINDOW_MS + 1)}, "MAX_DEDUP_WINDOW_MS"),
    ({"dedup_window_ms": "-1"}, "dedup_window_ms='-1' is not valid: use an integer in 0.."),
    ({"dedup_window_ms": "soon"}, "dedup_window_ms='soon' is not valid: use an integer"),
    ({"dedup_window_ms": "7200000", "retention_ms": "3600000"}, "exceeds the topic's retention"),
])
def test_bad_topic_windows_are_refused(broker: Broker, config: dict[str, str], match: str) -> None:
    with AdminClient(broker.address) as admin, pytest.raises(InvalidConfigError, match=match):
        admin.create_topic("bad-window", 1, config)


def test_window_within_retention_and_forever_retention_are_fine(broker: Broker) -> None:
    with AdminClient(broker.address) as admin:
        admin.create_topic("w1", 1, {"dedup_window_ms": str(MAX_DEDUP_WINDOW_MS),
                                     "retention_ms": "-1"})
        admin.create_topic("w2", 1, {"dedup_window_ms": "3600000", "retention_ms": "3600000"})


@pytest.mark.parametrize(("settings", "match"), [
    ({"dedup_window_ms": MAX_DEDUP_WINDOW_MS + 1}, "dedup_window_ms must be"),
    ({"dedup_window_ms": 7200_000, "retention_ms": 3600_000}, "exceeds retention_ms"),
    ({"dedup_max_keys": 0}, "dedup_max_keys must be > 0"),
])
def test_bad_broker_settings_are_refused(tmp_path: Path, settings: dict[str, int],
                                         match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Broker(tmp_path / "d", port=0, **settings)


def test_raw_dedup_batches_the_broker_refuses(broker: Broker) -> None:
    create(broker.address, "raw", queues=1)
    res = produce_raw(broker.address, "raw", 0, dedup_batch("a", producer_id=7))
    assert res[2] == ErrorCode.INVALID_REQUEST and "producer id" in res[3]
    no_key = bytes(encode_batch([RecordInput(b"x", 1)], attributes=ATTR_DEDUP))
    res = produce_raw(broker.address, "raw", 0, no_key)
    assert res[2] == ErrorCode.INVALID_REQUEST and "%DEDUP" in res[3]
    assert broker.server.topics.queue("raw", 0).log.end_offset == 0
    ok = produce_raw(broker.address, "raw", 0, dedup_batch("a", "b", "a"))
    assert ok[2] == 0 and ok[4:6] == (0, 1) and ok[9] == [(2, 0, 0)]
    dup = produce_raw(broker.address, "raw", 0, dedup_batch("b", "a"))
    assert dup[2] == 0 and dup[4:7] == (-1, -1, -1) and dup[9] == [(0, 0, 1), (1, 0, 0)]
    assert dup[7] == m.Durability.FSYNCED


def test_too_many_keys_is_busy_until_they_expire(tmp_path: Path) -> None:
    with Broker(tmp_path / "d", port=0, dedup_max_keys=3) as b:
        create(b.address, "tight", queues=1, config={"dedup_window_ms": "400"})
        assert produce_raw(b.address, "tight", 0, dedup_batch("a", "b"))[2] == 0
        busy = produce_raw(b.address, "tight", 0, dedup_batch("c", "d"))
        assert busy[2] == ErrorCode.BUSY and "dedup_max_keys" in busy[3]
        assert b.server.topics.queue("tight", 0).log.end_offset == 2  # nothing of it stored
        assert produce_raw(b.address, "tight", 0, dedup_batch("a", "c"))[2] == 0  # 1 new
        with Producer(b.address, delivery_timeout_s=0.3) as p, pytest.raises(FerryMQTimeoutError):
            p.send(Message("tight", b"x", dedup_key="e"))  # BUSY is retried, then times out
        time.sleep(0.5)
        with Producer(b.address) as p:
            assert not p.send(Message("tight", b"x", dedup_key="e")).duplicate


def test_cli_shows_the_window_and_duplicates(broker: Broker) -> None:
    runner = CliRunner()
    out = runner.invoke(cli, ["--server", broker.address, "topic", "create", "clitopic",
                              "--queues", "2", "--config", "dedup_window_ms=90000"])
    assert out.exit_code == 0, out.output
    for expect_dup in (False, True):
        out = runner.invoke(cli, ["--server", broker.address, "produce", "clitopic", "hello",
                                  "--dedup-key", "k1"])
        assert out.exit_code == 0, out.output
        assert ("duplicate" in out.output) is expect_dup
    out = runner.invoke(cli, ["--server", broker.address, "topic", "describe", "clitopic"])
    assert out.exit_code == 0, out.output
    assert "dedup_window_ms=90000" in out.output
    assert "dedup: window 90000 ms, 1 keys remembered" in out.output
    out = runner.invoke(cli, ["--server", broker.address, "--json", "topic", "describe",
                              "clitopic"])
    assert '"dedup_window_ms": 90000' in out.output and '"dedup_keys": 1' in out.output
    bad = runner.invoke(cli, ["--server", broker.address, "produce", "clitopic", "x",
                              "--dedup-key", "k" * 256])
    assert bad.exit_code == 2 and "255" in bad.output
    two = runner.invoke(cli, ["--server", broker.address, "produce", "clitopic", "x", "y",
                              "--dedup-key", "k"])
    assert two.exit_code == 2 and "exactly one BODY" in two.output


def test_rebuilt_keys_point_at_the_stored_messages(tmp_path: Path) -> None:
    """The start-up scan finds dedup batches among plain ones in several segments."""
    with Broker(tmp_path / "d", port=0, segment_bytes=4096) as b:
        create(b.address, "segs", queues=2)
        with Producer(b.address) as p:
            sent = {}
            for i in range(60):
                p.send(Message("segs", b"plain" * 50))
                sent[f"k{i}"] = p.send(Message("segs", b"keyed" * 50, dedup_key=f"k{i}"))
        assert len(b.server.topics.queue("segs", 0).log.segments()) > 2
    with Broker(tmp_path / "d", port=0) as b:
        assert b.server.dedup.keys(b.server.topics.get("segs").topic_id) == 60
        with Producer(b.address) as p:
            for k, first in sent.items():
                dup = p.send(Message("segs", b"again", dedup_key=k))
                assert dup.duplicate and dup.msg_id == first.msg_id
