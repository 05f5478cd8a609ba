"""The CRC journal: replay, torn tails, durability positions, descriptors in a shared cache."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import struct
import threading
from pathlib import Path

import pytest

from ferrymq.errors import LogClosedError
from ferrymq.storage.handles import FileHandles
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


# --- descriptors: journals share a bounded cache -------------------------------------------------


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_idle_journals_hold_no_descriptor(tmp_path: Path) -> None:
    """Fifty journals in a cache of four: once flushed, at most four are open; each reopens
    on its next append and replays everything."""
    cache = FileHandles(4)
    before = _fds()
    journals = [Journal.open(tmp_path / f"j{i}", cache)[0] for i in range(50)]
    for i, j in enumerate(journals):
        j.append(["first", i])
        assert j.flush() == j.size == j.durable  # fsynced: evictable
    cache.trim()
    assert cache.open_count <= 4 and _fds() - before <= 4
    assert sum(j.is_open for j in journals) <= 4
    for i, j in enumerate(journals):  # every one reopens on use
        j.append(["second", i])
        assert cache.open_count <= 5  # soft: unsynced ones stay open until fsynced
        j.flush()
    for j in journals:
        j.close()
    assert cache.open_count == 0 and _fds() == before
    for i in range(50):
        _, recs = Journal.open(tmp_path / f"j{i}")
        assert recs == [["first", i], ["second", i]]


def test_a_journal_with_unsynced_appends_is_never_closed(tmp_path: Path) -> None:
    cache = FileHandles(1)
    a, _ = Journal.open(tmp_path / "a", cache)
    a.append(["not yet durable"])
    b, _ = Journal.open(tmp_path / "b", cache)  # the cache is over its capacity: a is dirty
    b.append(["b"])
    assert a.is_open and b.is_open
    assert a.flush() == a.size  # through the descriptor the append went through
    b.flush()
    cache.trim()
    assert cache.open_count == 1
    closed = a if not a.is_open else b
    assert closed.flush() == closed.size  # closed means clean: nothing to fsync
    a.close()
    b.close()


def test_hold_keeps_the_descriptor_while_others_open(tmp_path: Path) -> None:
    cache = FileHandles(1)
    held, _ = Journal.open(tmp_path / "held", cache)
    held.flush()
    held.hold()
    others = [Journal.open(tmp_path / f"o{i}", cache)[0] for i in range(5)]
    for o in others:
        o.flush()
    cache.trim()
    assert held.is_open  # pinned: not evicted to make room
    held.append(["kept open"])
    held.release()
    held.flush()
    cache.trim()
    for j in [held, *others]:
        j.close()
    _, recs = Journal.open(tmp_path / "held")
    assert recs == [["kept open"]]


def test_append_without_a_descriptor_writes_nothing(tmp_path: Path) -> None:
    """EMFILE when the journal must be reopened (and the cache has nothing to shed): OSError,
    nothing written; it works again once a descriptor is free."""
    cache = FileHandles(1)
    j, _ = Journal.open(tmp_path / "j", cache)
    j.append(["one"])
    j.flush()
    other, _ = Journal.open(tmp_path / "other", cache)  # evicts j (clean)
    other.flush()
    assert not j.is_open and other.is_open
    other.hold()  # nothing the cache could shed to make room
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hog: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (_fds() + 8, hard))
    try:
        with contextlib.suppress(OSError):
            while True:
                hog.append(os.open(os.devnull, os.O_RDONLY))
        size = j.size
        with pytest.raises(OSError) as info:
            j.append(["lost"])
        assert info.value.errno == errno.EMFILE and j.size == size
    finally:
        for fd in hog:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    other.release()
    j.append(["two"])
    j.close()
    other.close()
    _, recs = Journal.open(j.path)
    assert recs == [["one"], ["two"]]
