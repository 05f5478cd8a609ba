"""SIGTERM and SIGHUP become KeyboardInterrupt inside ``stop_signals_interrupt`` (so commands
owning child processes clean up on a ``kill``), and the previous handlers come back after."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ferrymq._stop_signals import STOP_SIGNALS, stop_signals_interrupt


def _signal_self_and_wait(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(5)  # the handler runs at once and interrupts the sleep
    raise AssertionError("the signal did not interrupt")


@pytest.mark.parametrize("sig", STOP_SIGNALS)
def test_a_stop_signal_interrupts_inside_and_the_old_handler_returns(sig: int) -> None:
    seen: list[int] = []
    previous = signal.signal(sig, lambda s, f: seen.append(s))
    try:
        with stop_signals_interrupt(), pytest.raises(KeyboardInterrupt):
            _signal_self_and_wait(sig)
        os.kill(os.getpid(), sig)
        assert seen == [sig]
    finally:
        signal.signal(sig, previous)


def test_outside_the_main_thread_it_changes_nothing() -> None:
    before = signal.getsignal(signal.SIGTERM)
    inside: list[object] = []

    def run() -> None:
        with stop_signals_interrupt():
            inside.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert inside == [before]
