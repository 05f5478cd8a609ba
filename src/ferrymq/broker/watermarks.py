"""Memory and free-disk watermarks: when to refuse produce requests (back-pressure).

Theory of operation
-------------------
:class:`Watermarks` holds one small state: the reason produce is refused now, or None. It is
recomputed from samples, never on the produce path: the broker's housekeeping tick (every
0.5 s) calls :meth:`Watermarks.sample`, which reads the resident set size from
``/proc/self/statm`` (one small read) and, every ``disk_check_interval_ms``, the free space of
``data_dir`` with ``statvfs``. A produce request then costs one attribute test
(:meth:`Watermarks.check_produce`).

Three conditions refuse produce (PRODUCE in every form -- plain, batch, transactional,
delayed, dedup -- and PREPARE_HALF); consumers, fetches, acks, nacks, offset commits and
transaction ends are never refused, so the backlog can drain:

* **memory**: RSS above ``memory_high_watermark_bytes`` -> BUSY. Cleared when RSS is back
  below it (CPython rarely gives memory back to the OS, so this may take a while; the
  watermark is a brake on growth, not a target).
* **disk**: free space below ``disk_free_low_watermark_bytes`` -> STORAGE_FULL.
* **disk full**: a write failed with ENOSPC or EDQUOT (:meth:`Watermarks.on_disk_full`; the
  free space is sampled again at once) -> STORAGE_FULL. Cleared when a later sample shows at
  least :data:`DISK_FULL_RESUME_BYTES` more free space than at the failure (and above the
  watermark), or after :data:`DISK_FULL_PROBE_S` as a probe (a quota -- EDQUOT -- can be
  raised without the file system's free space changing; if the disk is still full, the next
  write fails cleanly and sets the state again).

Every refusal carries ``busy_retry_after_ms`` (see :class:`~ferrymq.errors.BrokerError`): the
request had no effect, and the producer waits at least that long before it sends it again.
Transitions are logged once (WARNING when refusing starts, INFO when it ends).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path

from ferrymq import _faults
from ferrymq.errors import BrokerError, BusyError, StorageFullError

log = logging.getLogger("ferrymq.broker")

AUTO_MEMORY_FRACTION = 0.4
"""``memory_high_watermark_bytes = 0`` means this share of the machine's (or cgroup's) memory,
RabbitMQ's ``vm_memory_high_watermark`` default."""
DISK_FULL_RESUME_BYTES = 1024 * 1024
"""After ENOSPC, produce resumes once this much more space is free than at the failure (so a
disk that frees a few bytes does not flap between full and not full on every write)."""
DISK_FULL_PROBE_S = 10.0
"""After ENOSPC without any space coming back, produce is tried again this often (a probe)."""
PROC_STATM = "/proc/self/statm"
"""Where the broker reads its resident memory from (a test's fault hooks may name another)."""
FULL_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT))
"""``OSError.errno`` values that mean the disk (or the user's quota) is full."""


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is an ``OSError`` saying the disk or the quota is full."""
    return isinstance(exc, OSError) and exc.errno in FULL_ERRNOS


def machine_memory_bytes() -> int:
    """Physical memory, or the cgroup's memory limit when lower (0 if unknown)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        total = 0
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and 0 < int(raw) < (total or 1 << 62):
            total = int(raw)
        break
    return total


def read_rss_bytes(path: str, page_size: int) -> int | None:
    """Resident set size from a ``statm`` file (second field, in pages); None if unreadable."""
    try:
        with open(path, "rb") as f:
            fields = f.read(256).split()
        return int(fields[1]) * page_size
    except (OSError, IndexError, ValueError):
        return None


class Watermarks:
    """Decides whether produce requests are refused, from periodic samples.

    Args:
        data_dir: the directory whose file system is watched.
        memory_high_bytes: RSS above which produce gets BUSY (0: auto, -1: off).
        disk_free_low_bytes: free space below which produce gets STORAGE_FULL (0: off).
        disk_check_interval_s: how often :meth:`sample` runs ``statvfs``.
        retry_after_ms: the retry-after refusals carry.
        clock: monotonic seconds (injected).
        statm_path: where to read the RSS from (None: the installed fault hooks' fake
            ``statm``, else ``/proc/self/statm``).
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        memory_high_bytes: int,
        disk_free_low_bytes: int,
        disk_check_interval_s: float,
        retry_after_ms: int,
        clock: Callable[[], float],
        statm_path: str | None = None,
    ) -> None:
        self.data_dir = data_dir
        if memory_high_bytes == 0:
            memory_high_bytes = int(machine_memory_bytes() * AUTO_MEMORY_FRACTION)
        self.memory_high_bytes = memory_high_bytes if memory_high_bytes > 0 else 0
        """The effective memory watermark (0: off)."""
        self.disk_free_low_bytes = disk_free_low_bytes
        self.disk_check_interval_s = disk_check_interval_s
        self.retry_after_ms = retry_after_ms
        self._clock = clock
        self._statm_path = statm_path or _faults.active().statm_path or PROC_STATM
        try:
            self._page_size = os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            self._page_size = 4096
        self.rss_bytes: int | None = None
        """Last sampled resident memory (None: not sampled or unreadable)."""
        self.free_bytes: int | None = None
        """Last sampled free space of ``data_dir`` for unprivileged users (None: unknown)."""
        self._last_disk_check = float("-inf")
        self._full_since: float | None = None
        self._free_at_full = 0
        self._refusal: tuple[type[BrokerError], str] | None = None
        self.refused = 0
        """Produce requests refused so far (for logs and tests)."""

    @property
    def refusing(self) -> str | None:
        """Why produce is refused now, or None."""
        return None if self._refusal is None else self._refusal[1]

    @property
    def disk_ok(self) -> bool:
        """Whether the disk is neither full nor below its watermark (by the last samples)."""
        return self._refusal is None or self._refusal[0] is not StorageFullError

    def check_produce(self) -> None:
        """Raise the current refusal, if any (the produce path: one attribute test).

        Raises:
            BusyError: memory above its watermark.
            StorageFullError: the disk is full or below its free-space watermark.
        """
        if self._refusal is not None:
            self.refused += 1
            cls, reason = self._refusal
            raise cls(f"produce refused: {reason}", retry_after_ms=self.retry_after_ms)

    def full_error(self, exc: OSError) -> StorageFullError:
        """A write failed with ENOSPC/EDQUOT: note it (:meth:`on_disk_full`) and return the
        error to answer the producer with."""
        self.on_disk_full(exc)
        return StorageFullError(f"disk full, nothing stored: {exc.strerror or exc}",
                                retry_after_ms=self.retry_after_ms)

    def on_disk_full(self, exc: BaseException) -> None:
        """A write or fsync failed with ENOSPC/EDQUOT: refuse produce and sample the disk now."""
        now = self._clock()
        if self._full_since is None:
            log.warning("disk full (%s): refusing produce until space is back", exc)
        self._full_since = now
        self._sample_disk(now)
        self._free_at_full = self.free_bytes or 0
        self._update()

    def sample(self) -> None:
        """Read the RSS, and the free space when due; update the refusal (housekeeping tick)."""
        now = self._clock()
        if self.memory_high_bytes:
            self.rss_bytes = read_rss_bytes(self._statm_path, self._page_size)
        if now - self._last_disk_check >= self.disk_check_interval_s:
            self._sample_disk(now)
            if self._full_since is not None:
                free = self.free_bytes or 0
                back = (free >= self._free_at_full + DISK_FULL_RESUME_BYTES
                        and free >= self.disk_free_low_bytes)
                if back or now - self._full_since >= DISK_FULL_PROBE_S:
                    self._full_since = None
        self._update()

    def _sample_disk(self, now: float) -> None:
        self._last_disk_check = now
        try:
            st = os.statvfs(self.data_dir)
        except OSError as exc:
            log.warning("statvfs(%s) failed: %s", self.data_dir, exc)
            self.free_bytes = None
            return
        self.free_bytes = st.f_bavail * st.f_frsize

    def _update(self) -> None:
        refusal: tuple[type[BrokerError], str] | None = None
        rss, free = self.rss_bytes, self.free_bytes
        if self._full_since is not None:
            refusal = (StorageFullError, f"the disk of {self.data_dir} is full (a write failed "
                       f"with ENOSPC/EDQUOT; {_mib(free)} free)")
        elif self.disk_free_low_bytes and free is not None and free < self.disk_free_low_bytes:
            refusal = (StorageFullError, f"{_mib(free)} free on the disk of {self.data_dir}, "
                       f"below disk_free_low_watermark_bytes={self.disk_free_low_bytes}")
        elif self.memory_high_bytes and rss is not None and rss > self.memory_high_bytes:
            refusal = (BusyError, f"broker memory (RSS {_mib(rss)}) above "
                       f"memory_high_watermark_bytes={self.memory_high_bytes}")
        before = self._refusal
        self._refusal = refusal
        if refusal is not None and (before is None or before[0] is not refusal[0]):
            log.warning("refusing produce: %s", refusal[1])
        elif refusal is None and before is not None:
            log.info("produce accepted again (was: %s; %d requests refused)", before[1],
                     self.refused)


def _mib(n: int | None) -> str:
    return "? MiB" if n is None else f"{n / (1024 * 1024):.1f} MiB"
