"""A delivery group's state as records of its retry queue (a cluster): what a new coordinator
replays (:func:`~ferrymq.broker.delivery.logstore.read_state`) from a real log holding state
records between letters."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrymq.broker.delivery.logstore import read_state, state_batch
from ferrymq.broker.topics import QueueState, TopicRegistry
from ferrymq.protocol.records import RecordInput, encode_batch
from ferrymq.storage import LogConfig

T0 = 1_700_000_000_000


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[QueueState]:
    reg = TopicRegistry(tmp_path, LogConfig(retention_ms=None), sync_visibility=True,
                        clean_shutdown=False, max_queues=8)
    reg.open_all(T0)
    try:
        yield reg.create("%RETRY%g", 1, {}, T0, internal_ok=True).queues[0]
    finally:
        reg.close()


def _state(qs: QueueState, body: dict[str, object]) -> None:
    qs.log.append(state_batch(body, T0), now_ms=T0)


def _letter(qs: QueueState) -> None:
    qs.log.append(encode_batch([RecordInput(b"a letter", T0)]), now_ms=T0)


def test_an_empty_queue_holds_no_group(queue: QueueState) -> None:
    st = read_state(queue)
    assert (st.snapshot, st.records, st.found, st.deleted) == (None, [], False, False)


def test_the_last_snapshot_and_the_records_after_it_are_replayed(queue: QueueState) -> None:
    _state(queue, {"j": 0, "r": ["P", [0], 3, -2, False, False]})
    _letter(queue)
    _state(queue, {"j": 0, "r": ["A", "t", 0, [[5, 1]]]})
    _state(queue, {"s": 1, "snap": {"policy": 1}})
    _letter(queue)
    _state(queue, {"j": 1, "r": ["A", "t", 0, [[6, 1]]]})
    st = read_state(queue)
    assert st.snapshot == {"policy": 1}
    assert st.records == [["A", "t", 0, [[6, 1]]]]
    assert (st.gen, st.found, st.deleted) == (1, True, False)
    assert st.size > 0  # the record after the snapshot


def test_a_delete_ends_the_group_and_a_later_record_starts_a_new_one(
        queue: QueueState) -> None:
    _state(queue, {"s": 1, "snap": {"old": 1}})
    _state(queue, {"x": 1})
    st = read_state(queue)
    assert (st.snapshot, st.records, st.found, st.deleted) == (None, [], False, True)
    _state(queue, {"j": 0, "r": ["P", [0], 3, -2, False, False]})
    st = read_state(queue)
    assert (st.snapshot, st.found, st.deleted) == (None, True, False)
    assert st.records == [["P", [0], 3, -2, False, False]]
