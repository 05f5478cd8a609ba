"""Crash points for fault-injection tests: the process kills itself with SIGKILL where a test
asked it to, so crash tests can stop the broker between two exact steps.

``FERRYMQ_CRASH_AT`` (read once, at import) names the point; unset, :func:`crash_point` costs
one comparison. Never set it outside tests.
"""

from __future__ import annotations

import os
import signal

_AT = os.environ.get("FERRYMQ_CRASH_AT", "")


def crash_point(name: str) -> None:
    """Kill this process with SIGKILL if ``FERRYMQ_CRASH_AT`` is ``name``."""
    if _AT and name == _AT:
        os.kill(os.getpid(), signal.SIGKILL)
