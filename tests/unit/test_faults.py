"""The fault hooks' one seam (``ferrymq._faults``): set once by the broker's start, carried to a
broker subprocess by the launcher, never read from the environment at import."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferrymq import _faults
from ferrymq._time import SYSTEM_CLOCK, OffsetFileClock
from ferrymq.broker.watermarks import PROC_STATM, Watermarks
from ferrymq.testing import NO_FAULTS, BrokerProcess, Faults

EVERY_HOOK = Faults(crash_at="txn.markers_durable", enospc_file="/tmp/flag",
                    statm_path="/tmp/statm", clock_file="/tmp/clock",
                    fsync_journal="/tmp/fsyncs", hold_recovery_file="/tmp/hold")


@pytest.fixture
def installed() -> Iterator[None]:
    """Put the process back without faults after a test installed some."""
    try:
        yield
    finally:
        _faults.configure(NO_FAULTS)


def test_the_environment_carries_every_hook_and_only_those_set() -> None:
    assert Faults.from_env(EVERY_HOOK.env()) == EVERY_HOOK
    assert set(EVERY_HOOK.env()) == set(Faults.ENV.values())
    assert Faults(crash_at="x").env() == {"FERRYMQ_CRASH_AT": "x"}
    assert NO_FAULTS.env() == {}
    assert Faults.from_env({"FERRYMQ_PORT": "1", "PATH": "/bin"}) == NO_FAULTS


def test_importing_reads_no_environment() -> None:
    # a fresh interpreter with every hook's variable set: nothing is installed by the import
    code = ("from ferrymq import _faults\n"
            "assert _faults.active() == _faults.NO_FAULTS and not _faults.ENOSPC_FAULTS\n"
            "_faults.crash_point('txn.markers_durable')\n"
            "_faults.enospc_point('fsync', 'a/0')\n")
    res = subprocess.run([sys.executable, "-c", code], env=EVERY_HOOK.env() | {"PATH": "/bin"},
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr


def test_enospc_points_fail_only_while_installed_and_selected(tmp_path: Path,
                                                            installed: None) -> None:
    flag = tmp_path / "enospc"
    flag.write_text("fsync orders/*\n")
    _faults.enospc_point("fsync", "orders/0")  # nothing installed: a no-op
    _faults.configure(Faults(enospc_file=str(flag)))
    assert _faults.ENOSPC_FAULTS
    with pytest.raises(OSError, match="injected fault at fsync orders/0") as info:
        _faults.enospc_point("fsync", "orders/0")
    assert info.value.errno == errno.ENOSPC
    _faults.enospc_point("write", "orders/0")  # not selected
    _faults.enospc_point("fsync", "other/0")
    flag.unlink()
    _faults.enospc_point("fsync", "orders/0")  # no flag file: space is back
    _faults.configure(NO_FAULTS)
    assert not _faults.ENOSPC_FAULTS and _faults.active() is NO_FAULTS


def test_clock_and_statm_follow_the_installed_hooks(tmp_path: Path, installed: None) -> None:
    assert NO_FAULTS.clock() is SYSTEM_CLOCK
    clock = Faults(clock_file=str(tmp_path / "clock")).clock()
    assert isinstance(clock, OffsetFileClock) and clock.path == tmp_path / "clock"

    def statm_of() -> str:
        w = Watermarks(tmp_path, memory_high_bytes=-1, disk_free_low_bytes=0,
                       disk_check_interval_s=1.0, retry_after_ms=100, clock=lambda: 0.0)
        return w._statm_path

    assert statm_of() == PROC_STATM
    _faults.configure(Faults(statm_path=str(tmp_path / "statm")))
    assert statm_of() == str(tmp_path / "statm")


def test_launcher_hands_faults_to_the_broker_environment(tmp_path: Path) -> None:
    bp = BrokerProcess(tmp_path / "data", port=9, env={"FERRYMQ_SEGMENT_BYTES": "4096"},
                       faults=Faults(crash_at="p"))
    env = bp._environment()
    assert env is not None
    assert env["FERRYMQ_CRASH_AT"] == "p" and env["FERRYMQ_SEGMENT_BYTES"] == "4096"
    bp.faults = NO_FAULTS  # as a crash test does before restarting
    bp.env = None
    assert bp._environment() is None


def test_the_fsync_journal_records_what_each_fsync_made_durable(tmp_path: Path,
                                                                installed: None) -> None:
    from ferrymq.storage.handles import FileHandles

    journal = tmp_path / "fsyncs"
    path = tmp_path / "segment.log"
    handle = FileHandles().register(path, os.O_RDWR, create_flags=os.O_RDWR | os.O_CREAT)
    os.write(handle.get(), b"x" * 10)
    handle.wrote()
    handle.fsync()  # nothing installed: nothing journaled
    assert not journal.exists()
    _faults.configure(Faults(fsync_journal=str(journal)))
    assert _faults.FSYNC_JOURNAL
    os.write(handle.get(), b"y" * 5)
    handle.wrote()
    handle.fsync()
    pinned = handle.pin()  # a pin whose fsync failed (unpinned without a count): not journaled
    assert pinned is not None
    os.write(handle.get(), b"z" * 3)
    handle.unpin(None)
    assert journal.read_text() == f"{path}\t15\n"
    handle.close()


def test_recovery_hold_waits_while_its_file_exists(tmp_path: Path, installed: None) -> None:
    hold = tmp_path / "hold"
    _faults.recovery_hold()  # nothing installed: returns at once
    hold.touch()
    _faults.configure(Faults(hold_recovery_file=str(hold)))
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (_faults.recovery_hold(), done.set()))
    waiter.start()
    assert not done.wait(0.1)
    hold.unlink()
    assert done.wait(5)
    waiter.join()
