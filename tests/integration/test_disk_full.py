"""Memory and free-disk watermarks and a full disk (issue 7): produce is refused with a
retriable error and a retry-after, consumers keep working, nothing acknowledged is lost, and
produce resumes by itself once space (or memory) is back.

The disk tests mount a real tmpfs of a few MiB (root only; skipped with the reason otherwise)
and fill it for real. The fsync test and the memory test inject their fault through
``ferrymq._faults`` (a flag file, a fake ``statm``) into a real broker subprocess: a tmpfs
reports ENOSPC at ``write(2)``, never at fsync, and a test cannot set the broker's RSS.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import ferrymq
from ferrymq.errors import BusyError, FerryMQTimeoutError
from ferrymq.testing import Faults
from tests.helpers import BrokerProcess, FakeStatm, read_topic, wait_for

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
BODY = 64 * 1024


def _mount_tmpfs(where: Path, size_mib: int) -> str | None:
    """Mount a tmpfs of ``size_mib`` at ``where``; the reason it failed, or None."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    where.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0755", "tmpfs",
                        str(where)], capture_output=True, text=True, check=False)
    if r.returncode:
        return f"mount -t tmpfs failed: {r.stderr.strip() or r.returncode}"
    return None


@pytest.fixture
def small_disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A real, small file system (tmpfs) mounted for this test."""
    mnt = tmp_path / "mnt"
    size = getattr(request, "param", 24)
    reason = _mount_tmpfs(mnt, size)
    if reason is not None:
        pytest.skip(f"no real small disk in this sandbox ({reason}); "
                    "test_fsync_enospc_injected covers the fault by injection")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _patient_send(address: str, topic: str, *, hold_s: float,
                  release: Callable[[], object]) -> tuple[ferrymq.SendResult, float]:
    """Send one message with time to spare while the disk is full: it must still be waiting
    after ``hold_s``; then ``release`` frees the disk and the send must get through. The result
    and the seconds the send took."""
    result: list[tuple[ferrymq.SendResult, float]] = []

    def send() -> None:
        with ferrymq.Producer(address, delivery_timeout_s=20) as p:
            t0 = time.monotonic()
            r = p.send(ferrymq.Message(topic, b"patient"))
            result.append((r, time.monotonic() - t0))

    th = threading.Thread(target=send)
    th.start()
    time.sleep(hold_s)
    assert not result, "produce went through while the disk was full"
    release()
    th.join(20)
    assert result, "produce did not resume"
    return result[0]

def _ballast(path: Path, nbytes: int) -> None:
    with open(path, "wb") as f:
        chunk = b"\xa5" * MiB
        for _ in range(nbytes // MiB):
            f.write(chunk)


def _body(i: int) -> bytes:
    return i.to_bytes(4, "big") * (BODY // 4)


def test_disk_full_loses_nothing_acknowledged_and_resumes(small_disk: Path) -> None:
    """Fill a 24 MiB tmpfs by producing with acks (no watermark: real ENOSPC)."""
    ballast = small_disk / "ballast"
    _ballast(ballast, 4 * MiB)
    env = {"FERRYMQ_DISK_FREE_LOW_WATERMARK_BYTES": "0", "FERRYMQ_BUSY_RETRY_AFTER_MS": "200",
           "FERRYMQ_DISK_CHECK_INTERVAL_MS": "200", "FERRYMQ_KEY_INDEX_ENABLED": "false"}
    with BrokerProcess(small_disk / "data", env=env) as bp:
        pid = bp.proc.pid if bp.proc else 0
        with ferrymq.AdminClient(bp.address) as admin:
            admin.create_topic("fill", 1)
        acked: list[tuple[int, int]] = []  # (offset, i)
        errors: list[BaseException] = []
        with ferrymq.Producer(bp.address, delivery_timeout_s=1.5) as p:
            for i in range(24 * MiB // BODY + 50):
                try:
                    r = p.send(ferrymq.Message("fill", _body(i)))
                except FerryMQTimeoutError as exc:
                    errors.append(exc)
                    if len(errors) == 2:
                        break
                    continue
                acked.append((r.offset, i))
        assert errors, "the disk never filled up"
        assert len(acked) > 100
        assert all("STORAGE_FULL" in str(e) and "ENOSPC" in str(e) for e in errors), errors
        assert "disk full" in bp.log_text()

        # every acknowledged message is readable, in order, and nothing else
        got = read_topic(bp.address, "fill", expect=len(acked), quiet=0.3)
        assert [(g.offset, g.body) for g in got] == [(o, _body(i)) for o, i in acked]

        ballast.unlink()  # space is back: produce resumes without a restart
        with ferrymq.Producer(bp.address, delivery_timeout_s=15) as p:
            r = p.send(ferrymq.Message("fill", _body(10_000)))
        assert r.offset == acked[-1][0] + 1
        assert bp.proc is not None and bp.proc.pid == pid and bp.proc.poll() is None
        assert "produce accepted again" in bp.log_text()
        assert bp.terminate() == 0

    with BrokerProcess(small_disk / "data", env=env) as bp:  # and the log reopens intact
        got = read_topic(bp.address, "fill", expect=len(acked) + 1, quiet=0.3)
        assert [g.body for g in got] == [_body(i) for _, i in acked] + [_body(10_000)]
        assert "truncat" not in bp.log_text().split("--- start 2")[-1].lower()


@pytest.mark.parametrize("small_disk", [32], indirect=True)
def test_disk_watermark_refuses_produce_but_not_consumers(small_disk: Path) -> None:
    env = {"FERRYMQ_DISK_FREE_LOW_WATERMARK_BYTES": str(8 * MiB),
           "FERRYMQ_BUSY_RETRY_AFTER_MS": "300", "FERRYMQ_DISK_CHECK_INTERVAL_MS": "100"}
    with BrokerProcess(small_disk / "data", env=env) as bp, \
            ferrymq.PullConsumer(bp.address, "g", auto_offset_reset="earliest",
                                 auto_commit=False) as c:
        with ferrymq.Producer(bp.address) as p:
            p.send_batch([ferrymq.Message("t", f"m{i}") for i in range(10)])
        c.subscribe("t")
        ballast = small_disk / "ballast"
        _ballast(ballast, 26 * MiB)  # leaves < 6 MiB free
        time.sleep(1.0)  # the housekeeping tick samples the disk
        with ferrymq.Producer(bp.address, delivery_timeout_s=1.0) as p:
            with pytest.raises(FerryMQTimeoutError,
                               match=r"STORAGE_FULL.*disk_free_low_watermark_bytes=8388608"):
                p.send(ferrymq.Message("t", b"refused"))
        # consumers, fetches and offset commits keep working
        got: list[ferrymq.ReceivedMessage] = []
        deadline = time.monotonic() + 10
        while len(got) < 10 and time.monotonic() < deadline:
            got.extend(c.poll(timeout=0.2))
        assert sorted(g.body for g in got) == sorted(f"m{i}".encode() for i in range(10))
        c.commit()
        assert sum(c.committed().values()) == 10

        # a producer with time to spare waits (retry-after) and gets through once space is back
        _, waited = _patient_send(bp.address, "t", hold_s=1.5, release=ballast.unlink)
        assert waited >= 1.4
        log = bp.log_text()
        assert "refusing produce" in log and "produce accepted again" in log


def test_memory_watermark_busy_and_resume(tmp_path: Path) -> None:
    """The broker's RSS read from a fake statm (injected): BUSY for every produce path."""
    statm = FakeStatm(tmp_path / "statm", 200 * MiB)
    env = {"FERRYMQ_MEMORY_HIGH_WATERMARK_BYTES": str(100 * MiB),
           "FERRYMQ_BUSY_RETRY_AFTER_MS": "250"}
    with BrokerProcess(tmp_path / "data", env=env, faults=statm.faults) as bp:
        with ferrymq.AdminClient(bp.address) as admin:
            admin.create_topic("t", 2)  # admin requests are not refused
        with ferrymq.Producer(bp.address, delivery_timeout_s=1.0) as p:
            for msg in (ferrymq.Message("t", b"plain"), ferrymq.Message("t", b"later", delay=60)):
                with pytest.raises(FerryMQTimeoutError,
                                   match=r"BUSY.*memory_high_watermark_bytes=104857600"):
                    p.send(msg)
            with pytest.raises(FerryMQTimeoutError, match="BUSY"):
                p.send_batch([ferrymq.Message("t", b"b1"), ferrymq.Message("t", b"b2")])
        with ferrymq.HalfMessageProducer(bp.address, "txg", lambda m: ferrymq.HalfState.COMMIT,
                                         request_timeout_s=1.0) as tp:
            t0 = time.monotonic()
            with pytest.raises(BusyError, match="memory_high_watermark") as info:
                tp.send_in_transaction(ferrymq.Message("t", b"half"),
                                       lambda m: ferrymq.HalfState.COMMIT)
            assert info.value.retry_after_ms == 250
            assert time.monotonic() - t0 >= 0.5  # retried after the retry-after, then gave up
        with ferrymq.Producer(bp.address, transactional_id="eos-1", delivery_timeout_s=1.0) as p:
            p.begin()
            fut = p.send_async(ferrymq.Message("t", b"eos"))
            with pytest.raises(FerryMQTimeoutError, match="BUSY"):
                fut.result(10)
            p.abort()
        assert read_topic(bp.address, "t", quiet=0.3) == []

        statm.set_rss(50 * MiB)
        wait_for(lambda: "produce accepted again" in bp.log_text(), timeout=5)
        with ferrymq.Producer(bp.address) as p:
            p.send(ferrymq.Message("t", b"plain", sharding_key="k"))
        assert [m.body for m in read_topic(bp.address, "t", expect=1, quiet=0.3)] == [b"plain"]


def test_fsync_enospc_injected_nothing_acked_is_lost_and_resumes(tmp_path: Path) -> None:
    """fsync fails with ENOSPC (injected: a file system that runs out at writeback)."""
    flag = tmp_path / "enospc"
    env = {"FERRYMQ_BUSY_RETRY_AFTER_MS": "200", "FERRYMQ_DISK_CHECK_INTERVAL_MS": "100"}
    faults = Faults(enospc_file=str(flag))
    with BrokerProcess(tmp_path / "data", env=env, faults=faults) as bp:
        with ferrymq.AdminClient(bp.address) as admin:
            admin.create_topic("f", 1)
        with ferrymq.Producer(bp.address) as p:
            for i in range(20):
                p.send(ferrymq.Message("f", f"ok{i}"))
        flag.write_bytes(b"")
        with ferrymq.Producer(bp.address, delivery_timeout_s=1.5) as p:
            with pytest.raises(FerryMQTimeoutError, match="STORAGE_FULL"):
                p.send(ferrymq.Message("f", b"lost?"))
        # not acknowledged and not shown to consumers while undurable
        assert [m.body for m in read_topic(bp.address, "f", expect=20, quiet=0.3)] == [
            f"ok{i}".encode() for i in range(20)]

        _patient_send(bp.address, "f", hold_s=1.0, release=flag.unlink)
        assert "tail written again" in bp.log_text()
        bodies = [m.body for m in read_topic(bp.address, "f", expect=22, quiet=0.3)]
        # the failed send was written before its fsync failed: after the rewrite it is stored
        # (once); the acknowledged ones are all there, in order
        assert bodies == [f"ok{i}".encode() for i in range(20)] + [b"lost?", b"patient"]
        assert bp.terminate() == 0
    with BrokerProcess(tmp_path / "data", env=env, faults=faults) as bp:
        assert len(read_topic(bp.address, "f", expect=22, quiet=0.3)) == 22
