"""The hand-written Fetch response against kio, the reference generated from Kafka's own
schemas: the pieces joined are kio's bytes for every version served, and the records are
passed through, not copied."""

from __future__ import annotations

import datetime

from hypothesis import given, settings
from hypothesis import strategies as st
from kio.schema.errors import ErrorCode as KafkaError

from ferrymq.protocol.kafka import apis
from ferrymq.protocol.kafka import fetch_codec as fc

VERSIONS = range(fc.MIN_VERSION, fc.MAX_VERSION + 1)
NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
OFFSETS = st.integers(-1, 2**62)
PARTITIONS = st.lists(st.tuples(
    st.integers(0, 2**31 - 1), st.sampled_from([0, 1, 3, 6, 74]), OFFSETS, OFFSETS, OFFSETS,
    st.one_of(st.none(), st.lists(st.tuples(st.integers(0, 2**62), OFFSETS), max_size=3)),
    st.lists(st.binary(min_size=1, max_size=50), max_size=3)), max_size=4)


def test_the_versions_are_the_ones_served() -> None:
    assert apis.SUPPORTED[apis.FETCH] == (fc.MIN_VERSION, fc.MAX_VERSION)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(VERSIONS), st.lists(st.tuples(NAMES, PARTITIONS), max_size=3),
       st.integers(0, 10_000))
def test_responses_are_kios_bytes_in_pieces(version: int, topics: list[tuple[str, list[
        tuple[int, int, int, int, int, list[tuple[int, int]] | None, list[bytes]]]]],
                                            throttle_ms: int) -> None:
    cls = apis.response_class(apis.FETCH, version)
    assert cls is not None
    expected = apis.encode(apis.build(cls, {
        "throttle_time": datetime.timedelta(milliseconds=throttle_ms),
        "error_code": KafkaError.none, "session_id": 0,
        "responses": [{"topic": name, "partitions": [{
            "partition_index": q, "error_code": KafkaError(e), "high_watermark": hw,
            "last_stable_offset": lso, "log_start_offset": start,
            "aborted_transactions": None if aborted is None else [
                {"producer_id": pid, "first_offset": first} for pid, first in aborted],
            "preferred_read_replica": -1, "records": b"".join(records)}
            for q, e, hw, lso, start, aborted, records in parts]} for name, parts in topics]}))
    pieces = fc.encode_response(version, [(name, [
        fc.PartitionFetch(q, e, hw, lso, start, aborted, [memoryview(r) for r in records])
        for q, e, hw, lso, start, aborted, records in parts]) for name, parts in topics],
        throttle_ms=throttle_ms)
    assert b"".join(pieces) == expected
    views = [p for p in pieces if isinstance(p, memoryview)]
    assert len(views) == sum(len(r) for _n, parts in topics for *_x, r in parts)
