"""Parking (broker/scheduler/parking.py) over a real log in tmp_path, without a broker: due
entries of a cluster's queue wait for their mark, the marks of copies and cancel records are
read up to a bound, kept for entries still pending, forgotten above a truncation and below the
lowest entry."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrymq.broker.scheduler import parking
from ferrymq.broker.scheduler.parking import Parking
from ferrymq.broker.topics import CLUSTER_TOPIC_ID_BASE, QueueState
from ferrymq.protocol.records import (
    ATTR_SCHEDULED,
    RecordInput,
    encode_batch,
    encode_msg_id,
    encode_properties,
)
from ferrymq.protocol.schedule import (
    CANCELLED_MARK,
    DELAY,
    FIRED_MARK,
    cancel_properties,
    copy_properties,
)
from ferrymq.storage import Log, LogConfig

TID, Q = CLUSTER_TOPIC_ID_BASE, 0
KEY = (TID, Q)
NOW = 1_700_000_000_000


def batch(props: list[dict[str, str]], attributes: int = 0) -> bytearray:
    return encode_batch([RecordInput(b"x", NOW, properties=encode_properties(p)) for p in props],
                        attributes=attributes)


@pytest.fixture
def qs(tmp_path: Path) -> QueueState:
    """Offsets 0-2: originals due at NOW+10; 3: plain; 4: the copy of 0; 5: a cancel of 1;
    6: the copy of an original of another queue."""
    lg, _ = Log.open(tmp_path / "q", LogConfig(), clean_shutdown=True, now_ms=NOW)
    lg.append(batch([{DELAY: "10"}] * 3, ATTR_SCHEDULED), now_ms=NOW)
    lg.append(batch([{"u": "1"}]), now_ms=NOW)
    lg.append(batch([copy_properties({}, encode_msg_id(TID, Q, 0), NOW + 10)]), now_ms=NOW)
    lg.append(batch([cancel_properties(encode_msg_id(TID, Q, 1))], ATTR_SCHEDULED), now_ms=NOW)
    lg.append(batch([copy_properties({}, encode_msg_id(TID, Q + 1, 2), NOW + 10)]), now_ms=NOW)
    return QueueState("t", TID, Q, lg, lg.end_offset)


def item(off: int) -> tuple[int, int, int]:
    return off, NOW + 10, NOW


def test_parked_entries_settle_by_their_marks(qs: QueueState) -> None:
    p = Parking()
    p.park(KEY, [item(0), item(1), item(2)])
    assert p.parked == 3 and p.lowest(KEY) == 0
    assert p.read(qs, 4) > 0  # up to the bound only: the copy at 4 is not committed yet
    assert p.settle_marked(KEY) == []
    p.read(qs, qs.log.end_offset)
    assert sorted(p.settle_marked(KEY)) == [(FIRED_MARK, [item(0)]), (CANCELLED_MARK, [item(1)])]
    assert p.parked == 1 and p.unpark(KEY) == [item(2)]  # no mark: a new leader fires it


def test_a_mark_read_while_its_entry_is_pending_settles_it_when_due(qs: QueueState) -> None:
    p = Parking()
    p.watch(KEY, 0)
    p.read(qs, qs.log.end_offset)
    assert p.mark_of(KEY, 1) == CANCELLED_MARK and p.mark_of(KEY, 2) is None
    marked, rest = p.split_marked(KEY, [item(1), item(2)])
    assert (marked, rest) == ([(CANCELLED_MARK, [item(1)])], [item(2)])
    assert p.mark_of(KEY, 1) is None  # settled once


def test_a_truncation_forgets_the_marks_above_it_and_reads_again(qs: QueueState) -> None:
    p = Parking()
    p.park(KEY, [item(0), item(1)])
    p.read(qs, qs.log.end_offset)
    p.truncated(KEY, 5)  # the cancel record at 5 is gone, the copy at 4 stays
    assert p.mark_of(KEY, 0) == FIRED_MARK and p.mark_of(KEY, 1) is None
    qs.log.truncate_to(5)
    qs.log.append(batch([cancel_properties(encode_msg_id(TID, Q, 1))], ATTR_SCHEDULED),
                  now_ms=NOW)
    p.read(qs, qs.log.end_offset)  # read again from the cut
    assert p.mark_of(KEY, 1) == CANCELLED_MARK


def test_marks_below_the_lowest_entry_are_dropped(qs: QueueState) -> None:
    p = Parking()
    p.watch(KEY, 0)
    p.read(qs, qs.log.end_offset)
    p.prune(KEY, 1)
    assert p.mark_of(KEY, 0) is None and p.mark_of(KEY, 1) == CANCELLED_MARK
    p.prune(KEY, None)  # nothing pending or parked: nothing kept
    assert p.mark_of(KEY, 1) is None
    p.park(KEY, [item(0)])  # an entry below what was read: its marks are read again
    p.read(qs, qs.log.end_offset)
    assert p.settle_marked(KEY) == [(FIRED_MARK, [item(0)])]


def test_a_read_with_a_byte_budget_goes_on_where_it_stopped(
        qs: QueueState, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parking, "MARKS_READ_BYTES", 1)  # one batch per log read
    p = Parking()
    p.park(KEY, [item(0), item(1)])
    reads = 0
    while p.mark_of(KEY, 1) is None:
        assert p.read(qs, qs.log.end_offset, max_bytes=1) > 0
        reads += 1
        assert reads <= 5, "the cursor did not move on"
    assert reads == 4  # batches at 0, 3, 4 (the copy of 0) and 5 (the cancel of 1)
    assert p.mark_of(KEY, 0) == FIRED_MARK
    assert p.read(qs, qs.log.end_offset, max_bytes=1) > 0  # the last batch, then nothing left
    assert p.read(qs, qs.log.end_offset, max_bytes=1) == 0
