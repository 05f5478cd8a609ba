"""Fault hooks for fault-injection tests: one :class:`Faults` object a broker process sets once.

Theory of operation
-------------------
A test asks for faults through the launcher, ``BrokerProcess(..., faults=Faults(...))``
(:mod:`ferrymq._launcher`), which hands them to the broker subprocess as environment variables
(:meth:`Faults.env`). The ``ferrymq broker`` command reads them once, next to the broker's
configuration (:meth:`Faults.from_env`), and :func:`ferrymq.broker.server.serve` installs them
with :func:`configure` before it opens anything. Nothing else reads the environment: importing
this module changes nothing, and a broker in a test's own process runs without faults.

The hooks:

``crash_at`` names a crash point: the process kills itself with SIGKILL there
(:func:`crash_point`), so crash tests can stop the broker between two exact steps.

``enospc_file`` names a flag file: while it exists, the I/O points it selects fail with ENOSPC
before touching the disk (:func:`enospc_point`), as a file system that runs out of space would
(a tmpfs or an ext4 image reports ENOSPC at ``write(2)`` only, which the real disk-full test
covers; a file system that runs out at writeback reports it at fsync). The file's lines select
the points, each ``<operation> [<target>]`` with shell-style patterns (``fnmatch``): the
operations are ``fsync`` and ``rewrite`` (a queue's log, the scheduler's files ``%schedule``, a
delivery journal ``%delivery/<group>``) and ``write`` (an append to a queue's log, target
``<topic>/<queue>``; a consumer group's offsets file, ``%groups/<group>``). An empty file means
``fsync`` and ``rewrite`` of every target. Examples: ``write %TXN%state/0``, ``fsync orders/*``,
``fsync %schedule``. Hot paths test :data:`ENOSPC_FAULTS` (one module attribute) before calling.

``statm_path`` names a file read instead of ``/proc/self/statm`` for the broker's resident
memory (the memory watermark test drives the broker's RSS through it).

``clock_file`` makes the broker's wall clock the system's plus the integer number of ms in that
file (:class:`~ferrymq._time.OffsetFileClock`: tests write it to make the wall clock jump; the
monotonic clock is untouched).

``fsync_journal`` names a file to which the broker appends ``<path>\t<size>`` each time an
fsync of a file it writes through :class:`~ferrymq.storage.handles.FileHandle` (a queue's
segments) completed, ``size`` being the file's size when the fsync began (a lower bound of
what it made durable). A test simulating power loss kills the broker and truncates each file
back to its last recorded size (the chaos tests' power loss). :data:`FSYNC_JOURNAL` is the
one module attribute the handles test before calling :func:`note_fsync_begin` /
:func:`note_fsynced`.

``hold_recovery_file`` names a flag file: while it exists, the broker's start waits in the
middle of recovering its data directory, after the logs are open (:func:`recovery_hold`), so
a test can probe ``/readyz`` and ``/healthz`` while the broker recovers.

Never set them outside tests.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from fnmatch import fnmatchcase
from typing import ClassVar

from ferrymq._time import SYSTEM_CLOCK, Clock, OffsetFileClock

__all__ = ["ENOSPC_FAULTS", "FSYNC_JOURNAL", "NO_FAULTS", "Faults", "active", "configure",
           "crash_point", "enospc_point", "note_fsync_begin", "note_fsynced", "recovery_hold"]

_DEFAULT_RULES = (("fsync", "*"), ("rewrite", "*"))


@dataclass(frozen=True)
class Faults:
    """The fault hooks of one broker process (every one off by default)."""

    crash_at: str = ""
    """The crash point at which the process kills itself ("": none)."""
    enospc_file: str = ""
    """The flag file selecting I/O points that fail with ENOSPC ("": none)."""
    statm_path: str = ""
    """A file read instead of ``/proc/self/statm`` ("": the real one)."""
    clock_file: str = ""
    """A file holding ms added to the wall clock ("": the system clock)."""
    fsync_journal: str = ""
    """A file to which every completed fsync appends ``<path>\t<size>`` ("": none)."""
    hold_recovery_file: str = ""
    """While this file exists, recovery waits after opening the logs ("": never)."""

    ENV: ClassVar[Mapping[str, str]] = {
        "crash_at": "FERRYMQ_CRASH_AT",
        "enospc_file": "FERRYMQ_FAULT_ENOSPC_FILE",
        "statm_path": "FERRYMQ_FAULT_STATM",
        "clock_file": "FERRYMQ_TEST_CLOCK_FILE",
        "fsync_journal": "FERRYMQ_FAULT_FSYNC_JOURNAL",
        "hold_recovery_file": "FERRYMQ_FAULT_HOLD_RECOVERY",
    }
    """The environment variable that carries each hook to a broker subprocess."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Faults:
        """The hooks ``env`` (a broker process's environment) asks for."""
        return cls(**{name: env.get(var, "") for name, var in cls.ENV.items()})

    def env(self) -> dict[str, str]:
        """The environment variables that ask a broker subprocess for these hooks."""
        return {self.ENV[f.name]: value for f in fields(self)
                if (value := getattr(self, f.name))}

    def clock(self) -> Clock:
        """The broker's clock: :class:`~ferrymq._time.OffsetFileClock` on ``clock_file``, else
        the system clock."""
        return OffsetFileClock(self.clock_file) if self.clock_file else SYSTEM_CLOCK


NO_FAULTS = Faults()
_active = NO_FAULTS
ENOSPC_FAULTS = False
"""Whether ENOSPC faults may be injected at all (hot paths test this before calling)."""
FSYNC_JOURNAL = False
"""Whether fsyncs are journaled (``fsync_journal``; the handles test this before calling)."""
_journal_lock = threading.Lock()
_fsync_sizes: dict[tuple[str, int], int] = {}
"""``(path, write count)`` pinned for an fsync → the file's size then."""


def configure(faults: Faults) -> None:
    """Install ``faults`` for this process (the broker's start does, before opening anything)."""
    global _active, ENOSPC_FAULTS, FSYNC_JOURNAL
    _active = faults
    ENOSPC_FAULTS = bool(faults.enospc_file)
    FSYNC_JOURNAL = bool(faults.fsync_journal)


def active() -> Faults:
    """The fault hooks installed in this process."""
    return _active


def crash_point(name: str) -> None:
    """Kill this process with SIGKILL if the installed ``crash_at`` is ``name``."""
    at = _active.crash_at
    if at and name == at:
        os.kill(os.getpid(), signal.SIGKILL)


HOLD_POLL_S = 0.01
"""How often :func:`recovery_hold` looks whether its flag file is gone."""


def recovery_hold() -> None:
    """Wait while the installed ``hold_recovery_file`` exists (recovery's thread calls this)."""
    path = _active.hold_recovery_file
    while path and os.path.exists(path):
        time.sleep(HOLD_POLL_S)


def _rules(flag_file: str) -> tuple[tuple[str, str], ...] | None:
    """The selected points while the flag file exists, else None."""
    try:
        with open(flag_file, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    rules = []
    for line in text.splitlines():
        parts = line.split(None, 1)
        if parts:
            rules.append((parts[0], parts[1].strip() if len(parts) > 1 else "*"))
    return tuple(rules) or _DEFAULT_RULES


def enospc_point(what: str, target: str = "") -> None:
    """Raise ENOSPC if the installed ``enospc_file`` exists and selects ``what`` (an operation)
    on ``target``.

    Raises:
        OSError: ENOSPC (injected).
    """
    flag_file = _active.enospc_file
    if not flag_file:
        return
    rules = _rules(flag_file)
    if rules and any(fnmatchcase(what, op) and fnmatchcase(target, where)
                     for op, where in rules):
        raise OSError(errno.ENOSPC,
                      f"No space left on device (injected fault at {what} {target})".rstrip())


def note_fsync_begin(path: str, fd: int, writes: int) -> None:
    """An fsync of ``fd`` (``path``, after ``writes`` writes) is about to begin: remember the
    file's size now (what the fsync will at least make durable)."""
    size = os.fstat(fd).st_size
    with _journal_lock:
        _fsync_sizes[(path, writes)] = size


def note_fsynced(path: str, writes: int) -> None:
    """The fsync begun after ``writes`` writes of ``path`` completed: journal the size noted
    when it began."""
    with _journal_lock:
        size = _fsync_sizes.pop((path, writes), None)
        if size is None:
            return
        with open(_active.fsync_journal, "a", encoding="utf-8") as journal:
            journal.write(f"{path}\t{size}\n")
