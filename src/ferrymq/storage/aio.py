"""Fsync several files at once from one thread, through Linux native AIO.

Why: in sync flush mode each dirty queue is its own file and needs its own fsync. One after
the other, a round of four small fsyncs took 0.67 ms (p50) on the benchmark machine; handing
them to a thread pool costs a futex wake-up and two GIL hand-offs per fsync, which on a busy
2-core virtual machine cost more than the fsync. ``io_submit`` with ``IOCB_CMD_FSYNC`` iocbs
(Linux 4.18 and later) runs the fsyncs concurrently in the kernel and ``io_getevents`` waits for
all of them: two system calls, no other Python thread, 0.39 ms for the same four (bench/README,
session 9).

The system calls are made through :mod:`ctypes`, which releases the GIL while they run. Where
native AIO is missing (another OS or architecture, a kernel without AIO fsync, ``io_setup``
refused), :meth:`AioFsync.open` returns None or :meth:`AioFsync.fsync` falls back to
``os.fsync`` one descriptor after another, with the same result: an errno per descriptor.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import sys
from collections.abc import Sequence

log = logging.getLogger("ferrymq.storage")

# (io_setup, io_destroy, io_getevents, io_submit)
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_IOCB_CMD_FSYNC = 2


class _Iocb(ctypes.Structure):
    """``struct iocb`` of ``linux/aio_abi.h`` (little-endian field order)."""

    _fields_ = [
        ("aio_data", ctypes.c_uint64),
        ("aio_key", ctypes.c_uint32),
        ("aio_rw_flags", ctypes.c_int32),
        ("aio_lio_opcode", ctypes.c_uint16),
        ("aio_reqprio", ctypes.c_int16),
        ("aio_fildes", ctypes.c_uint32),
        ("aio_buf", ctypes.c_uint64),
        ("aio_nbytes", ctypes.c_uint64),
        ("aio_offset", ctypes.c_int64),
        ("aio_reserved2", ctypes.c_uint64),
        ("aio_flags", ctypes.c_uint32),
        ("aio_resfd", ctypes.c_uint32),
    ]


class _IoEvent(ctypes.Structure):
    """``struct io_event``."""

    _fields_ = [
        ("data", ctypes.c_uint64),
        ("obj", ctypes.c_uint64),
        ("res", ctypes.c_int64),
        ("res2", ctypes.c_int64),
    ]


class AioFsync:
    """An AIO context that fsyncs up to ``max_parallel`` descriptors per system call.

    Not thread-safe: one owner thread (the broker's flusher). :meth:`close` it when done.
    """

    def __init__(self, libc: ctypes.CDLL, ctx: ctypes.c_ulong, max_parallel: int,
                 numbers: tuple[int, int, int, int]) -> None:
        self._libc = libc
        self._ctx = ctx
        self._max = max_parallel
        _setup, self._destroy, self._getevents, self._submit = numbers
        self._iocbs = (_Iocb * max_parallel)()
        self._ptrs = (ctypes.POINTER(_Iocb) * max_parallel)(
            *(ctypes.pointer(cb) for cb in self._iocbs))
        self._events = (_IoEvent * max_parallel)()
        self.supported = True
        """False once a submission failed with EINVAL or ENOSYS (a kernel without AIO fsync,
        or a file without fsync): every later call fsyncs one descriptor after another."""

    @classmethod
    def open(cls, max_parallel: int) -> AioFsync | None:
        """A new context, or None where native AIO is not available."""
        numbers = _SYSCALLS.get(platform.machine())
        if not sys.platform.startswith("linux") or numbers is None or max_parallel < 1:
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall.restype = ctypes.c_long
        except (OSError, AttributeError):
            return None
        ctx = ctypes.c_ulong(0)
        if libc.syscall(numbers[0], ctypes.c_long(max_parallel), ctypes.byref(ctx)) != 0:
            log.info("native AIO unavailable (io_setup: %s); fsyncs run one by one",
                     os.strerror(ctypes.get_errno()))
            return None
        return cls(libc, ctx, max_parallel, numbers)

    def close(self) -> None:
        """Destroy the context (waits for nothing: :meth:`fsync` reaps what it submits)."""
        if self._ctx.value:
            self._libc.syscall(self._destroy, self._ctx)
            self._ctx = ctypes.c_ulong(0)

    def fsync(self, fds: Sequence[int]) -> list[int]:
        """fsync every one of ``fds``; per descriptor 0 or the errno of its failure.

        Raises:
            OSError: waiting for the submitted fsyncs failed (not their result: a failed fsync
                is an errno in the list). The caller must treat every descriptor as not
                durable.
        """
        out: list[int] = []
        for start in range(0, len(fds), self._max):
            out += self._fsync_some(fds[start : start + self._max])
        return out

    def _fsync_some(self, fds: Sequence[int]) -> list[int]:
        n = len(fds)
        results = [0] * n
        submitted = 0
        if self.supported and n > 1:
            for i, fd in enumerate(fds):
                cb = self._iocbs[i]
                ctypes.memset(ctypes.byref(cb), 0, ctypes.sizeof(_Iocb))
                cb.aio_lio_opcode = _IOCB_CMD_FSYNC
                cb.aio_fildes = fd
                cb.aio_data = i
            got = self._libc.syscall(self._submit, self._ctx, ctypes.c_long(n), self._ptrs)
            if got < 0:
                err = ctypes.get_errno()
                if err in (errno.EINVAL, errno.ENOSYS):
                    log.info("the kernel refused an AIO fsync (%s); fsyncs run one by one",
                             os.strerror(err))
                    self.supported = False
                got = 0
            submitted = int(got)
            self._reap(submitted, results)
        for i in range(submitted, n):  # not submitted (or no AIO): one by one
            try:
                os.fsync(fds[i])
            except OSError as exc:
                results[i] = exc.errno or errno.EIO
        return results

    def _reap(self, submitted: int, results: list[int]) -> None:
        done = 0
        while done < submitted:
            left = submitted - done
            got = self._libc.syscall(self._getevents, self._ctx, ctypes.c_long(left),
                                     ctypes.c_long(left), self._events, None)
            if got < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                raise OSError(err, f"io_getevents: {os.strerror(err)}")
            for k in range(int(got)):
                ev = self._events[k]
                if ev.res < 0:
                    results[ev.data] = int(-ev.res)
            done += int(got)
