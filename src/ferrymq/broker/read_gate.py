"""Two reasons a client connection stops reading its socket, shared by the native connection
(:mod:`ferrymq.broker.connection`) and the Kafka one (:mod:`ferrymq.kafka.listener`): the
transport's write buffer is above its high-water mark (asyncio's ``pause_writing``; the time it
went there is kept for ``write_stall_timeout_ms``), and the user is over its
``produce_bytes_per_s`` (:meth:`ReadGate.throttle`). Each connection adds its own reasons in
its ``_update_reading``, which decides from all of them whether to pause the transport.
"""

from __future__ import annotations

import asyncio
import time


class ReadGate:
    """Mixin for an ``asyncio`` protocol; call :meth:`init_read_gate` in ``__init__``."""

    write_paused_since: float | None
    """Monotonic time the transport's buffer went above its high-water mark (None: below)."""
    _write_paused: bool
    _throttled: bool

    def init_read_gate(self) -> None:
        """Start with nothing paused."""
        self.write_paused_since = None
        self._write_paused = False
        self._throttled = False

    def _update_reading(self) -> None:
        """Pause or resume the transport's reading from every reason there is."""
        raise NotImplementedError

    def pause_writing(self) -> None:
        self._write_paused = True
        self.write_paused_since = time.monotonic()
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self.write_paused_since = None
        self._update_reading()

    def throttle(self, delay_s: float) -> None:
        """Read nothing for ``delay_s`` (a produce quota's debt): the producer slows down and
        nothing fails. A throttle already running is not extended."""
        if delay_s <= 0 or self._throttled:
            return
        self._throttled = True
        self._update_reading()

        def resume() -> None:
            self._throttled = False
            self._update_reading()

        asyncio.get_running_loop().call_later(delay_s, resume)
