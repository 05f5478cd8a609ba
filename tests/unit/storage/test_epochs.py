"""The leader epoch cache: its file, each method's edges, the truncation rule (KIP-101/279)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from ferrymq.errors import CorruptRecordError, LeaderEpochOrderError
from ferrymq.storage import epochs as epochs_module
from ferrymq.storage.checkpoint import read_checkpoint, write_checkpoint
from ferrymq.storage.epochs import NO_EPOCH, NO_OFFSET, LeaderEpochCache, epoch_in
from ferrymq.storage.files import LEADER_EPOCHS_FILE


def _cache(tmp_path: Path, *entries: tuple[int, int]) -> LeaderEpochCache:
    cache = LeaderEpochCache.open(tmp_path)
    for epoch, start in entries:
        assert cache.assign(epoch, start)
    return cache


def _on_disk(tmp_path: Path) -> list[tuple[int, int]]:
    return LeaderEpochCache.open(tmp_path).entries()


# --- the file ---------------------------------------------------------------------------------


def test_a_missing_file_is_an_empty_cache_and_reading_writes_nothing(tmp_path: Path) -> None:
    cache = LeaderEpochCache.open(tmp_path)
    assert cache.entries() == []
    assert cache.latest() is None
    assert cache.latest_epoch() == NO_EPOCH
    assert cache.epoch_at(0) == NO_EPOCH
    assert cache.end_offset_for(3, 10) == (NO_EPOCH, NO_OFFSET)
    assert cache.entries_from(0) == []
    assert not cache.truncate_from_end(0)
    assert not cache.truncate_from_start(5)
    assert list(tmp_path.iterdir()) == []


def test_entries_round_trip_through_the_file(tmp_path: Path) -> None:
    cache = _cache(tmp_path, (0, 0), (2, 10), (5, 30))
    assert cache.path == tmp_path / LEADER_EPOCHS_FILE
    assert _on_disk(tmp_path) == [(0, 0), (2, 10), (5, 30)]
    payload = read_checkpoint(cache.path)  # a checksummed checkpoint: version, then <qq pairs
    assert payload == struct.pack("<Iqqqqqq", 1, 0, 0, 2, 10, 5, 30)
    assert not list(tmp_path.glob("*.tmp"))


def test_every_change_is_on_disk_when_the_method_returns(tmp_path: Path) -> None:
    cache = _cache(tmp_path, (1, 0), (2, 10), (4, 20))
    cache.truncate_from_end(20)
    assert _on_disk(tmp_path) == [(1, 0), (2, 10)]
    cache.truncate_from_start(5)
    assert _on_disk(tmp_path) == [(1, 5), (2, 10)]
    cache.assign(7, 12)
    assert _on_disk(tmp_path) == [(1, 5), (2, 10), (7, 12)]
    cache.truncate_from_end(0)
    assert _on_disk(tmp_path) == []


def _write_payload(tmp_path: Path, payload: bytes) -> None:
    write_checkpoint(tmp_path / LEADER_EPOCHS_FILE, payload)


@pytest.mark.parametrize(
    ("payload", "says"),
    [
        (struct.pack("<Iqq", 1, 0, 0) + b"\x00", "not a version and whole 16-byte entries"),
        (b"\x01\x00", "not a version and whole"),
        (struct.pack("<Iqq", 2, 0, 0), "unknown version 2"),
        (struct.pack("<Iqqqq", 1, 3, 0, 2, 10), "entry (epoch 2, start 10) after (epoch 3"),
        (struct.pack("<Iqqqq", 1, 3, 10, 4, 10), "entry (epoch 4, start 10)"),
        (struct.pack("<Iqqqq", 1, 3, 10, 3, 12), "entry (epoch 3, start 12)"),
        (struct.pack("<Iqq", 1, -2, 0), "must be >= 0"),
        (struct.pack("<Iqq", 1, 0, -5), "must be >= 0"),
    ],
)
def test_a_bad_payload_is_refused_naming_the_file(tmp_path: Path, payload: bytes, says: str) -> None:
    _write_payload(tmp_path, payload)
    with pytest.raises(CorruptRecordError, match=LEADER_EPOCHS_FILE) as exc:
        LeaderEpochCache.open(tmp_path)
    assert says in str(exc.value)


def test_a_flipped_bit_is_refused_and_the_file_is_left_alone(tmp_path: Path) -> None:
    _cache(tmp_path, (0, 0), (1, 100))
    path = tmp_path / LEADER_EPOCHS_FILE
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(data)
    with pytest.raises(CorruptRecordError, match="CRC mismatch"):
        LeaderEpochCache.open(tmp_path)
    assert path.read_bytes() == data


def test_an_empty_entry_list_is_a_valid_file(tmp_path: Path) -> None:
    _write_payload(tmp_path, struct.pack("<I", 1))
    assert LeaderEpochCache.open(tmp_path).entries() == []


# --- assign -----------------------------------------------------------------------------------


def test_assign_appends_newer_epochs(tmp_path: Path) -> None:
    cache = _cache(tmp_path, (0, 0))
    assert cache.assign(3, 0 + 7)
    assert cache.latest() == (3, 7)
    assert cache.entries() == [(0, 0), (3, 7)]


def test_assign_of_the_latest_epoch_is_a_no_op(tmp_path: Path) -> None:
    cache = _cache(tmp_path, (0, 0), (2, 10))
    mtime = cache.path.stat().st_mtime_ns
    assert not cache.assign(2, 10)
    assert not cache.assign(2, 15)  # a follower copying its second batch of epoch 2
    assert cache.entries() == [(0, 0), (2, 10)]
    assert cache.path.stat().st_mtime_ns == mtime


def test_a_newer_epoch_at_the_same_start_replaces_the_latest(tmp_path: Path) -> None:
    """Kafka's rule: the replaced epoch wrote nothing."""
    cache = _cache(tmp_path, (0, 0), (2, 10))
    assert cache.assign(3, 10)
    assert cache.entries() == [(0, 0), (3, 10)]
    assert _on_disk(tmp_path) == [(0, 0), (3, 10)]


@pytest.mark.parametrize(
    ("epoch", "start", "says"),
    [
        (1, 20, "epochs only grow"),
        (3, 5, "start offsets only grow"),
        (2, 5, "start offsets only grow"),  # the latest epoch cannot start earlier
        (-1, 20, "negative epoch or offset"),
        (3, -1, "negative epoch or offset"),
    ],
)
def test_assign_refuses_what_breaks_the_order_and_changes_nothing(
    tmp_path: Path, epoch: int, start: int, says: str
) -> None:
    cache = _cache(tmp_path, (0, 0), (2, 10))
    with pytest.raises(LeaderEpochOrderError, match=says) as exc:
        cache.assign(epoch, start)
    assert (exc.value.epoch, exc.value.start_offset, exc.value.latest) == (epoch, start, (2, 10))
    assert "latest: epoch 2 from offset 10" in str(exc.value)
    assert cache.entries() == [(0, 0), (2, 10)]
    assert _on_disk(tmp_path) == [(0, 0), (2, 10)]


def test_assign_on_an_empty_cache_takes_any_start(tmp_path: Path) -> None:
    cache = _cache(tmp_path)
    assert cache.assign(4, 1000)
    assert cache.entries() == [(4, 1000)]
    empty = _cache(tmp_path / "other")
    with pytest.raises(LeaderEpochOrderError, match="latest: none"):
        empty.assign(-1, 0)


def test_a_failed_write_leaves_the_cache_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = _cache(tmp_path, (0, 0), (2, 10))

    def disk_full(path: Path, payload: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(epochs_module, "write_checkpoint", disk_full)
    for change in (lambda: cache.assign(3, 20), lambda: cache.truncate_from_end(5),
                   lambda: cache.truncate_from_start(12)):
        with pytest.raises(OSError, match="No space"):
            change()
        assert cache.entries() == [(0, 0), (2, 10)]
    monkeypatch.undo()
    assert _on_disk(tmp_path) == [(0, 0), (2, 10)]


# --- queries ----------------------------------------------------------------------------------


def test_epoch_at(tmp_path: Path) -> None:
    cache = _cache(tmp_path, (1, 5), (2, 10), (6, 30))
    assert [cache.epoch_at(o) for o in (0, 4, 5, 9, 10, 29, 30, 500)] == [
        NO_EPOCH, NO_EPOCH, 1, 1, 2, 2, 6, 6]
    assert epoch_in(cache.entries_from(12), 12) == 2
    assert epoch_in([], 3) == NO_EPOCH


@pytest.mark.parametrize(
    ("asked", "answer"),
    [
        (-1, (NO_EPOCH, NO_OFFSET)),
        (0, (NO_EPOCH, NO_OFFSET)),  # older than anything known here
        (1, (1, 10)),  # ends where epoch 2 starts
        (2, (2, 30)),
        (4, (2, 30)),  # unknown here: the largest known below it
        (6, (6, 45)),  # the latest ends at the log end
        (9, (6, 45)),  # newer than anything known (a stale leader asked)
    ],
)
def test_end_offset_for(tmp_path: Path, asked: int, answer: tuple[int, int]) -> None:
    cache = _cache(tmp_path, (1, 5), (2, 10), (6, 30))
    assert cache.end_offset_for(asked, 45) == answer


def test_end_offset_for_an_epoch_that_wrote_nothing_yet(tmp_path: Path) -> None:
    cache = _cache(tmp_path, (1, 0), (2, 45))  # a leader that took over at 45
    assert cache.end_offset_for(1, 45) == (1, 45)
    assert cache.end_offset_for(2, 45) == (2, 45)


@pytest.mark.parametrize(
    ("offset", "expected"),
    [
        (0, [(1, 5), (2, 10), (6, 30)]),  # below the first start: all
        (5, [(1, 5), (2, 10), (6, 30)]),
        (10, [(2, 10), (6, 30)]),
        (17, [(2, 10), (6, 30)]),
        (30, [(6, 30)]),
        (99, [(6, 30)]),
    ],
)
def test_entries_from(tmp_path: Path, offset: int, expected: list[tuple[int, int]]) -> None:
    cache = _cache(tmp_path, (1, 5), (2, 10), (6, 30))
    assert cache.entries_from(offset) == expected


# --- truncation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("end", "expected", "changed"),
    [
        (99, [(1, 5), (2, 10), (6, 30)], False),
        (31, [(1, 5), (2, 10), (6, 30)], False),
        (30, [(1, 5), (2, 10)], True),  # an entry starting at the end goes
        (11, [(1, 5), (2, 10)], True),
        (10, [(1, 5)], True),
        (5, [], True),
        (0, [], True),
    ],
)
def test_truncate_from_end(
    tmp_path: Path, end: int, expected: list[tuple[int, int]], changed: bool
) -> None:
    cache = _cache(tmp_path, (1, 5), (2, 10), (6, 30))
    assert cache.truncate_from_end(end) is changed
    assert cache.entries() == expected
    assert _on_disk(tmp_path) == expected


@pytest.mark.parametrize(
    ("start", "expected", "changed"),
    [
        (0, [(1, 5), (2, 10), (6, 30)], False),
        (5, [(1, 5), (2, 10), (6, 30)], False),
        (7, [(1, 7), (2, 10), (6, 30)], True),
        (10, [(2, 10), (6, 30)], True),
        (12, [(2, 12), (6, 30)], True),
        (30, [(6, 30)], True),
        (90, [(6, 90)], True),  # the latest epoch is never dropped, only clamped
    ],
)
def test_truncate_from_start(
    tmp_path: Path, start: int, expected: list[tuple[int, int]], changed: bool
) -> None:
    cache = _cache(tmp_path, (1, 5), (2, 10), (6, 30))
    assert cache.truncate_from_start(start) is changed
    assert cache.entries() == expected
    assert _on_disk(tmp_path) == expected


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ((NO_EPOCH, NO_OFFSET), (3, True)),  # the leader knows nothing up to our epoch
        ((6, 50), (42, True)),  # same latest epoch: the shorter log wins
        ((6, 36), (36, True)),
        ((2, 20), (20, True)),  # the leader's epoch 2 ended at 20, ours at 30
        ((2, 35), (30, True)),  # ours ended first
        ((4, 33), (30, False)),  # epoch 4 is unknown here: cut to the end of 2, ask again
        ((0, 9), (3, True)),  # we know no epoch up to 0: nothing is known to match
    ],
)
def test_truncation_point(
    tmp_path: Path, answer: tuple[int, int], expected: tuple[int, bool]
) -> None:
    cache = _cache(tmp_path, (1, 5), (2, 10), (6, 30))
    assert cache.truncation_point(answer, 3, 42) == expected
