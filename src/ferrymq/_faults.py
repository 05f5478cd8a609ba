"""Fault points for fault-injection tests, driven by environment variables read once at import.

``FERRYMQ_CRASH_AT`` names a crash point: the process kills itself with SIGKILL there, so crash
tests can stop the broker between two exact steps.

``FERRYMQ_FAULT_ENOSPC_FILE`` names a flag file: while it exists, every queue-log fsync fails
with ENOSPC before touching the disk (:func:`enospc_point`), as a file system that runs out of
space at writeback would (a tmpfs or an ext4 image reports ENOSPC at ``write(2)`` instead,
which the real disk-full test covers).

``FERRYMQ_FAULT_STATM`` names a file read instead of ``/proc/self/statm`` for the broker's
resident memory (the memory watermark test drives the broker's RSS through it).

Unset, each point costs one comparison. Never set them outside tests.
"""

from __future__ import annotations

import errno
import os
import signal

_AT = os.environ.get("FERRYMQ_CRASH_AT", "")
_ENOSPC_FILE = os.environ.get("FERRYMQ_FAULT_ENOSPC_FILE", "")
STATM_PATH = os.environ.get("FERRYMQ_FAULT_STATM", "") or "/proc/self/statm"
"""Where the broker reads its resident memory from."""


def crash_point(name: str) -> None:
    """Kill this process with SIGKILL if ``FERRYMQ_CRASH_AT`` is ``name``."""
    if _AT and name == _AT:
        os.kill(os.getpid(), signal.SIGKILL)


def enospc_point(what: str) -> None:
    """Raise ENOSPC if ``FERRYMQ_FAULT_ENOSPC_FILE`` names a file that exists.

    Raises:
        OSError: ENOSPC (injected).
    """
    if _ENOSPC_FILE and os.path.exists(_ENOSPC_FILE):
        raise OSError(errno.ENOSPC, f"No space left on device (injected fault at {what})")
