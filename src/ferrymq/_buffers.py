"""Receive memory shared by the connections of one thread."""

from __future__ import annotations

import threading

from ferrymq.protocol.frames import SCRATCH_BYTES

_local = threading.local()


def thread_scratch() -> memoryview:
    """The calling thread's scratch receive buffer, shared by the frame decoders of its event
    loop. Safe because a read lands in it and is parsed (``get_buffer`` then
    ``buffer_updated``) within one callback, and nothing refers to it afterwards."""
    view: memoryview | None = getattr(_local, "view", None)
    if view is None:
        view = _local.view = memoryview(bytearray(SCRATCH_BYTES))
    return view
