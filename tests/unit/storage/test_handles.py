"""The descriptor cache (storage/handles.py) alone and under the logs that share it: at most
``capacity`` descriptors open, nothing unsynced or pinned ever closed, EMFILE shed."""

from __future__ import annotations

import errno
import os
import random
import threading
from pathlib import Path

import pytest
from storage_support import build_batch

import ferrymq.storage.handles as handles_module
from ferrymq.errors import LogClosedError
from ferrymq.protocol.records import decode_records
from ferrymq.storage import Log, LogConfig
from ferrymq.storage.handles import FileHandle, FileHandles

RW = os.O_RDWR | os.O_APPEND


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def files(tmp_path: Path, n: int) -> list[Path]:
    paths = []
    for i in range(n):
        p = tmp_path / f"f{i}"
        p.write_bytes(f"file {i}".encode())
        paths.append(p)
    return paths


def read_all(h: FileHandle) -> bytes:
    return os.pread(h.get(), 100, 0)


def test_at_most_capacity_descriptors_are_open(tmp_path: Path) -> None:
    cache = FileHandles(3)
    handles = [cache.register(p, RW) for p in files(tmp_path, 10)]
    assert cache.open_count == 0  # registering opens nothing
    before = open_fds()
    for _ in range(3):
        for i, h in enumerate(handles):
            assert read_all(h) == f"file {i}".encode()
            assert cache.open_count <= 3
    assert open_fds() - before <= 3
    assert cache.opens == 30 and cache.evictions == 27  # round robin over 10: LRU misses each


def test_the_least_recently_used_goes_first(tmp_path: Path) -> None:
    cache = FileHandles(2)
    a, b, c = (cache.register(p, RW) for p in files(tmp_path, 3))
    a.get()
    b.get()
    a.get()  # a is now the most recently used
    c.get()
    assert a.fd is not None and b.fd is None and c.fd is not None


def test_unsynced_and_pinned_handles_stay_open(tmp_path: Path) -> None:
    cache = FileHandles(1)
    a, b, c = (cache.register(p, RW) for p in files(tmp_path, 3))
    os.write(a.get(), b"more")
    a.wrote()
    b.get()
    assert a.fd is not None and a.dirty  # over capacity rather than closing unsynced writes
    pinned = b.pin()
    assert pinned is not None
    c.get()
    assert b.fd is not None  # pinned: another thread may be fsyncing it
    b.unpin()
    a.fsync()
    assert not a.dirty
    c.get()
    d = cache.register(tmp_path / "f0", RW)
    d.get()
    assert a.fd is None and b.fd is None and cache.open_count <= 2


def test_a_closed_handle_needs_no_fsync_and_a_pin_finds_nothing(tmp_path: Path) -> None:
    cache = FileHandles(1)
    a, b = (cache.register(p, RW) for p in files(tmp_path, 2))
    a.get()
    b.get()
    assert a.fd is None
    assert a.pin() is None
    a.fsync()  # nothing written since its last fsync: nothing to do
    assert a.fd is None


def test_an_fsync_covers_only_writes_counted_before_it_pinned(tmp_path: Path) -> None:
    cache = FileHandles(4)
    (a,) = (cache.register(p, RW) for p in files(tmp_path, 1))
    a.get()
    a.wrote()
    pinned = a.pin()
    assert pinned is not None
    a.wrote()  # a write while the fsync runs: not covered
    os.fsync(pinned[0])
    a.unpin(pinned[1])
    assert a.dirty
    a.fsync()
    assert not a.dirty


def test_a_failed_fsync_leaves_the_handle_dirty(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cache = FileHandles(1)
    a, b = (cache.register(p, RW) for p in files(tmp_path, 2))
    a.get()
    a.wrote()

    def eio(fd: int) -> None:  # injected fault
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(handles_module.os, "fsync", eio)
    with pytest.raises(OSError, match="Input/output"):
        a.fsync()
    monkeypatch.undo()
    b.get()
    assert a.fd is not None and a.dirty


def test_closing_for_good(tmp_path: Path) -> None:
    cache = FileHandles(4)
    a, b = (cache.register(p, RW) for p in files(tmp_path, 2))
    fd = a.get()
    a.close()
    a.close()  # idempotent
    with pytest.raises(LogClosedError):
        a.get()
    with pytest.raises(OSError, match="Bad file"):
        os.fstat(fd)
    b.get()
    pinned = b.pin()
    assert pinned is not None
    b.close()  # pinned: the last unpin closes it
    os.fstat(pinned[0])
    b.unpin()
    assert b.fd is None and cache.open_count == 0


def test_emfile_sheds_idle_descriptors_and_retries_once(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    cache = FileHandles(100)
    handles = [cache.register(p, RW) for p in files(tmp_path, 5)]
    for h in handles[:4]:
        h.get()
    real_open = os.open
    failures = [1]

    def emfile_once(path: Path, flags: int, mode: int = 0o777) -> int:  # injected fault
        if failures[0]:
            failures[0] -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, mode)

    monkeypatch.setattr(handles_module.os, "open", emfile_once)
    assert read_all(handles[4]) == b"file 4"
    assert cache.evictions == 4 and cache.open_count == 1


def test_emfile_with_nothing_to_shed_reaches_the_caller(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    cache = FileHandles(100)
    a, b = (cache.register(p, RW) for p in files(tmp_path, 2))
    a.get()
    a.wrote()  # unsynced: not shed

    def emfile(path: Path, flags: int, mode: int = 0o777) -> int:  # injected fault
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(handles_module.os, "open", emfile)
    with pytest.raises(OSError) as info:
        b.get()
    assert info.value.errno == errno.EMFILE
    assert a.fd is not None and b.fd is None and cache.open_count == 1
    monkeypatch.undo()
    assert read_all(b) == b"file 1"  # descriptors back: works again, nothing to undo


# --- logs sharing one cache -------------------------------------------------------------------


def test_many_logs_share_a_few_descriptors(tmp_path: Path) -> None:
    cache = FileHandles(4)
    config = LogConfig(segment_bytes=400)
    before = open_fds()
    logs = [Log.open(tmp_path / f"q{i}", config, clean_shutdown=False, now_ms=0, handles=cache)[0]
            for i in range(30)]
    rng = random.Random(7)
    sent: dict[int, int] = dict.fromkeys(range(30), 0)
    peak = 0
    for step in range(600):
        i = rng.randrange(30)
        logs[i].append(build_batch(1, b"x" * 60), now_ms=step)
        sent[i] += 1
        if step % 7 == 0:
            j = rng.randrange(30)
            assert len(decode_records(logs[j].read(0, 10**6))) >= min(sent[j], 1)
        if step % 5 == 0:
            logs[rng.randrange(30)].flush()
        unsynced = sum(1 for lg in logs for s in lg._segments if s.file and s.file.dirty)
        peak = max(peak, unsynced)
        assert open_fds() - before == cache.open_count  # every descriptor is the cache's
        assert cache.open_count <= max(4, peak + 2)  # over it: unsynced + a roll + a read
    for lg in logs:
        lg.flush()
    cache.trim()
    assert cache.open_count <= 4 and open_fds() - before <= 4
    for lg in logs:
        lg.read(lg.start_offset, 100)
        assert cache.open_count <= 4
    assert cache.evictions > 0
    for i, lg in enumerate(logs):
        assert len(lg.segments()) > 1 or sent[i] < 6
        got = [r.offset for b in iter_batches(lg) for r in decode_records(b)]
        assert got == list(range(sent[i]))
        lg.close()
    assert open_fds() == before
    for i in range(30):  # everything written through reopened descriptors is there
        lg, report = Log.open(tmp_path / f"q{i}", config, clean_shutdown=True, now_ms=0,
                              handles=cache)
        assert (report.truncated_bytes, lg.end_offset) == (0, sent[i])
        lg.close()


def iter_batches(log: Log) -> list[bytes]:
    out, offset = [], log.start_offset
    while offset < log.end_offset:
        data = log.read(offset, 10**6)
        out.append(data)
        offset = list(decode_records(data))[-1].offset + 1
    return out


def test_unclean_recovery_keeps_what_it_scanned_open_until_fsynced(tmp_path: Path) -> None:
    cache = FileHandles(1)
    config = LogConfig(segment_bytes=300)
    for i in range(3):
        lg, _ = Log.open(tmp_path / f"q{i}", config, clean_shutdown=False, now_ms=0)
        for t in range(8):
            lg.append(build_batch(1, b"y" * 60), now_ms=t)
        for seg in lg._segments:  # kill -9: no flush, no close
            seg.close()
    logs = [Log.open(tmp_path / f"q{i}", config, clean_shutdown=False, now_ms=0, handles=cache)[0]
            for i in range(3)]
    for lg in logs:
        assert all(not s.file.dirty for s in lg._segments if s.file is not None)  # fsynced
        assert lg.end_offset == 8
        lg.close()


def test_the_flusher_thread_never_fsyncs_a_closed_or_reused_descriptor(tmp_path: Path) -> None:
    """The owner appends and reads 20 logs through a cache of 2 while another thread flushes
    them: every flush either pins an open descriptor or finds a clean closed one."""
    cache = FileHandles(2)
    logs = [Log.open(tmp_path / f"q{i}", LogConfig(segment_bytes=2000), clean_shutdown=False,
                     now_ms=0, handles=cache)[0] for i in range(20)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def flusher() -> None:
        while not stop.is_set():
            for lg in logs:
                try:
                    target = lg.flush_begin()
                    if target is None:
                        lg.flush()
                        continue
                    fd, end = target
                    ok = False
                    try:
                        os.fsync(fd)
                        ok = True
                    finally:
                        lg.flush_end(end, ok)
                except BaseException as exc:  # reported below
                    errors.append(exc)
                    return

    t = threading.Thread(target=flusher)
    t.start()
    try:
        rng = random.Random(3)
        for step in range(3000):
            lg = logs[rng.randrange(20)]
            lg.append(build_batch(1, b"z" * 40), now_ms=step)
            if step % 3 == 0:
                other = logs[rng.randrange(20)]
                if other.end_offset:
                    other.read(rng.randrange(other.end_offset), 500)
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    for lg in logs:
        assert lg.flush() == lg.end_offset
        lg.close()
