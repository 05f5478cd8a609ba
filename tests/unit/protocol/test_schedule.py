"""Scheduled messages on the wire: due properties, delay levels, batch checks."""

from __future__ import annotations

import pytest

from ferrymq.errors import InvalidRequestError
from ferrymq.protocol.records import (
    ATTR_SCHEDULED,
    RecordInput,
    decode_header,
    encode_batch,
    encode_properties,
)
from ferrymq.protocol.schedule import (
    CANCELLED_MARK,
    DELAY,
    DELAY_LEVELS_MS,
    DELIVER_AT,
    FIRED_MARK,
    SCHEDULED_DUE,
    SCHEDULED_ID,
    Due,
    cancel_properties,
    copy_properties,
    delay_level_ms,
    due_property,
    parse_due,
    read_due_times,
    read_marks,
)

NOW = 1_700_000_000_000
DAY = 86_400_000


def test_rocketmq_delay_levels() -> None:
    assert len(DELAY_LEVELS_MS) == 18
    assert delay_level_ms(1) == 1000
    assert delay_level_ms(4) == 30_000
    assert delay_level_ms(5) == 60_000
    assert delay_level_ms(16) == 1_800_000
    assert delay_level_ms(18) == 7_200_000
    for bad in (0, 19, -1, True, 1.0, "1"):
        with pytest.raises(ValueError, match="delay_level"):
            delay_level_ms(bad)  # type: ignore[arg-type]


def test_due_is_relative_to_the_append_time_or_absolute() -> None:
    assert Due(True, 1500).at(NOW) == NOW + 1500
    assert Due(False, NOW + 7).at(NOW + 1_000_000) == NOW + 7
    assert parse_due(dict([due_property(Due(True, 250))])) == Due(True, 250)
    assert parse_due(dict([due_property(Due(False, NOW))])) == Due(False, NOW)
    assert due_property(Due(True, 5)) == (DELAY, "5")
    assert due_property(Due(False, 5)) == (DELIVER_AT, "5")


@pytest.mark.parametrize("props", [
    {}, {DELAY: "1", DELIVER_AT: "2"}, {DELAY: "-1"}, {DELAY: "1.5"}, {DELAY: " 1"},
    {DELAY: "1_000"}, {DELIVER_AT: "x"}, {DELAY: "\uff19"}, {DELAY: "9" * 19}, {DELAY: ""},
])
def test_malformed_due_properties_are_refused(props: dict[str, str]) -> None:
    with pytest.raises(InvalidRequestError):
        parse_due(props)


def _batch(props: list[dict[str, str]], attributes: int = ATTR_SCHEDULED) -> bytearray:
    return encode_batch([RecordInput(b"b", NOW, properties=encode_properties(p))
                         for p in props], attributes=attributes)


def test_read_due_times_of_a_batch() -> None:
    b = _batch([{DELAY: "10"}, {DELIVER_AT: str(NOW + 5)}, {DELAY: "0", "user": "x"}])
    h = decode_header(b)
    got = read_due_times(b, 0, h, max_delay_ms=DAY, now_ms=NOW)
    assert got == [(0, Due(True, 10)), (1, Due(False, NOW + 5)), (2, Due(True, 0))]


def test_a_delay_beyond_the_maximum_refuses_the_batch() -> None:
    b = _batch([{DELAY: "10"}, {DELAY: str(DAY + 1)}])
    with pytest.raises(InvalidRequestError, match="max_delay_ms"):
        read_due_times(b, 0, decode_header(b), max_delay_ms=DAY, now_ms=NOW)
    b = _batch([{DELIVER_AT: str(NOW + DAY + 1)}])
    with pytest.raises(InvalidRequestError, match="max_delay_ms"):
        read_due_times(b, 0, decode_header(b), max_delay_ms=DAY, now_ms=NOW)
    # a due time in the past is fine (due at once), and no check for batches already stored
    b = _batch([{DELIVER_AT: "0"}, {DELAY: str(10 * DAY)}])
    assert len(read_due_times(b, 0, decode_header(b), max_delay_ms=None, now_ms=NOW)) == 2


def test_a_record_without_a_due_time_refuses_the_batch() -> None:
    b = _batch([{DELAY: "10"}, {"user": "x"}])
    with pytest.raises(InvalidRequestError, match="exactly one"):
        read_due_times(b, 0, decode_header(b), max_delay_ms=DAY, now_ms=NOW)
    plain = _batch([{DELAY: "10"}], attributes=0)
    with pytest.raises(InvalidRequestError, match="not a scheduled batch"):
        read_due_times(plain, 0, decode_header(plain), max_delay_ms=DAY, now_ms=NOW)


def test_offset_deltas_follow_a_stamped_base_offset() -> None:
    b = _batch([{DELAY: "1"}, {DELAY: "2"}])
    b[0:8] = (1000).to_bytes(8, "little")  # base offset as stamped on disk
    got = read_due_times(b, 0, decode_header(b), max_delay_ms=None, now_ms=NOW)
    assert [d for d, _ in got] == [0, 1]


def test_copy_properties_drop_the_due_time_and_name_the_original() -> None:
    props = copy_properties({DELAY: "10", "k": "v"}, "ID", NOW)
    assert props == {"k": "v", SCHEDULED_ID: "ID", SCHEDULED_DUE: str(NOW)}


def _stored(props: list[dict[str, str]], attributes: int = 0) -> bytes:
    return bytes(encode_batch(
        [RecordInput(b"x", NOW, properties=encode_properties(p)) for p in props],
        attributes=attributes))


def test_a_cancel_record_is_refused_from_a_producer_and_skipped_in_a_stored_stored() -> None:
    batch = _stored([{DELAY: "10"}, cancel_properties("X" * 28)], ATTR_SCHEDULED)
    h = decode_header(batch)
    with pytest.raises(InvalidRequestError, match="written only by the broker"):
        read_due_times(batch, 0, h, max_delay_ms=DAY, now_ms=NOW)
    assert read_due_times(batch, 0, h, max_delay_ms=None, now_ms=NOW) == [(0, Due(True, 10))]


def test_marks_are_read_from_copies_and_cancel_records_only() -> None:
    copy = _stored([copy_properties({"u": "1"}, "A" * 28, NOW), {"u": "2"}])
    cancel = _stored([cancel_properties("B" * 28)], ATTR_SCHEDULED)
    original = _stored([{DELAY: "5", SCHEDULED_ID: "C" * 28}], ATTR_SCHEDULED)  # not a copy
    plain = _stored([{"u": "3"}])
    assert read_marks(copy, 0, decode_header(copy)) == [(FIRED_MARK, "A" * 28)]
    assert read_marks(cancel, 0, decode_header(cancel)) == [(CANCELLED_MARK, "B" * 28)]
    assert read_marks(original, 0, decode_header(original)) == []
    assert read_marks(plain, 0, decode_header(plain)) == []
    both = plain + copy  # the second batch of a buffer
    assert read_marks(both, len(plain), decode_header(copy)) == [(FIRED_MARK, "A" * 28)]
