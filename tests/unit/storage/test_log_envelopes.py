"""A log holding both record formats: FerryMQ batches and envelopes (Kafka batches as they
came, :mod:`ferrymq.protocol.kafka.envelope`). Appended, read as stored and converted,
recovered after a crash, copied by a follower."""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import pytest
from storage_support import BatchFactory, LogOpener

from ferrymq.errors import CorruptRecordError, MessageTooLargeError
from ferrymq.protocol.kafka import records as kafka
from ferrymq.protocol.kafka.envelope import ENVELOPE_MAGIC, wrap
from ferrymq.protocol.records import (
    HEADER_SIZE,
    MAGIC,
    RecordInput,
    decode_records,
    encode_batch,
    iter_batches,
)
from ferrymq.storage import Log, LogConfig

LOG0 = "00000000000000000000.log"
CONFIG = LogConfig(index_interval_bytes=100)


def kafka_batch(first: int, n: int) -> bytes:
    """A Kafka batch of ``n`` records ``k<i>`` / ``v<i>`` for i from ``first``."""
    return kafka.to_kafka(bytes(encode_batch(
        [RecordInput(f"v{i}".encode(), 1000 + i, sharding_key=f"k{i}".encode())
         for i in range(first, first + n)])))


def envelope(first: int, n: int) -> bytearray:
    return wrap(kafka_batch(first, n), max_batch_bytes=1 << 20, max_records=1000)


def write_both(log: Log, make_batch: BatchFactory) -> list[int]:
    """Offsets 0-1 FerryMQ, 2-4 Kafka, 5-6 FerryMQ, 7-8 Kafka; the end position of each."""
    ends = []
    for batch in (make_batch(2), envelope(2, 3), make_batch(2), envelope(7, 2)):
        log.append(batch, now_ms=5)
        ends.append(log.segments()[-1].size_bytes)
    return ends


def bodies(data: bytes | memoryview) -> list[tuple[int, bytes]]:
    return [(r.offset, r.body) for r in decode_records(data)]


EXPECTED = [(0, b"m0"), (1, b"m1"), (2, b"v2"), (3, b"v3"), (4, b"v4"), (5, b"m0"), (6, b"m1"),
            (7, b"v7"), (8, b"v8")]


def test_read_converts_envelopes_and_stored_keeps_them(open_log: LogOpener,
                                                       make_batch: BatchFactory) -> None:
    log, _ = open_log(CONFIG)
    write_both(log, make_batch)
    native = log.read(0, 1 << 20)
    assert {h.magic for _p, h in iter_batches(native)} == {MAGIC}
    assert bodies(native) == EXPECTED
    assert [r.sharding_key for r in decode_records(native)][2:5] == ["k2", "k3", "k4"]
    assert {h.append_time_ms for _p, h in iter_batches(native)} == {5}
    stored = bytes(log.read_view(0, 1 << 20, stored=True))
    assert [h.magic for _p, h in iter_batches(stored)] == [MAGIC, ENVELOPE_MAGIC, MAGIC,
                                                           ENVELOPE_MAGIC]
    # the Kafka batch inside, as sent but for its stamped base offset
    [(pos, h)] = [(p, h) for p, h in iter_batches(stored) if h.base_offset == 2]
    inner = stored[pos + HEADER_SIZE:pos + h.size]
    assert inner[8:] == kafka_batch(2, 3)[8:]
    assert kafka.decode_header(inner).base_offset == 2
    assert bodies(log.read(3, 1)) == EXPECTED[2:5]  # the whole batch holding offset 3


def test_a_log_of_both_formats_recovers_after_a_crash(open_log: LogOpener,
                                                      make_batch: BatchFactory,
                                                      log_dir: Path) -> None:
    log, _ = open_log(CONFIG)
    write_both(log, make_batch)
    log.flush()
    reopened, report = open_log(CONFIG, clean=False)  # no clean-shutdown marker: a full scan
    assert report.truncated_bytes == 0
    assert report.end_offset == 9
    assert bodies(reopened.read(0, 1 << 20)) == EXPECTED
    assert reopened.append(envelope(9, 1), now_ms=6).base_offset == 9


def test_a_torn_envelope_at_the_tail_is_cut_at_every_byte(tmp_path: Path,
                                                          make_batch: BatchFactory) -> None:
    source = tmp_path / "source"
    log, _ = Log.open(source, CONFIG, clean_shutdown=True, now_ms=0)
    ends = write_both(log, make_batch)
    log.close()
    data = (source / LOG0).read_bytes()
    for cut in range(ends[-2] + 1, len(data), 7):
        work = tmp_path / f"cut{cut}"
        shutil.copytree(source, work)
        with open(work / LOG0, "r+b") as f:
            f.truncate(cut)
        recovered, report = Log.open(work, CONFIG, clean_shutdown=False, now_ms=0)
        assert report.end_offset == 7, cut
        assert report.truncated_bytes == cut - ends[-2]
        assert bodies(recovered.read(0, 1 << 20)) == EXPECTED[:7]
        recovered.close()
        shutil.rmtree(work)


def test_any_bit_flip_in_a_middle_envelope_refuses_to_start(tmp_path: Path,
                                                            make_batch: BatchFactory) -> None:
    source = tmp_path / "source"
    log, _ = Log.open(source, CONFIG, clean_shutdown=True, now_ms=0)
    ends = write_both(log, make_batch)
    log.close()
    original = (source / LOG0).read_bytes()
    for bit in range(ends[0] * 8, ends[1] * 8, 3):  # the first envelope, every third bit
        data = bytearray(original)
        data[bit // 8] ^= 1 << (bit % 8)
        (source / LOG0).write_bytes(data)
        with pytest.raises(CorruptRecordError, match="mid-log corruption"):
            Log.open(source, CONFIG, clean_shutdown=False, now_ms=0)


def test_a_follower_copies_envelopes_as_stored(open_log: LogOpener, make_batch: BatchFactory,
                                               tmp_path: Path) -> None:
    leader, _ = open_log(CONFIG)
    write_both(leader, make_batch)
    follower, _ = Log.open(tmp_path / "follower", CONFIG, clean_shutdown=True, now_ms=0)
    try:
        stored = leader.read_view(0, 1 << 20, stored=True)
        for pos, h in iter_batches(stored):
            follower.append_replica(stored[pos:pos + h.size])
        assert bytes(follower.read_view(0, 1 << 20, stored=True)) == bytes(stored)
        assert bodies(follower.read(0, 1 << 20)) == EXPECTED
        leader.append(envelope(9, 1), now_ms=6)
        good = leader.read_view(9, 1, stored=True)
        bad = bytearray(good)
        bad[HEADER_SIZE:HEADER_SIZE + 8] = (10).to_bytes(8, "big")  # the Kafka baseOffset
        with pytest.raises(CorruptRecordError, match="does not hold its Kafka batch"):
            follower.append_replica(bad)
        assert follower.append_replica(good).base_offset == 9
    finally:
        follower.close()


def test_an_envelope_that_inflates_past_the_limit_is_a_read_error(
        open_log: LogOpener) -> None:
    records = bytearray()
    body = b"\x00" * 100_000
    kafka._append_record(records, 0, 0, None, body, [])
    comp = zlib.compressobj(wbits=31)
    payload = comp.compress(bytes(records)) + comp.flush()
    batch = bytearray(kafka.HEADER_SIZE) + payload
    kafka.HEADER.pack_into(batch, 0, 0, len(batch) - 12, -1, 2, 0, kafka.COMPRESSION_GZIP, 0,
                           1000, 1000, -1, -1, -1, 1)
    batch[17:21] = (kafka.crc32c(memoryview(batch)[21:]) & 0xFFFFFFFF).to_bytes(4, "big")
    log, _ = open_log(LogConfig(max_converted_batch_bytes=10_000))
    log.append(wrap(bytes(batch), max_batch_bytes=1 << 20, max_records=10), now_ms=0)
    assert len(log.read_view(0, 1 << 20, stored=True)) < 10_000
    with pytest.raises(MessageTooLargeError, match="decompresses to more than 10000"):
        log.read(0, 1 << 20)
