"""The pull consumer's buffer without a broker: fetched bytes become messages, positions move
as messages are handed out, markers, aborted and scheduled batches are skipped, a malformed
batch is reported once and skipped, a seek drops what was buffered."""

from __future__ import annotations

from ferrymq.client._pull_buffer import FetchBuffer, QueueState, TopicQueue
from ferrymq.errors import CorruptRecordError
from ferrymq.protocol.markers import encode_marker
from ferrymq.protocol.records import (
    ATTR_SCHEDULED,
    ATTR_TRANSACTIONAL,
    HEADER_SIZE,
    RecordInput,
    crc32c,
    encode_batch,
    seal_header_crc,
    stamp_batch,
)

T0 = 1_700_000_000_000


def stored(base: int, bodies: list[bytes], *, producer_id: int = -1, attributes: int = 0
           ) -> bytes:
    """A batch as a FETCH brings it: stamped with its base offset and append time."""
    buf = encode_batch([RecordInput(b, T0) for b in bodies], producer_id=producer_id,
                       producer_epoch=0 if producer_id >= 0 else -1, attributes=attributes)
    stamp_batch(buf, 0, base, T0)
    return bytes(buf)


def marker(base: int, producer_id: int, *, commit: bool) -> bytes:
    buf = bytearray(encode_marker(producer_id=producer_id, producer_epoch=0, commit=commit,
                                  transactional_id="t", coordinator_offset=0, timestamp_ms=T0))
    stamp_batch(buf, 0, base, T0)
    return bytes(buf)


def malformed(base: int, bodies: list[bytes]) -> bytes:
    """CRC-valid, but the first record's tag length runs past the record (a faulty producer)."""
    buf = bytearray(stored(base, bodies))
    buf[HEADER_SIZE + 13] = 255
    buf[24:28] = int(crc32c(memoryview(buf)[28:])).to_bytes(4, "little")
    seal_header_crc(buf, 0)
    return bytes(buf)


def one_queue(position: int = 0) -> tuple[dict[TopicQueue, QueueState], QueueState]:
    st = QueueState(position=position, finished=position, fetch_position=position, topic_id=7)
    return {("t", 0): st}, st


def test_fetched_messages_are_handed_out_in_order_and_move_the_position() -> None:
    queues, st = one_queue()
    buf = FetchBuffer()
    buf.add_fetched("t", 0, st, stored(0, [b"a", b"b"]) + stored(2, [b"c", b"d", b"e"]))
    assert st.fetch_position == 5 and st.buffered == 5 and buf.pending() == 5
    first = buf.take(3, queues)
    assert [(x.offset, x.body) for x in first] == [(0, b"a"), (1, b"b"), (2, b"c")]
    assert first[0].topic == "t" and first[0].queue == 0
    assert st.position == 3 and st.buffered == 2 and buf.pending() == 2
    rest = buf.take(10, queues)
    assert [x.body for x in rest] == [b"d", b"e"]
    assert st.position == 5 and not buf and buf.pending() == 0


def test_offsets_before_the_fetch_position_are_not_handed_out_again() -> None:
    queues, st = one_queue(position=1)
    buf = FetchBuffer()
    buf.add_fetched("t", 0, st, stored(0, [b"a", b"b", b"c"]))  # the batch starts before
    assert [x.offset for x in buf.take(10, queues)] == [1, 2]


def test_a_queue_filtered_empty_moves_to_its_fetch_position() -> None:
    # the broker filtered offsets 0..9 out by tag: nothing came, yet they are consumed
    queues, st = one_queue()
    buf = FetchBuffer()
    buf.add_fetched("t", 0, st, stored(10, [b"x"]))
    assert st.position == 0  # not yet: offset 10 is buffered
    buf.take(1, queues)
    assert st.position == 11


def test_markers_aborted_and_scheduled_batches_are_skipped() -> None:
    queues, st = one_queue()
    buf = FetchBuffer()
    data = (stored(0, [b"keep"])
            + stored(1, [b"aborted"], producer_id=5, attributes=ATTR_TRANSACTIONAL)
            + marker(2, 5, commit=False)
            + stored(3, [b"scheduled original"], attributes=ATTR_SCHEDULED)
            + stored(4, [b"committed"], producer_id=6, attributes=ATTR_TRANSACTIONAL)
            + marker(5, 6, commit=True))
    buf.add_fetched("t", 0, st, data, aborted=[(5, 1)])
    assert [x.body for x in buf.take(10, queues)] == [b"keep", b"committed"]
    assert st.fetch_position == 6 and st.position == 6


def test_read_uncommitted_keeps_aborted_data_but_never_markers() -> None:
    queues, st = one_queue()
    buf = FetchBuffer()
    buf.add_fetched("t", 0, st, stored(0, [b"aborted"], producer_id=5,
                                        attributes=ATTR_TRANSACTIONAL) + marker(1, 5, commit=False))
    assert [x.body for x in buf.take(10, queues)] == [b"aborted"]
    assert st.position == 2


def test_only_skipped_batches_move_the_position_at_once() -> None:
    _, st = one_queue()
    buf = FetchBuffer()
    buf.add_fetched("t", 0, st, marker(0, 5, commit=True))
    assert not buf and st.position == 1 and st.fetch_position == 1


def test_a_malformed_batch_is_reported_once_and_skipped() -> None:
    queues, st = one_queue()
    buf = FetchBuffer()
    buf.add_fetched("t", 0, st, stored(0, [b"a"]) + malformed(1, [b"b", b"c"]) + stored(3, [b"d"]))
    [err] = buf.corrupt
    assert isinstance(err, CorruptRecordError)
    assert "t/0: the batch at offsets 1..2 is malformed inside" in str(err)
    assert [x.body for x in buf.take(10, queues)] == [b"a"]  # what came before it
    assert st.fetch_position == 3  # the next fetch continues after it
    buf.add_fetched("t", 0, st, stored(3, [b"d"]))
    assert [x.body for x in buf.take(10, queues)] == [b"d"] and len(buf.corrupt) == 1


def test_drop_forgets_one_queue_and_recounts() -> None:
    a, b = QueueState(fetch_position=0), QueueState(fetch_position=0)
    queues = {("t", 0): a, ("t", 1): b}
    buf = FetchBuffer()
    buf.add_fetched("t", 0, a, stored(0, [b"a0", b"a1"]))
    buf.add_fetched("t", 1, b, stored(0, [b"b0"]))
    buf.add_fetched("t", 0, a, stored(2, [b"a2"]))
    assert buf.take(1, queues)[0].body == b"a0"  # the head is inside the first chunk
    buf.drop(queues, lambda tq: tq == ("t", 1))
    assert (a.buffered, b.buffered) == (2, 0) and buf.pending() == 2
    assert [x.body for x in buf.take(10, queues)] == [b"a1", b"a2"]


def test_take_spans_queues_and_clear_empties() -> None:
    a, b = QueueState(fetch_position=0), QueueState(fetch_position=0)
    queues = {("t", 0): a, ("u", 0): b}
    buf = FetchBuffer()
    buf.add_fetched("t", 0, a, stored(0, [b"a0"]))
    buf.add_fetched("u", 0, b, stored(0, [b"b0", b"b1"]))
    out = buf.take(2, queues)
    assert [(x.topic, x.body) for x in out] == [("t", b"a0"), ("u", b"b0")]
    assert (a.position, b.position) == (1, 1)
    buf.clear()
    assert not buf and buf.pending() == 0


def test_messages_of_a_queue_no_longer_assigned_move_no_position() -> None:
    _, st = one_queue()
    buf = FetchBuffer()
    buf.add_fetched("t", 0, st, stored(0, [b"a"]))
    assert [x.body for x in buf.take(1, {})] == [b"a"]
    assert st.position == 0
