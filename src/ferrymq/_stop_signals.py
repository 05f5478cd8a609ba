"""SIGTERM and SIGHUP as Ctrl-C, for commands that own child processes in sessions of their own.

``ferrymq dev-cluster`` and the cluster benchmarks start etcd and brokers with
``new_session=True`` so a terminal's Ctrl-C reaches only the command, which then stops them. A
``kill`` or a closed terminal would end the command without running its ``finally`` blocks and
leave the children running; inside :func:`stop_signals_interrupt` those signals raise
:class:`KeyboardInterrupt` instead, so the same clean-up runs. (SIGKILL cannot be caught: what
it leaves behind is reported by the next start, whose data directories are locked.)
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that stop such a command as Ctrl-C does."""


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """While inside, :data:`STOP_SIGNALS` raise :class:`KeyboardInterrupt` in the main thread;
    the previous handlers come back on leaving. Outside the main thread (where Python cannot set
    handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _interrupt) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
