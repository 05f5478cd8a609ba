"""Topics and their queues: the registry that owns every open :class:`~ferrymq.storage.Log`.

Theory of operation
-------------------
A topic has a name, a broker-assigned numeric id (part of every message id) and a fixed number of
queues. Each queue is one append-only log in ``<data_dir>/topics/<name>/<queue>/``. Topic metadata
lives in one checkpoint file (``meta/topics``) rewritten atomically on every change.

:class:`QueueState` wraps a queue's log with what the broker needs around it: ``visible_end``
(the end offset consumers may read: the durable end in sync flush mode, the written end in async
mode), the long-poll waiters to wake when it advances, and the flush waiters of sends that are
acknowledged only when their bytes are fsynced.

All methods run on the event-loop thread, except :meth:`QueueState.flush`, which the flusher
thread calls (the log makes that safe).
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgpack

from ferrymq._faults import enospc_point
from ferrymq.errors import (
    InvalidConfigError,
    InvalidTopicNameError,
    TopicAlreadyExistsError,
    UnknownQueueError,
    UnknownTopicError,
)
from ferrymq.protocol.dedup import MAX_DEDUP_WINDOW_MS
from ferrymq.storage import Log, LogConfig, read_checkpoint, write_checkpoint

log = logging.getLogger("ferrymq.broker")

TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
INTERNAL_TOPIC_NAME = re.compile(r"^%[A-Z]+%[A-Za-z0-9._-]{1,200}$")
TOPIC_CONFIG_KEYS = ("retention_ms", "retention_bytes", "segment_bytes", "segment_ms",
                     "dedup_window_ms")
LOG_CONFIG_KEYS = frozenset(("retention_ms", "retention_bytes", "segment_bytes", "segment_ms"))
"""The topic settings that are :class:`~ferrymq.storage.LogConfig` fields."""


def check_topic_name(name: str, *, internal_ok: bool = False) -> None:
    """Raise InvalidTopicNameError unless ``name`` is a valid topic name."""
    if name in (".", "..") or not (
        TOPIC_NAME.fullmatch(name) or (internal_ok and INTERNAL_TOPIC_NAME.fullmatch(name))
    ):
        raise InvalidTopicNameError(
            f"invalid topic name {name[:64]!r}: use 1-249 characters of [A-Za-z0-9._-]"
        )


@dataclass(eq=False)
class QueueState:
    """One queue: its log plus the broker's bookkeeping around it."""

    topic: str
    topic_id: int
    queue: int
    log: Log
    visible_end: int
    waiters: set[asyncio.Future[None]] = field(default_factory=set)
    flush_waiters: deque[tuple[int, Callable[[BaseException | None], None]]] = field(
        default_factory=deque
    )
    open_txns: dict[int, int] = field(default_factory=dict)
    """Producer id -> first offset of its open transaction here (owned by the coordinator)."""

    @property
    def lso(self) -> int:
        """The last stable offset: read_committed readers stop here (below the first offset of
        the oldest open transaction, and never past the visible end)."""
        if not self.open_txns:
            return self.visible_end
        return min(self.visible_end, min(self.open_txns.values()))

    def release_txn(self, pid: int) -> None:
        """``pid``'s transaction here ended: the LSO may move, so wake long polls."""
        if self.open_txns.pop(pid, None) is not None and self.waiters:
            for w in self.waiters:
                if not w.done():
                    w.set_result(None)
            self.waiters.clear()

    def advance(self, end: int) -> None:
        """Make offsets below ``end`` visible and wake long-polling fetches."""
        if end <= self.visible_end:
            return
        self.visible_end = end
        if self.waiters:
            for w in self.waiters:
                if not w.done():
                    w.set_result(None)
            self.waiters.clear()

    def on_durable(self, durable: int) -> None:
        """Run the callbacks of sends whose end offset is now at or below ``durable``."""
        fw = self.flush_waiters
        while fw and fw[0][0] <= durable:
            fw.popleft()[1](None)

    def fail_flush_waiters(self, exc: BaseException) -> None:
        """Fail every send still waiting for an fsync (the fsync failed). A callback may wait
        again (a committed copy waiting for the rewrite after ENOSPC): it stays queued."""
        fw = self.flush_waiters
        failed = list(fw)
        fw.clear()
        for _end, cb in failed:
            cb(exc)

    # the flusher's side (see ferrymq.broker.flusher.Flushable)

    def flush_blocking(self) -> int:
        """fsync the log (flusher thread); the end offset now durable."""
        enospc_point("fsync", str(self))
        return self.log.flush()

    def flush_begin(self) -> tuple[int, int] | None:
        """The descriptor to fsync and the end offset it makes durable, when this flush is one
        fsync (see :meth:`ferrymq.storage.log.Log.flush_begin`; :meth:`flush_end` must
        follow); None: use :meth:`flush_blocking` (flusher thread)."""
        enospc_point("fsync", str(self))
        return self.log.flush_begin()

    def flush_end(self, end: int, fsynced: bool) -> int:
        """Finish what :meth:`flush_begin` began; the end offset now durable."""
        self.log.flush_end(end, fsynced)
        return self.log.durable_offset

    def rewrite_undurable(self) -> int:
        """After an fsync failed with ENOSPC: write what is above the durable end again (read
        back from the page cache and checked) and fsync it; the end offset now durable (loop
        thread). In sync mode that is exactly what consumers have not seen; in async mode it
        holds acknowledged sends, which this makes durable or (unreadable) refuses."""
        enospc_point("rewrite", str(self))
        return self.log.rewrite_tail(self.log.durable_offset)

    def on_flushed(self, durable: int, sync: bool) -> None:
        """Acknowledge sends now durable; in sync mode, show consumers the durable end."""
        self.on_durable(durable)
        if sync:
            self.advance(durable)

    def on_flush_failed(self, exc: BaseException) -> None:
        """The fsync failed: fail the sends waiting for it."""
        self.fail_flush_waiters(exc)

    def __str__(self) -> str:
        return f"{self.topic}/{self.queue}"


async def wait_for_wakeup(waiter_sets: list[set[asyncio.Future[None]]], timeout: float) -> bool:
    """Long polling: wait until the owner of any of ``waiter_sets`` wakes its waiters (a queue
    advanced, a retry fell due) or ``timeout`` seconds pass. True when woken."""
    w: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    for ws in waiter_sets:
        ws.add(w)
    try:
        await asyncio.wait_for(w, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        for ws in waiter_sets:
            ws.discard(w)


@dataclass
class Topic:
    """A topic: name, id, queues and per-topic config overrides.

    ``dedup_window_ms`` (0: none) is fixed when the topic is created: from its config, or the
    broker's ``dedup_window_ms`` then, which :meth:`TopicRegistry.create` writes into the config
    (a topic keeps the window it was created with, as a NATS stream keeps its
    ``duplicate_window``)."""

    name: str
    topic_id: int
    queues: list[QueueState]
    config: dict[str, str]
    created_ms: int
    dedup_window_ms: int = 0

    @property
    def directory_name(self) -> str:
        """Directory of this topic under ``topics/``."""
        return self.name


class TopicRegistry:
    """Creates, opens, finds and deletes topics; owns every queue's log."""

    def __init__(
        self,
        data_dir: Path,
        base_log_config: LogConfig,
        *,
        sync_visibility: bool,
        clean_shutdown: bool,
        max_queues: int,
        default_dedup_window_ms: int = 0,
    ) -> None:
        self._dir = data_dir
        self._meta_path = data_dir / "meta" / "topics"
        self._topics_dir = data_dir / "topics"
        self._base = base_log_config
        self._sync_visibility = sync_visibility
        self._clean = clean_shutdown
        self._max_queues = max_queues
        self._default_dedup_window_ms = default_dedup_window_ms
        self.topics: dict[str, Topic] = {}
        self.by_id: dict[int, Topic] = {}
        self._next_id = 1

    # -- lifecycle ---------------------------------------------------------------------------

    def open_all(self, now_ms: int) -> None:
        """Load topic metadata and open (recover) every queue's log."""
        (self._dir / "meta").mkdir(parents=True, exist_ok=True)
        self._topics_dir.mkdir(parents=True, exist_ok=True)
        raw = read_checkpoint(self._meta_path)
        if raw is None:
            return
        meta = msgpack.unpackb(raw, raw=False)
        self._next_id = meta["next_id"]
        for name, t in meta["topics"].items():
            self._open_topic(name, t["id"], t["queues"], t["config"], t["created_ms"], now_ms)

    def _log_config(self, overrides: dict[str, str]) -> LogConfig:
        cfg = self._base
        changes: dict[str, int | None] = {}
        for k, v in overrides.items():
            if k not in LOG_CONFIG_KEYS:
                continue
            n = int(v)
            changes[k] = None if n < 0 and k.startswith("retention") else n
        if changes:
            cfg = replace(cfg, **changes)  # type: ignore[arg-type]
        return cfg

    def _open_topic(
        self, name: str, topic_id: int, queues: int, config: dict[str, str], created_ms: int,
        now_ms: int,
    ) -> Topic:
        cfg = self._log_config(config)
        states: list[QueueState] = []
        for q in range(queues):
            qdir = self._topics_dir / name / str(q)
            qdir.mkdir(parents=True, exist_ok=True)
            lg, report = Log.open(qdir, cfg, clean_shutdown=self._clean, now_ms=now_ms)
            if getattr(report, "truncated_bytes", 0):
                log.warning("recovered %s/%d: %s", name, q, report)
            states.append(QueueState(name, topic_id, q, lg, lg.end_offset))
        topic = Topic(name, topic_id, states, dict(config), created_ms,
                      int(config.get("dedup_window_ms", "0")))
        self.topics[name] = topic
        self.by_id[topic_id] = topic
        return topic

    def _save(self) -> None:
        meta = {
            "next_id": self._next_id,
            "topics": {
                t.name: {
                    "id": t.topic_id, "queues": len(t.queues), "config": t.config,
                    "created_ms": t.created_ms,
                }
                for t in self.topics.values()
            },
        }
        write_checkpoint(self._meta_path, msgpack.packb(meta, use_bin_type=True))

    def close(self) -> None:
        """Close every log (flush, write indexes and recovery points)."""
        for t in self.topics.values():
            for qs in t.queues:
                qs.log.close()

    # -- operations --------------------------------------------------------------------------

    def create(
        self, name: str, queues: int, config: dict[str, str], now_ms: int,
        *, internal_ok: bool = False,
    ) -> Topic:
        """Create a topic.

        Raises:
            InvalidTopicNameError, TopicAlreadyExistsError, InvalidConfigError.
        """
        check_topic_name(name, internal_ok=internal_ok)
        if name in self.topics:
            raise TopicAlreadyExistsError(f"topic {name!r} exists")
        if not 1 <= queues <= self._max_queues:
            raise InvalidConfigError(f"queues must be 1..{self._max_queues}, not {queues}")
        for k, v in config.items():
            if k not in TOPIC_CONFIG_KEYS:
                raise InvalidConfigError(f"unknown topic setting {k!r}; known: {TOPIC_CONFIG_KEYS}")
            try:
                int(v)
            except ValueError:
                raise InvalidConfigError(f"topic setting {k} must be an integer") from None
        if not internal_ok and "dedup_window_ms" not in config and self._default_dedup_window_ms:
            config = {**config, "dedup_window_ms": str(self._default_dedup_window_ms)}
        self._check_dedup_window(config)
        topic_id = self._next_id
        self._next_id += 1
        topic = self._open_topic(name, topic_id, queues, config, now_ms, now_ms)
        self._save()
        log.info("created topic %s (id %d, %d queues)", name, topic_id, queues)
        return topic

    def _check_dedup_window(self, config: dict[str, str]) -> None:
        window = int(config.get("dedup_window_ms", "0"))
        if not 0 <= window <= MAX_DEDUP_WINDOW_MS:
            raise InvalidConfigError(
                f"dedup_window_ms must be 0..{MAX_DEDUP_WINDOW_MS} (MAX_DEDUP_WINDOW_MS, one "
                f"day), not {window}")
        retention = self._log_config(config).retention_ms
        if window and retention is not None and window > retention:
            raise InvalidConfigError(
                f"dedup_window_ms {window} exceeds the topic's retention_ms {retention}: the "
                "window must not outlive the messages it points at")

    def delete(self, name: str) -> None:
        """Delete a topic and its data.

        Raises:
            UnknownTopicError.
        """
        topic = self.get(name)
        for qs in topic.queues:
            for w in qs.waiters:
                if not w.done():
                    w.set_result(None)
            qs.log.close()
        del self.topics[name]
        del self.by_id[topic.topic_id]
        self._save()
        src = self._topics_dir / name
        dst = self._topics_dir / f".{topic.topic_id}.deleted"  # short: names may be 249 chars
        if src.exists():
            src.rename(dst)
            shutil.rmtree(dst, ignore_errors=True)
        log.info("deleted topic %s", name)

    def get(self, name: str) -> Topic:
        """The topic called ``name``.

        Raises:
            UnknownTopicError.
        """
        t = self.topics.get(name)
        if t is None:
            raise UnknownTopicError(f"unknown topic {name[:249]!r}")
        return t

    def queue(self, name: str, queue: int) -> QueueState:
        """One queue of a topic.

        Raises:
            UnknownTopicError, UnknownQueueError.
        """
        t = self.get(name)
        if not 0 <= queue < len(t.queues):
            raise UnknownQueueError(f"topic {name!r} has queues 0..{len(t.queues) - 1}, not {queue}")
        return t.queues[queue]

    def all_queues(self) -> Iterator[QueueState]:
        """Every queue of every topic."""
        for t in self.topics.values():
            yield from t.queues

    @property
    def sync_visibility(self) -> bool:
        """True when consumers see only fsynced data (sync flush mode)."""
        return self._sync_visibility
