"""The broker's file-descriptor budget, and what running out of descriptors means to a client.

Theory of operation
-------------------
At start the broker raises its soft ``RLIMIT_NOFILE`` to the hard limit (the JVM does the same
for Kafka; the hard limit is the operator's: ``ulimit -Hn``, systemd's ``LimitNOFILE=``, the
container's ``--ulimit nofile``) and splits what it got (:func:`plan_descriptors`):

* :data:`RESERVED_DESCRIPTORS` for the process itself: standard streams, the data directory's
  lock, the listener, the event loop's and AIO's descriptors, and the short-lived ones (atomic
  writes, directory fsyncs, checkpoints, key-index files);
* connections: ``max_connections``, at most three quarters of the rest;
* segment files, delivery-group journals and the scheduler's bucket files: the rest (or
  ``max_open_segments``), the capacity of the descriptor cache that they all share
  (:mod:`ferrymq.storage.handles`).

So the number of queues (and of delivery groups) is not bounded by descriptors: an idle queue
or group holds none, a queue in use holds one (its active segment's ``.log``; more while a
consumer reads old segments), a group in use one (its journal), and the budget says how many
can be in use at once before files are closed and opened again. The start
log says it (:meth:`DescriptorBudget.describe`). The broker refuses to start (``ConfigError``)
when the limit cannot hold the reserve, :data:`MIN_OPEN_SEGMENTS` segment files and
:data:`MIN_CONNECTIONS` connections, or when ``max_open_segments`` leaves fewer than
:data:`MIN_CONNECTIONS` for connections; it warns when ``max_connections`` is above what is left
for connections (beyond it, new connections are refused at accept).

Running out anyway (EMFILE: this process; ENFILE: the whole system) is handled like a full disk:
the request that needed a descriptor is refused with BUSY and a retry-after
(:func:`out_of_descriptors_error`), nothing it would have stored was stored or acknowledged, and
the broker goes on once descriptors are free again, without a restart (the flusher retries a
flush that could not open a file; the descriptor cache closes idle files to make room; the accept
loop keeps listening).
"""

from __future__ import annotations

import errno
import logging
import resource
from dataclasses import dataclass
from typing import TypeGuard

from ferrymq.broker.watermarks import is_disk_full
from ferrymq.errors import BusyError, ConfigError

__all__ = [
    "MIN_CONNECTIONS",
    "MIN_OPEN_SEGMENTS",
    "NO_DESCRIPTOR_ERRNOS",
    "RESERVED_DESCRIPTORS",
    "DescriptorBudget",
    "is_out_of_descriptors",
    "is_resource_shortage",
    "out_of_descriptors_error",
    "plan_descriptors",
    "raise_descriptor_limit",
]

log = logging.getLogger("ferrymq.broker")

RESERVED_DESCRIPTORS = 64
"""Descriptors kept for the process itself (see the module docstring); measured: an idle broker
(uvloop, AIO, flusher) holds 15."""
MIN_OPEN_SEGMENTS = 16
"""Fewest segment files the descriptor cache may hold: below it, a handful of busy queues would
reopen files on every request."""
MIN_CONNECTIONS = 16
"""Fewest connections the budget must leave room for."""
CONNECTION_SHARE = 0.75
"""Most of the budget (after the reserve) that ``max_connections`` may take by default."""
UNLIMITED_TARGET = 1 << 20
"""Soft limit asked for when the hard limit is unlimited (Linux's default ``fs.nr_open``)."""
NO_DESCRIPTOR_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE))
"""``OSError.errno`` values that mean no descriptor could be allocated."""


def is_out_of_descriptors(exc: BaseException) -> TypeGuard[OSError]:
    """Whether ``exc`` is an ``OSError`` saying the process or the system has no descriptor left."""
    return isinstance(exc, OSError) and exc.errno in NO_DESCRIPTOR_ERRNOS


def is_resource_shortage(exc: BaseException) -> bool:
    """Whether ``exc`` says a resource that comes back ran out: disk space or quota (ENOSPC,
    EDQUOT) or descriptors (EMFILE, ENFILE). What failed so is tried again later, no restart."""
    return is_disk_full(exc) or is_out_of_descriptors(exc)


def out_of_descriptors_error(exc: OSError, what: str, retry_after_ms: int) -> BusyError:
    """The error that answers a request which could not get a descriptor for ``what``: BUSY
    (retriable), with a retry-after; nothing of the request was stored."""
    which = "the broker" if exc.errno == errno.EMFILE else "the system"
    return BusyError(f"cannot {what}: {which} is out of file descriptors ({exc.strerror or exc}); "
                     "nothing stored", retry_after_ms=retry_after_ms)


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (never lower it).

    Returns:
        ``(soft limit before, soft limit now)``.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, target, exc)
            return soft, soft
        return soft, target
    return soft, soft


@dataclass(frozen=True, slots=True)
class DescriptorBudget:
    """How the broker spends its descriptor limit.

    Attributes:
        limit: the soft ``RLIMIT_NOFILE`` in force.
        raised_from: the soft limit before the broker raised it (== ``limit``: not raised).
        reserved: kept for the process itself.
        connections: room left for connections.
        open_segments: capacity of the descriptor cache of segment files and delivery-group
            journals.
    """

    limit: int
    raised_from: int
    reserved: int
    connections: int
    open_segments: int

    def describe(self, max_total_queues: int, max_delivery_groups: int) -> str:
        """The start log's sentence."""
        raised = (f" (soft limit raised from {self.raised_from})"
                  if self.raised_from != self.limit else "")
        return (f"descriptor limit {self.limit}{raised}: serves any number of queues and "
                f"delivery groups (at most max_total_queues={max_total_queues}, "
                f"max_delivery_groups={max_delivery_groups}), {self.open_segments} of them in "
                f"use at once without reopening files (segment files and group journals open at "
                f"most: max_open_segments, idle queues and groups hold none); room for "
                f"{self.connections} connections, {self.reserved} reserved")


def plan_descriptors(limit: int, *, max_connections: int, max_open_segments: int,
                     raised_from: int | None = None) -> DescriptorBudget:
    """Split ``limit`` descriptors between the process, connections and segment files.

    Args:
        limit: the soft ``RLIMIT_NOFILE``.
        max_connections: the broker's setting.
        max_open_segments: the broker's setting (0: what connections leave).
        raised_from: the soft limit before :func:`raise_descriptor_limit`.

    Raises:
        ConfigError: the limit is too small for the minimum, or ``max_open_segments`` leaves
            too little for connections (the message names the limit and the setting).
    """
    usable = limit - RESERVED_DESCRIPTORS
    if usable < MIN_OPEN_SEGMENTS + MIN_CONNECTIONS:
        raise ConfigError(
            f"the descriptor limit (RLIMIT_NOFILE) is {limit}: the broker needs at least "
            f"{RESERVED_DESCRIPTORS + MIN_OPEN_SEGMENTS + MIN_CONNECTIONS} "
            f"({RESERVED_DESCRIPTORS} reserved, {MIN_OPEN_SEGMENTS} segment files, "
            f"{MIN_CONNECTIONS} connections); raise it (ulimit -n, LimitNOFILE=)")
    if max_open_segments:
        if max_open_segments < MIN_OPEN_SEGMENTS:
            raise ConfigError(f"max_open_segments must be 0 (auto) or at least "
                              f"{MIN_OPEN_SEGMENTS}, not {max_open_segments}")
        if usable - max_open_segments < MIN_CONNECTIONS:
            raise ConfigError(
                f"max_open_segments={max_open_segments} leaves {usable - max_open_segments} "
                f"of the descriptor limit {limit} (RLIMIT_NOFILE, {RESERVED_DESCRIPTORS} "
                f"reserved) for connections, fewer than {MIN_CONNECTIONS}: lower it or raise "
                "the limit")
        segments = max_open_segments
    else:
        segments = max(MIN_OPEN_SEGMENTS,
                       usable - min(max_connections, int(usable * CONNECTION_SHARE)))
    return DescriptorBudget(limit, limit if raised_from is None else raised_from,
                            RESERVED_DESCRIPTORS, usable - segments, segments)
