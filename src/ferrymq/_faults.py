"""Fault points for fault-injection tests, driven by environment variables read once at import.

``FERRYMQ_CRASH_AT`` names a crash point: the process kills itself with SIGKILL there, so crash
tests can stop the broker between two exact steps.

``FERRYMQ_FAULT_ENOSPC_FILE`` names a flag file: while it exists, the I/O points it selects
fail with ENOSPC before touching the disk (:func:`enospc_point`), as a file system that runs
out of space would (a tmpfs or an ext4 image reports ENOSPC at ``write(2)`` only, which the
real disk-full test covers; a file system that runs out at writeback reports it at fsync).
The file's lines select the points, each ``<operation> [<target>]`` with shell-style patterns
(``fnmatch``): the operations are ``fsync`` and ``rewrite`` (a queue's log, the scheduler's
files ``%schedule``, a delivery journal ``%delivery/<group>``) and ``write`` (an append to a
queue's log, target ``<topic>/<queue>``; a consumer group's offsets file,
``%groups/<group>``). An empty file means ``fsync`` and ``rewrite``
of every target. Examples: ``write %TXN%state/0``, ``fsync orders/*``, ``fsync %schedule``.

``FERRYMQ_FAULT_STATM`` names a file read instead of ``/proc/self/statm`` for the broker's
resident memory (the memory watermark test drives the broker's RSS through it).

Unset, each point costs one comparison. Never set them outside tests.
"""

from __future__ import annotations

import errno
import os
import signal
from fnmatch import fnmatchcase

_AT = os.environ.get("FERRYMQ_CRASH_AT", "")
_ENOSPC_FILE = os.environ.get("FERRYMQ_FAULT_ENOSPC_FILE", "")
ENOSPC_FAULTS = bool(_ENOSPC_FILE)
"""Whether ENOSPC faults may be injected at all (hot paths test this before calling)."""
STATM_PATH = os.environ.get("FERRYMQ_FAULT_STATM", "") or "/proc/self/statm"
"""Where the broker reads its resident memory from."""
_DEFAULT_RULES = (("fsync", "*"), ("rewrite", "*"))


def crash_point(name: str) -> None:
    """Kill this process with SIGKILL if ``FERRYMQ_CRASH_AT`` is ``name``."""
    if _AT and name == _AT:
        os.kill(os.getpid(), signal.SIGKILL)


def _rules() -> tuple[tuple[str, str], ...] | None:
    """The selected points while the flag file exists, else None."""
    try:
        with open(_ENOSPC_FILE, encoding="utf-8") as f:
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
    """Raise ENOSPC if ``FERRYMQ_FAULT_ENOSPC_FILE`` names a file that exists and selects
    ``what`` (an operation) on ``target``.

    Raises:
        OSError: ENOSPC (injected).
    """
    if not _ENOSPC_FILE:
        return
    rules = _rules()
    if rules and any(fnmatchcase(what, op) and fnmatchcase(target, where)
                     for op, where in rules):
        raise OSError(errno.ENOSPC,
                      f"No space left on device (injected fault at {what} {target})".rstrip())
