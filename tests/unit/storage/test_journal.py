"""The CRC journal: replay, torn tails, durability positions."""

from __future__ import annotations

import struct
import threading
from pathlib import Path

import pytest

from ferrymq.errors import LogClosedError
from ferrymq.storage.journal import MAX_JOURNAL_RECORD_BYTES, Journal


def test_append_replay_round_trip(tmp_path: Path) -> None:
    j, recs = Journal.open(tmp_path / "j")
    assert recs == []
    ends = [j.append(["A", "t", i, [[i, 1]]]) for i in range(100)]
    assert ends == sorted(ends) and ends[-1] == j.size
    assert j.flush() == j.size == j.durable
    j.close()
    j2, recs = Journal.open(tmp_path / "j")
    assert recs == [["A", "t", i, [[i, 1]]] for i in range(100)]
    assert j2.size == ends[-1] and j2.dropped_bytes == 0
    j2.close()


@pytest.mark.parametrize("cut", [1, 4, 7, 8, 9, 12])
def test_torn_tail_is_truncated_and_reported(tmp_path: Path, cut: int) -> None:
    p = tmp_path / "j"
    j, _ = Journal.open(p)
    j.append(["first"])
    keep = j.append(["second", "x" * 30])
    j.close()
    data = p.read_bytes()
    p.write_bytes(data + data[:cut])  # a third record cut short (a crash during write(2))
    j, recs = Journal.open(p)
    assert recs == [["first"], ["second", "x" * 30]]
    assert j.dropped_bytes == cut and p.stat().st_size == keep
    j.append(["third"])
    j.close()
    _, recs = Journal.open(p)
    assert recs[-1] == ["third"] and len(recs) == 3


def test_bit_flip_ends_the_journal_there(tmp_path: Path) -> None:
    p = tmp_path / "j"
    j, _ = Journal.open(p)
    a = j.append(["one"])
    j.append(["two"])
    j.close()
    raw = bytearray(p.read_bytes())
    raw[a + 9] ^= 0x01  # inside the second record's payload
    p.write_bytes(bytes(raw))
    j, recs = Journal.open(p)
    assert recs == [["one"]] and j.dropped_bytes == len(raw) - a
    j.close()


def test_giant_length_is_not_believed(tmp_path: Path) -> None:
    p = tmp_path / "j"
    p.write_bytes(struct.pack("<II", MAX_JOURNAL_RECORD_BYTES + 1, 0) + b"x" * 16)
    j, recs = Journal.open(p)
    assert recs == [] and j.dropped_bytes == 24
    j.close()


def test_closed_journal_refuses_appends(tmp_path: Path) -> None:
    j, _ = Journal.open(tmp_path / "j")
    j.close()
    j.close()  # idempotent
    with pytest.raises(LogClosedError):
        j.append(["x"])


def test_flush_from_another_thread_while_appending(tmp_path: Path) -> None:
    j, _ = Journal.open(tmp_path / "j")
    stop = threading.Event()
    durable: list[int] = []

    def flusher() -> None:
        while not stop.is_set():
            durable.append(j.flush())

    t = threading.Thread(target=flusher)
    t.start()
    for i in range(2000):
        j.append([i])
    stop.set()
    t.join()
    assert durable == sorted(durable) and max(durable) <= j.size
    assert j.flush() == j.size
    j.close()
    _, recs = Journal.open(tmp_path / "j")
    assert recs == [[i] for i in range(2000)]
