"""File naming, atomic writes and checksummed checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrymq.errors import CorruptRecordError, StorageError
from ferrymq.storage import atomic_write, read_checkpoint, write_checkpoint
from ferrymq.storage.files import (
    fsync_directory,
    fsync_file,
    parse_base_offset,
    segment_file_name,
)


def test_segment_file_name_is_20_digits_and_sorts() -> None:
    assert segment_file_name(42, ".log") == "00000000000000000042.log"
    names = [segment_file_name(b, ".log") for b in (10, 9, 100, 0)]
    assert sorted(names) == [segment_file_name(b, ".log") for b in (0, 9, 10, 100)]
    with pytest.raises(ValueError):
        segment_file_name(-1, ".log")


@pytest.mark.parametrize("suffix", [".log", ".index", ".timeindex", ".snapshot"])
def test_parse_base_offset_round_trips(suffix: str) -> None:
    assert parse_base_offset(segment_file_name(123456789, suffix)) == 123456789


@pytest.mark.parametrize(
    "name", ["foo.log", "123.log", "00000000000000000042.log.tmp", "0000000000000000004x.log"]
)
def test_parse_base_offset_rejects_other_names(name: str) -> None:
    assert parse_base_offset(name) is None


def test_atomic_write_replaces_and_leaves_no_tmp(tmp_path: Path) -> None:
    path = tmp_path / "state"
    atomic_write(path, b"one")
    atomic_write(path, b"two")
    assert path.read_bytes() == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["state"]


def test_atomic_write_creates_with_the_mode_given(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    atomic_write(path, b"one", mode=0o600)
    assert path.stat().st_mode & 0o777 == 0o600


def test_fsync_by_path_opens_its_own_descriptor(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x")
    fsync_file(f)
    fsync_directory(tmp_path)
    with pytest.raises(FileNotFoundError):
        fsync_file(tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        fsync_directory(tmp_path / "missing")
    with pytest.raises(NotADirectoryError):
        fsync_directory(f)  # O_DIRECTORY: a file is refused, not fsynced as a directory


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "offsets.checkpoint"
    assert read_checkpoint(path) is None
    write_checkpoint(path, b"payload \x00\xff")
    assert read_checkpoint(path) == b"payload \x00\xff"
    write_checkpoint(path, b"")
    assert read_checkpoint(path) == b""


def test_checkpoint_detects_every_single_bit_flip(tmp_path: Path) -> None:
    path = tmp_path / "c"
    write_checkpoint(path, b"some state")
    good = path.read_bytes()
    for bit in range(len(good) * 8):
        bad = bytearray(good)
        bad[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bad)
        if bit // 8 in (6, 7):  # the reserved field is not checked
            continue
        with pytest.raises(CorruptRecordError):
            read_checkpoint(path)


@pytest.mark.parametrize("cut", [0, 3, 15, 16, 20])
def test_checkpoint_detects_truncation(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "c"
    write_checkpoint(path, b"some state")
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(StorageError, match="checkpoint"):
        read_checkpoint(path)


def test_checkpoint_detects_trailing_garbage(tmp_path: Path) -> None:
    path = tmp_path / "c"
    write_checkpoint(path, b"some state")
    path.write_bytes(path.read_bytes() + b"x")
    with pytest.raises(CorruptRecordError, match="payload"):
        read_checkpoint(path)
