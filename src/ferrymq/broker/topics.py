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

In a cluster, a queue this broker leads or follows carries a :class:`ReplicaRole` (set by
:class:`~ferrymq.cluster.replication.ReplicaManager`): :meth:`QueueState.advance` then reports
local progress to it instead of moving ``visible_end``, and the role moves ``visible_end`` to
the high watermark with :meth:`QueueState.show` (consumers read only what the in-sync replicas
have). A single broker's queues have none: one attribute test is all that costs them.

Limits, checked before anything is created (a refusal is POLICY_VIOLATION naming the limit):
``max_topics`` and ``max_total_queues`` count the topics clients create (explicitly or by
auto-creation); the broker's internal topics (``%RETRY%``, ``%DLQ%``, ``%HALF%``, ``%TXN%``:
names starting with ``%``) are neither counted nor refused, so a full broker still keeps its
promises (retries, dead letters, transactions). Auto-creation is also limited per user, or per
connection without authentication, by ``auto_create_topics_per_minute``
(:class:`~ferrymq.broker.limits.CreationRate`). Topic settings are checked by
:mod:`ferrymq.broker.topic_settings`.

Descriptors: every queue's log shares the registry's
:class:`~ferrymq.storage.handles.FileHandles`, so idle queues hold no open file; after each
flush the cache is trimmed back to its capacity (:meth:`QueueState.on_flushed`).

All methods run on the event-loop thread, except :meth:`QueueState.flush`, which the flusher
thread calls (the log makes that safe).
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import msgpack

from ferrymq._faults import enospc_point
from ferrymq.broker.limits import CreationRate
from ferrymq.broker.topic_settings import LOG_SETTINGS, parse_topic_config
from ferrymq.errors import (
    InvalidConfigError,
    InvalidTopicNameError,
    NotLeaderError,
    PolicyViolationError,
    TopicAlreadyExistsError,
    UnknownQueueError,
    UnknownTopicError,
)
from ferrymq.protocol.dedup import MAX_DEDUP_WINDOW_MS
from ferrymq.storage import Log, LogConfig, read_checkpoint, write_checkpoint
from ferrymq.storage.files import fsync_directory
from ferrymq.storage.handles import FileHandles

log = logging.getLogger("ferrymq.broker")

TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
INTERNAL_TOPIC_NAME = re.compile(r"^%[A-Z]+%[A-Za-z0-9._-]{1,200}$")
INTERNAL_PREFIX = "%"
"""Internal topics' names start with it (clients cannot create such names)."""


def valid_topic_name(name: str) -> bool:
    """Whether ``name`` is a topic name that may exist (a user's or an internal one)."""
    return name not in (".", "..") and bool(
        TOPIC_NAME.fullmatch(name) or INTERNAL_TOPIC_NAME.fullmatch(name))


def check_topic_name(name: str, *, internal_ok: bool = False) -> None:
    """Raise InvalidTopicNameError unless ``name`` is a valid topic name."""
    if name in (".", "..") or not (
        TOPIC_NAME.fullmatch(name) or (internal_ok and INTERNAL_TOPIC_NAME.fullmatch(name))
    ):
        raise InvalidTopicNameError(
            f"invalid topic name {name[:64]!r}: use 1-249 characters of [A-Za-z0-9._-]"
        )


CLUSTER_TOPIC_ID_BASE = 1 << 24
"""Topic ids a cluster hands out start here; a broker's own ids (its internal topics, and every
topic of a single broker) stay below it, so the two never meet."""


class ReplicaRole(Protocol):
    """What a cluster's replica manager hangs on a queue it leads or follows
    (:attr:`QueueState.replica`)."""

    def on_local_progress(self, qs: QueueState) -> None:
        """The local log grew or became more durable (an append, or a flush in sync mode)."""
        ...

    def check_produce(self, acks: int) -> None:
        """Raise before anything is appended if a produce with ``acks`` must be refused here
        (not the leader: NotLeaderError; ``acks="all"`` with too few in-sync replicas:
        NotEnoughReplicasError)."""
        ...

    def wait_acks(self, end: int, timeout_ms: int,
                  cb: Callable[[BaseException | None], None]) -> None:
        """``acks="all"``: run ``cb(None)`` once the high watermark reaches ``end`` with enough
        in-sync replicas, ``cb(exc)`` if not within ``timeout_ms``."""
        ...


async def replicated(rep: ReplicaRole, end: int, timeout_ms: int = 0) -> None:
    """:meth:`ReplicaRole.wait_acks` as a coroutine: return once the high watermark covers
    ``end``; raise what it reports (NotLeaderError when the leadership moved first,
    NotEnoughReplicasError, RequestTimedOutError after ``timeout_ms``; 0: no timeout). What
    the broker's internal topics (group offsets, transaction state, half messages) wait for
    before they answer."""
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def acked(exc: BaseException | None) -> None:
        if not fut.done():
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)

    rep.wait_acks(end, timeout_ms, acked)
    await fut


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
    replica: ReplicaRole | None = None
    """In a cluster, this broker's role for the queue (None: a single broker's queue)."""

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

    def check_own_write(self) -> None:
        """Raise :class:`~ferrymq.errors.NotLeaderError` unless the broker itself may append to
        this queue (a scheduled message falling due, a half message's commit, a transaction
        marker): any queue of a single broker and the broker's own internal topics; of a
        cluster's queues only those it leads (a write into a follower's copy would make it
        diverge from its leader)."""
        if self.replica is not None:
            self.replica.check_produce(1)  # Acks.LEADER: refused unless this broker leads
        elif self.topic_id >= CLUSTER_TOPIC_ID_BASE:
            raise NotLeaderError(f"this broker does not lead {self}")

    def advance(self, end: int) -> None:
        """Make offsets below ``end`` visible and wake long-polling fetches; in a cluster, tell
        the queue's :class:`ReplicaRole` instead (it shows the high watermark)."""
        if self.replica is not None:
            self.replica.on_local_progress(self)
        elif end > self.visible_end:
            self.show(end)

    def show(self, end: int) -> None:
        """Make offsets below ``end`` visible (never back) and wake long-polling fetches."""
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

    def wait_durable(self, end: int, cb: Callable[[BaseException | None], None]) -> None:
        """Run ``cb(None)`` once offsets below ``end`` are durable (``cb(exc)`` if the fsync
        fails); the waiters stay sorted by end, as :meth:`on_durable` needs."""
        fw = self.flush_waiters
        if fw and fw[-1][0] > end:
            entries = sorted([*fw, (end, cb)], key=lambda e: e[0])
            fw.clear()
            fw.extend(entries)
        else:
            fw.append((end, cb))

    def when_durable(self, end: int, cb: Callable[[BaseException | None], None]) -> None:
        """:meth:`wait_durable`, but ``cb(None)`` runs at once when offsets below ``end`` are
        durable already and nobody waits (the flush-waiter deque stays sorted)."""
        if self.log.durable_offset >= end and not self.flush_waiters:
            cb(None)
            return
        self.wait_durable(end, cb)

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
        """Acknowledge sends now durable; in sync mode, show consumers the durable end. The
        flush made descriptors evictable: bring the descriptor cache back to its capacity."""
        self.on_durable(durable)
        if sync:
            self.advance(durable)
        handles = self.log.handles
        if handles.open_count > handles.capacity:
            handles.trim()

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
        max_topics: int = 0,
        max_total_queues: int = 0,
        auto_create_rate: CreationRate | None = None,
        handles: FileHandles | None = None,
        internal_logs: Mapping[str, LogConfig] | None = None,
    ) -> None:
        """The registry of ``data_dir``; call :meth:`open_all`.

        Args:
            data_dir: the broker's data directory.
            base_log_config: storage settings of topics without overrides.
            sync_visibility: consumers see only fsynced data (sync flush mode).
            clean_shutdown: the previous run stopped cleanly (recovery may trust the files).
            max_queues: most queues of one topic.
            default_dedup_window_ms: dedup window of topics created without one.
            max_topics: most topics clients may create (0: no limit).
            max_total_queues: most queues of those topics together (0: no limit).
            auto_create_rate: the per-client limit of auto-created topics (None: none).
            handles: the descriptor cache every queue's log shares (None: a default one).
            internal_logs: the storage settings of named internal topics, instead of
                ``base_log_config`` and any override (``%GROUPS%offsets``: no retention, its
                own segment size).
        """
        self._dir = data_dir
        self._meta_path = data_dir / "meta" / "topics"
        self._topics_dir = data_dir / "topics"
        self._base = base_log_config
        self._internal_logs = dict(internal_logs or {})
        self._sync_visibility = sync_visibility
        self._clean = clean_shutdown
        self._max_queues = max_queues
        self._default_dedup_window_ms = default_dedup_window_ms
        self.max_topics = max_topics
        self.max_total_queues = max_total_queues
        self.auto_create_rate = auto_create_rate
        self.handles = handles or FileHandles()
        """The descriptor cache of every queue's segment files."""
        self.topics: dict[str, Topic] = {}
        self.by_id: dict[int, Topic] = {}
        self.user_topics = 0
        """Topics counted by ``max_topics`` (all but the internal ones)."""
        self.user_queues = 0
        """Their queues, counted by ``max_total_queues``."""
        self._next_id = 1

    # -- lifecycle ---------------------------------------------------------------------------

    def open_all(self, now_ms: int) -> None:
        """Load topic metadata and open (recover) every queue's log."""
        (self._dir / "meta").mkdir(parents=True, exist_ok=True)
        self._topics_dir.mkdir(parents=True, exist_ok=True)
        raw = read_checkpoint(self._meta_path)
        meta = msgpack.unpackb(raw, raw=False) if raw is not None else None
        if meta is None:  # a new data directory, or one whose topic list was lost
            for path in self._topics_dir.iterdir():
                self._set_aside(path, "the topic list (meta/topics) is missing")
            return
        self._remove_leftovers(set(meta["topics"]))
        self._next_id = min(meta["next_id"], CLUSTER_TOPIC_ID_BASE)
        for name, t in meta["topics"].items():
            self._open_topic(name, t["id"], t["queues"], t["config"], t["created_ms"], now_ms)

    def _remove_leftovers(self, listed: set[str]) -> None:
        """Remove every directory under ``topics/`` that the topic list does not name.

        The list (``meta/topics``) is the commit point of a create and of a delete: a crash
        after a delete wrote it and before the directory was removed (or while a create made
        directories it never listed, so never acknowledged) leaves one, and it must not come
        back as the data of a later topic of that name."""
        for path in self._topics_dir.iterdir():
            if path.name not in listed:
                log.warning("removing %s: no topic of that name (left by a crash in a topic "
                            "create or delete)", path)
                shutil.rmtree(path, ignore_errors=True)

    def _set_aside(self, path: Path, why: str) -> None:
        """Move a topic directory that no topic owns to ``<data-dir>/orphaned/`` instead of
        deleting it (nothing proves its data was meant to go), with a warning."""
        dest = self._dir / "orphaned" / f"{path.name}.{time.time_ns() // 1_000_000}"
        dest.parent.mkdir(exist_ok=True)
        path.rename(dest)
        log.warning("moved %s to %s: %s; no topic uses it (delete it when it is not needed)",
                    path, dest, why)

    def _log_config(self, name: str, overrides: dict[str, str]) -> LogConfig:
        """The log settings of topic ``name`` with its stored config (checked when it was
        created)."""
        internal = self._internal_logs.get(name)
        if internal is not None:
            return internal
        cfg = self._base
        changes: dict[str, int | None] = {}
        for k, v in overrides.items():
            if k not in LOG_SETTINGS:
                continue
            n = int(v)
            changes[k] = None if n < 0 and k.startswith("retention") else n
        if changes:
            cfg = replace(cfg, **changes)  # type: ignore[arg-type]
        return cfg

    def _open_topic(
        self, name: str, topic_id: int, queues: int, config: dict[str, str], created_ms: int,
        now_ms: int, *, new: bool = False,
    ) -> Topic:
        """Open (``new``: create) a topic's queues and register it. If one queue cannot be
        opened (``new``: created), those opened are closed again (``new``: and their files
        removed) and the error is raised: nothing is registered."""
        cfg = self._log_config(name, config)
        states: list[QueueState] = []
        tdir = self._topics_dir / name
        try:
            if new and tdir.exists():  # not listed, so no topic's data (a failed create's)
                log.warning("removing %s before creating topic %s: no topic owns it", tdir,
                            name)
                shutil.rmtree(tdir)  # an error (EMFILE, ...) fails the create: nothing reused
            for q in range(queues):
                qdir = tdir / str(q)
                qdir.mkdir(parents=True, exist_ok=True)
                lg, report = Log.open(qdir, cfg, clean_shutdown=self._clean, now_ms=now_ms,
                                      handles=self.handles)
                if getattr(report, "truncated_bytes", 0):
                    log.warning("recovered %s/%d: %s", name, q, report)
                states.append(QueueState(name, topic_id, q, lg, lg.end_offset))
            if new:  # the queues' names, then the topic's, durable before the list names it
                # (each queue's directory is fsynced by its log's first flush)
                fsync_directory(tdir)
                fsync_directory(self._topics_dir)
        except BaseException:
            for qs in states:
                qs.log.close()
            if new:
                shutil.rmtree(self._topics_dir / name, ignore_errors=True)
            raise
        topic = Topic(name, topic_id, states, dict(config), created_ms,
                      int(config.get("dedup_window_ms", "0")))
        self.topics[name] = topic
        self.by_id[topic_id] = topic
        if not name.startswith(INTERNAL_PREFIX):
            self.user_topics += 1
            self.user_queues += queues
        return topic

    def _forget(self, topic: Topic) -> None:
        """Unregister a topic (its logs are closed by the caller)."""
        del self.topics[topic.name]
        del self.by_id[topic.topic_id]
        if not topic.name.startswith(INTERNAL_PREFIX):
            self.user_topics -= 1
            self.user_queues -= len(topic.queues)

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
        *, internal_ok: bool = False, topic_id: int | None = None,
    ) -> Topic:
        """Create a topic: check everything first (name, queue count, settings, limits), then
        create its queues; on failure nothing is left behind.

        Raises:
            InvalidTopicNameError, TopicAlreadyExistsError, InvalidConfigError.
            PolicyViolationError: ``max_topics`` or ``max_total_queues`` would be passed
                (never for internal topics).
            OSError: a file cannot be created (EMFILE, ENOSPC, ...): nothing was created.

        ``topic_id``: the id a cluster gave the topic (at least ``CLUSTER_TOPIC_ID_BASE``);
        None: the next local id.
        """
        self.check_new_topic(name, queues, config, internal_ok=internal_ok)
        if not internal_ok and "dedup_window_ms" not in config and self._default_dedup_window_ms:
            config = {**config, "dedup_window_ms": str(self._default_dedup_window_ms)}
        self._check_dedup_window(config)
        if topic_id is None:
            topic_id = self._next_id
            self._next_id += 1
        elif topic_id < CLUSTER_TOPIC_ID_BASE or topic_id in self.by_id:
            raise InvalidConfigError(f"topic id {topic_id} is not a free cluster topic id")
        topic = self._open_topic(name, topic_id, queues, config, now_ms, now_ms, new=True)
        try:
            self._save()
        except BaseException:
            for qs in topic.queues:
                qs.log.close()
            self._forget(topic)
            shutil.rmtree(self._topics_dir / name, ignore_errors=True)
            raise
        log.info("created topic %s (id %d, %d queues)", name, topic_id, queues)
        return topic

    def check_new_topic(self, name: str, queues: int, config: dict[str, str], *,
                        internal_ok: bool = False) -> None:
        """The checks of :meth:`create` (name, queue count, settings, limits), creating nothing.

        Raises:
            InvalidTopicNameError, TopicAlreadyExistsError, InvalidConfigError,
            PolicyViolationError: as :meth:`create`.
        """
        check_topic_name(name, internal_ok=internal_ok)
        if name in self.topics:
            raise TopicAlreadyExistsError(f"topic {name!r} exists")
        if not 1 <= queues <= self._max_queues:
            raise InvalidConfigError(
                f"queues must be 1..{self._max_queues} (max_queues), not {queues}")
        parse_topic_config(config)
        if not name.startswith(INTERNAL_PREFIX):
            self._check_limits(name, queues)

    def auto_create(self, name: str, queues: int, now_ms: int, *, who: str | object) -> Topic:
        """Create a topic a client asked for by name (a produce or a metadata request), within
        ``auto_create_topics_per_minute`` for ``who`` (a user name, or the connection when
        authentication is off).

        Raises:
            PolicyViolationError: ``who`` auto-created its share for now (with a retry-after),
                or a limit of :meth:`create`.
            InvalidTopicNameError, InvalidConfigError, OSError: as :meth:`create`.
        """
        check_topic_name(name)
        self._check_limits(name, queues)  # before taking a creation from the client's share
        rate = self.auto_create_rate
        if rate is not None:
            wait_s = rate.take(who)
            if wait_s > 0:
                whom = f"user {who!r}" if isinstance(who, str) else "this connection"
                raise PolicyViolationError(
                    f"topic {name!r} not auto-created: {whom} auto-created "
                    f"auto_create_topics_per_minute={rate.per_minute} topics within the last "
                    f"minute; create it explicitly (ferrymq topic create) or retry later",
                    retry_after_ms=int(wait_s * 1000) + 1)
        return self.create(name, queues, {}, now_ms)

    def _check_limits(self, name: str, queues: int) -> None:
        """Refuse a client's topic beyond ``max_topics`` or ``max_total_queues``."""
        if self.max_topics and self.user_topics >= self.max_topics:
            raise PolicyViolationError(
                f"topic {name!r} not created: the broker has {self.user_topics} topics, "
                f"max_topics={self.max_topics}")
        total = self.user_queues + queues
        if self.max_total_queues and total > self.max_total_queues:
            raise PolicyViolationError(
                f"topic {name!r} not created: its {queues} queues would make {total} on the "
                f"broker, above max_total_queues={self.max_total_queues}")

    def _check_dedup_window(self, config: dict[str, str]) -> None:
        window = int(config.get("dedup_window_ms", "0"))
        if not 0 <= window <= MAX_DEDUP_WINDOW_MS:
            raise InvalidConfigError(
                f"dedup_window_ms must be 0..{MAX_DEDUP_WINDOW_MS} (MAX_DEDUP_WINDOW_MS, one "
                f"day), not {window}")
        retention = self._log_config("", config).retention_ms
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
        self._forget(topic)
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
