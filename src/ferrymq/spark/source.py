"""The PySpark data source ``ferrymq``: batch and streaming reads, batch and streaming writes.

Theory of operation
-------------------
Spark runs the pieces of a Python data source in different processes (see
``docs/spark.md``): ``schema()`` in a planner worker, the stream reader's offset methods in one
long-lived source runner on the driver, ``read(partition)`` on executors against a *pickled
copy* of the reader. So the readers keep no connection or cache that ``read`` relies on: every
fact a task needs travels in its :class:`QueueRange`, and sockets come from a per-process cache
(:func:`ferrymq.spark._wire.connection`).

On a cluster, LIST_OFFSETS and FETCH of a queue go to its leader (:mod:`ferrymq.spark._route`);
an answer that says the leader moved (NOT_LEADER, ...), a lost or refused connection (a dead
leader is named until its lease runs out) makes a task or the driver's look-ups between
micro-batches ask who leads now and send again there, as Kafka's source does, for up to option
``retryTimeout``, then fail naming it; only a query's start fails at once on brokers that do not
answer. Group requests go to the coordinator, metadata to any broker (bootstrap first).

A micro-batch is a set of ``[start, end)`` ranges per queue. The driver resolves them from
LIST_OFFSETS answers (no consumer group is joined); Spark writes them to its offset log before
the batch runs, so a restarted query re-reads exactly the same ranges. Exactly-once reading
comes from that replayable range plus an idempotent sink.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.types import StructType

from ferrymq.errors import (
    ConfigError,
    ConnectionClosedError,
    FerryMQError,
    FerryMQTimeoutError,
    LeaderNotAvailableError,
    UnknownTopicError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.leaders import STALE_VIEW_CODES
from ferrymq.protocol.markers import ReadCommittedFilter
from ferrymq.spark import _route, _wire
from ferrymq.spark.arrow import arrow_schema, scan, source_ddl, to_record_batch
from ferrymq.spark.offsets import (
    batch_start,
    cap_offsets,
    from_json_dict,
    split_range,
    to_json_dict,
)
from ferrymq.spark.options import (
    DEFAULT_RETRY_TIMEOUT_MS,
    EARLIEST,
    LATEST,
    QueueOffsets,
    SourceOptions,
    options_dict,
)

try:  # admission control and AvailableNow: Spark 4.2+
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable,
        ReadLimit,
        ReadMaxRows,
        SupportsTriggerAvailableNow,
    )
except ImportError:  # pragma: no cover - Spark 4.0/4.1
    ReadAllAvailable = ReadLimit = ReadMaxRows = None  # type: ignore[assignment,misc]

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        """Stand-in on Spark < 4.2 (no AvailableNow chunking)."""

log = logging.getLogger("ferrymq.spark")

DATA_SOURCE_NAME = "ferrymq"
INTERNAL_TOPIC_PREFIXES = ("%", "__")
"""Topics a ``subscribePattern`` never matches: the broker's and the connector's own (retry and
dead-letter queues, ``__ferrymq_spark_sinks``); ``subscribe`` can still name them."""
READ_RETRY_S = DEFAULT_RETRY_TIMEOUT_MS / 1000
"""The default of option ``retryTimeout``: how long a task (or the driver's offset look-up)
keeps retrying a broker that went away, or a queue without a live leader, before it fails."""


class DataLossError(FerryMQError):
    """Offsets a query should read are gone (retention, a deleted topic)."""


# --- driver-side helpers -------------------------------------------------------------------


@dataclass(frozen=True)
class QueueMeta:
    """A queue the query reads."""

    topic: str
    queue: int
    topic_id: int


def resolve_queues(opts: SourceOptions, *, retry: bool = False) -> dict[tuple[str, int], QueueMeta]:
    """The queues the subscription covers now (asked of any broker; with ``retry``, of the
    first that answers within ``retryTimeout``).

    Raises:
        UnknownTopicError: a subscribed or assigned topic does not exist.
        ConfigError: an assigned queue the topic does not have.
        ConnectionClosedError, FerryMQTimeoutError: no broker answered (in time).
    """
    sub = opts.subscription
    names: list[str] | None
    if sub.pattern is not None:
        names = None
    elif sub.assign:
        names = [t for t, _ in sub.assign]
    else:
        names = list(sub.topics)
    resp = _metadata(opts, m.MetadataRequest(names, False), retry)
    out: dict[tuple[str, int], QueueMeta] = {}
    wanted = dict(sub.assign)
    pattern = re.compile(sub.pattern) if sub.pattern is not None else None
    for name, tid, queues, code, *_ in resp.topics:
        if pattern is not None and (name.startswith(INTERNAL_TOPIC_PREFIXES)
                                    or not pattern.fullmatch(name)):
            continue
        if code:
            option = "assign" if sub.assign else "subscribe"
            if code == ErrorCode.UNKNOWN_TOPIC:
                raise UnknownTopicError(f"topic {name!r} does not exist on {opts.wire} "
                                        f"(option {option!r})")
            raise error_for_code(code, f"topic {name!r} (option {option!r})")
        qs = wanted.get(name, tuple(range(queues)))
        for q in qs:
            if q >= queues:
                raise ConfigError(f"option 'assign': topic {name!r} has {queues} queues, "
                                  f"there is no queue {q}")
            out[(name, q)] = QueueMeta(name, q, tid)
    return out


def _metadata(opts: SourceOptions, req: m.MetadataRequest, retry: bool) -> m.MetadataResponse:
    router = _route.router(opts.wire)
    window = _route.RetryWindow(f"metadata of {opts.subscription.describe()}",
                                opts.retry_timeout_s)
    while True:
        try:
            return router.ask(req, m.MetadataResponse)
        except (ConnectionClosedError, FerryMQTimeoutError) as exc:
            if not retry:
                raise type(exc)(f"{exc} (option 'servers')") from None
            window.failed(exc)
        time.sleep(0.2)


def list_offsets(wire: _wire.WireConfig, queues: Sequence[tuple[str, int]], spec: int, *,
                 committed: bool = False, retry_s: float = READ_RETRY_S) -> QueueOffsets:
    """LIST_OFFSETS for ``queues``: LATEST (-1), EARLIEST (-2) or a time in ms; with
    ``committed`` (read_committed) LATEST is the last stable offset. Each queue is asked of
    its leader; a leader that moved, died or does not answer is looked up again, and retriable
    errors retried, for up to ``retry_s`` (``retryTimeout``).

    Raises:
        LeaderNotAvailableError, ConnectionClosedError, ...: the last failure, after
            ``retry_s`` of retries (the message names the option).
        BrokerError: a refusal that retrying cannot change.
    """
    if not queues:
        return {}
    isolation = int(m.Isolation.READ_COMMITTED if committed else m.Isolation.READ_UNCOMMITTED)
    router = _route.router(wire)
    out: QueueOffsets = {}
    todo = list(queues)
    window = _route.RetryWindow("list offsets", retry_s)
    while True:
        groups, retry = router.split(todo)
        last: FerryMQError | None = router.no_route(*retry[0]) if retry else None
        for conn, some in groups.items():
            try:
                resp = conn.request(m.ListOffsetsRequest(entries=[(t, q, spec) for t, q in some],
                                                         isolation=isolation),
                                    m.ListOffsetsResponse)
            except (ConnectionClosedError, FerryMQTimeoutError) as exc:
                retry.extend(some)  # the leader went away: ask who leads now
                last = exc
                continue
            for t, q, code, off in resp.results:
                if not code:
                    out[(t, q)] = off
                    continue
                err = error_for_code(code, f"list offsets of {t}/{q}")
                if not err.retriable:
                    raise err
                retry.append((t, q))
                last = err
        if not retry:
            return out
        assert last is not None
        window.failed(last)
        router.refresh_quietly({t for t, _ in retry})
        todo = retry


def committed_offsets(wire: _wire.WireConfig, group: str, topics: Sequence[str], *,
                      retry_s: float = READ_RETRY_S) -> QueueOffsets:
    """A consumer group's committed offsets."""
    resp = _route.router(wire).group_request(
        group, m.FetchOffsetsRequest(group, sorted(set(topics))), m.FetchOffsetsResponse,
        timeout_s=retry_s)
    return {(t, q): o for t, q, o in resp.offsets}


def resolve_start(opts: SourceOptions, queues: Sequence[tuple[str, int]]) -> QueueOffsets:
    """Where a new query starts, per queue (startingTimestamp wins over startingOffsets)."""
    qs = sorted(queues)
    rc, wait = opts.read_committed, opts.retry_timeout_s
    if opts.starting_timestamp_ms is not None:
        return list_offsets(opts.wire, qs, opts.starting_timestamp_ms, committed=rc, retry_s=wait)
    start = opts.starting
    if start == "earliest":
        return list_offsets(opts.wire, qs, EARLIEST, retry_s=wait)
    if start == "latest":
        return list_offsets(opts.wire, qs, LATEST, committed=rc, retry_s=wait)
    fallback = EARLIEST if opts.starting_fallback == "earliest" else LATEST
    if start == "committed":
        assert opts.group is not None
        got = committed_offsets(opts.wire, opts.group, [t for t, _ in qs], retry_s=wait)
    else:
        assert isinstance(start, dict)
        got = {tq: off for tq, off in start.items() if tq in set(qs)}
    out: QueueOffsets = {}
    by_spec: dict[int, list[tuple[str, int]]] = {}
    for tq in qs:
        off = got.get(tq, fallback)
        if off < 0:
            by_spec.setdefault(off, []).append(tq)
        else:
            out[tq] = off
    for spec, group in by_spec.items():
        out.update(list_offsets(opts.wire, group, spec, committed=rc, retry_s=wait))
    return out


def check_data_loss(opts: SourceOptions, start: QueueOffsets) -> QueueOffsets:
    """Move starts that retention already deleted to the first offset still stored: an error
    naming the lost ranges with failOnDataLoss=true, a warning otherwise."""
    earliest = list_offsets(opts.wire, sorted(start), EARLIEST, retry_s=opts.retry_timeout_s)
    lost = {tq: (off, earliest[tq]) for tq, off in start.items() if off < earliest[tq]}
    if not lost:
        return start
    what = ", ".join(f"{t}/{q} offsets {a}..{b - 1}" for (t, q), (a, b) in sorted(lost.items()))
    if opts.fail_on_data_loss:
        raise DataLossError(f"data lost before it was read (retention removed it): {what}; "
                            "set failOnDataLoss=false to skip it")
    log.warning("skipping data removed before it was read: %s", what)
    return {tq: max(off, earliest[tq]) for tq, off in start.items()}


@dataclass(frozen=True)
class QueueRange(InputPartition):
    """One Spark task: records ``[start, end)`` of one queue, and all a task needs to read them
    (the reader object on executors is a stale pickled copy)."""

    wire: _wire.WireConfig
    topic: str
    queue: int
    start: int
    end: int
    tags: str
    fail_on_data_loss: bool
    include_properties: bool
    fetch_max_bytes: int
    read_committed: bool = True
    retry_timeout_s: float = READ_RETRY_S


def plan_ranges(opts: SourceOptions, start: QueueOffsets, end: QueueOffsets) -> list[QueueRange]:
    """Split ``[start, end)`` per queue into tasks (``minPartitions``, ``maxRecordsPerPartition``).
    Queues with nothing to read, or whose end is before their start, get no task."""
    sizes = {tq: end[tq] - start.get(tq, end[tq]) for tq in end}
    total = sum(n for n in sizes.values() if n > 0)
    out: list[QueueRange] = []
    for tq in sorted(end):
        n = sizes[tq]
        if n <= 0:
            continue
        pieces = 1
        if opts.min_partitions and total:
            pieces = max(1, round(opts.min_partitions * n / total))
        for a, b in split_range(start[tq], end[tq], pieces, opts.max_records_per_partition):
            out.append(QueueRange(opts.wire, tq[0], tq[1], a, b, opts.tags,
                                  opts.fail_on_data_loss, opts.include_properties,
                                  opts.fetch_max_bytes, opts.read_committed,
                                  opts.retry_timeout_s))
    return out


# --- executor side -------------------------------------------------------------------------


def read_range(part: QueueRange) -> Iterator[pa.RecordBatch]:
    """Fetch ``[start, end)`` of one queue and yield Arrow batches (one per FETCH answer).

    The next FETCH is sent before the current answer is decoded, so the broker and the task work
    at the same time. FETCH goes to the queue's leader; a leader that goes away or moves is
    looked up again and retried for up to ``retryTimeout`` (``part.retry_timeout_s``).

    Raises:
        DataLossError: records of the range are gone and ``failOnDataLoss`` is true.
        LeaderNotAvailableError, ConnectionClosedError, ...: the last failure, after
            ``retryTimeout`` of retries (the message names the option).
    """
    schema = arrow_schema(part.include_properties)
    pos, end = part.start, part.end
    max_bytes = part.fetch_max_bytes
    router = _route.router(part.wire)
    conn: _wire.BlockingConnection | None = None

    isolation = int(m.Isolation.READ_COMMITTED if part.read_committed
                    else m.Isolation.READ_UNCOMMITTED)

    def fetch(offset: int, wait_ms: int = 0) -> int:
        assert conn is not None
        return conn.send(m.FetchRequest(wait_ms, 1, max_bytes,
                                        [(part.topic, part.queue, offset, max_bytes, part.tags)],
                                        isolation))

    def lost(a: int, b: int, why: str) -> None:
        what = f"{part.topic}/{part.queue} offsets {a}..{b - 1} ({why})"
        if part.fail_on_data_loss:
            raise DataLossError(f"data lost before it was read: {what}; "
                                "set failOnDataLoss=false to skip it")
        log.warning("skipping lost data: %s", what)

    corr: int | None = None
    window = _route.RetryWindow(f"fetch of {part.topic}/{part.queue}", part.retry_timeout_s)

    def reroute(exc: FerryMQError) -> None:
        """The leader went away or moved: ask who leads now (raise past ``retryTimeout``)."""
        nonlocal conn, corr
        conn = corr = None
        window.failed(exc)
        time.sleep(0.2)
        router.refresh_quietly({part.topic})

    try:
        while pos < end:
            try:
                if conn is None:
                    conn = router.connection(part.topic, part.queue)
                    if conn is None:
                        raise router.no_route(part.topic, part.queue)
                if corr is None:
                    corr = fetch(pos)
                resp = conn.receive(corr, m.FetchResponse)
            except (ConnectionClosedError, FerryMQTimeoutError, LeaderNotAvailableError) as exc:
                reroute(exc)
                continue
            corr = None
            _t, _q, code, msg, hw, _log_start, topic_id, data = resp.results[0][:8]
            if code in STALE_VIEW_CODES:
                reroute(error_for_code(code, f"fetch {part.topic}/{part.queue} at {pos}: {msg}"))
                continue
            if code:
                if code == ErrorCode.OFFSET_OUT_OF_RANGE:
                    tq = [(part.topic, part.queue)]
                    first = list_offsets(part.wire, tq, EARLIEST,
                                         retry_s=part.retry_timeout_s)[tq[0]]
                    if pos < first:
                        lost(pos, min(first, end), "removed by retention")
                        pos = min(first, end)
                        continue
                    last = list_offsets(part.wire, tq, LATEST,
                                        retry_s=part.retry_timeout_s)[tq[0]]
                    lost(pos, end, f"the queue now ends at {last}")
                    return
                err = error_for_code(code, f"fetch {part.topic}/{part.queue} at {pos}: {msg}")
                if not err.retriable:
                    raise err
                window.failed(err)  # the leader is busy: the same one, a moment later
                time.sleep(0.1)
                continue
            window.succeeded()
            raw = data if isinstance(data, bytes) else bytes(data)
            committed = None
            if part.read_committed:
                aborted = [a for t, q, _lso, ab in resp.txn if (t, q) == (part.topic, part.queue)
                           for a in ab]
                committed = ReadCommittedFilter(aborted)
            chunk = scan(raw, pos, committed=committed)
            if chunk.next_offset <= pos:  # no batch at or after pos
                if hw <= pos:
                    lost(pos, end, f"the queue now ends at {hw}")
                    return
                corr = fetch(pos, wait_ms=200)
                continue
            if chunk.first_offset > pos:
                lost(pos, min(chunk.first_offset, end), "missing from the log")
            nxt = chunk.next_offset
            if nxt < end:
                corr = fetch(nxt)  # overlaps the broker's work with the decoding below
            batch = to_record_batch(chunk, part.topic, part.queue, topic_id, pos, end, schema)
            pos = nxt
            if batch is not None:
                yield batch
    finally:
        if corr is not None and conn is not None:  # stopped early: an answer is still coming
            conn.close()


# --- the readers ---------------------------------------------------------------------------


class FerryMQBatchReader(DataSourceReader):
    """``spark.read.format("ferrymq")``: one offset or time range, read once."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.opts = SourceOptions.parse(options, streaming=False)

    def partitions(self) -> Sequence[InputPartition]:
        opts = self.opts
        queues = sorted(resolve_queues(opts))
        start = check_data_loss(opts, resolve_start(opts, queues))
        latest = list_offsets(opts.wire, queues, LATEST, committed=opts.read_committed,
                              retry_s=opts.retry_timeout_s)
        if opts.ending == "latest":
            end = latest
        else:
            assert isinstance(opts.ending, dict)
            end = {tq: latest[tq] if opts.ending.get(tq, LATEST) == LATEST
                   else min(opts.ending[tq], latest[tq]) for tq in queues}
        return plan_ranges(opts, start, end)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, QueueRange)
        return read_range(partition)


class FerryMQStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("ferrymq")``: micro-batches of offset ranges.

    Offsets (see :mod:`ferrymq.spark.offsets`) carry each batch's start, so a batch replayed
    after a restart reads what it was planned with even when ``initialOffset()`` (called again
    by Spark) resolves ``latest`` or ``committed`` differently now.
    """

    def __init__(self, options: Mapping[str, str]) -> None:
        self.opts = SourceOptions.parse(options, streaming=True)
        self._target: QueueOffsets | None = None
        self._latest: QueueOffsets | None = None
        self._last_end: dict[str, Any] | None = None
        self._last_trigger = time.monotonic()
        resolve_queues(self.opts)  # fail at start: unreachable broker, missing topic

    def initialOffset(self) -> dict[str, Any]:
        queues = resolve_queues(self.opts)
        start = check_data_loss(self.opts, resolve_start(self.opts, sorted(queues)))
        return to_json_dict(start)

    def getDefaultReadLimit(self) -> Any:
        if self.opts.max_offsets_per_trigger and ReadMaxRows is not None:
            return ReadMaxRows(self.opts.max_offsets_per_trigger)
        return ReadAllAvailable() if ReadAllAvailable is not None else None

    def prepareForTriggerAvailableNow(self) -> None:
        queues = resolve_queues(self.opts)
        self._target = list_offsets(self.opts.wire, sorted(queues), LATEST,
                                    committed=self.opts.read_committed,
                                    retry_s=self.opts.retry_timeout_s)

    def _available(self) -> QueueOffsets:
        if self._target is not None:
            return dict(self._target)
        queues = resolve_queues(self.opts, retry=True)  # between micro-batches
        return list_offsets(self.opts.wire, sorted(queues), LATEST,
                            committed=self.opts.read_committed, retry_s=self.opts.retry_timeout_s)

    def latestOffset(self, start: dict[str, Any] | None = None, limit: Any = None) -> dict[str, Any]:
        if start is None:  # Spark < 4.2: no admission control
            start = self._last_end if self._last_end is not None else self.initialOffset()
        begin = from_json_dict(start)
        latest = self._available()
        self._latest = latest
        new = sorted(tq for tq in latest if tq not in begin)
        if new:  # queues (or topics) that appeared since: from their first offset
            begin.update(list_offsets(self.opts.wire, new, EARLIEST,
                                      retry_s=self.opts.retry_timeout_s))
        if ReadMaxRows is not None and isinstance(limit, ReadMaxRows):
            end = cap_offsets(begin, latest, limit.max_rows)
        else:
            end = dict(latest)
        for tq, off in begin.items():  # never move backwards (a queue gone from the listing)
            end[tq] = max(end.get(tq, off), off)
        backlog = sum(end[tq] - begin[tq] for tq in end)
        if backlog == 0 and not new:
            return start
        min_rows = self.opts.min_offsets_per_trigger
        if min_rows and self._target is None and backlog < min_rows:
            waited_ms = (time.monotonic() - self._last_trigger) * 1000
            if waited_ms < self.opts.max_trigger_delay_ms:
                return start  # not enough yet: skip this trigger
        self._last_trigger = time.monotonic()
        self._last_end = to_json_dict(end, start=begin)
        return self._last_end

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return to_json_dict(self._latest) if self._latest is not None else None

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        begin = batch_start(end)
        if begin is None:
            begin = from_json_dict(start)
        stop = from_json_dict(end)
        missing = sorted(tq for tq in stop if tq not in begin)
        if missing:
            begin.update(list_offsets(self.opts.wire, missing, EARLIEST,
                                      retry_s=self.opts.retry_timeout_s))
        return plan_ranges(self.opts, begin, stop)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, QueueRange)
        return read_range(partition)

    def commit(self, end: dict[str, Any]) -> None:
        group = self.opts.commit_to_group
        if not group:
            return
        entries = [(t, q, off) for (t, q), off in sorted(from_json_dict(end).items())]
        try:
            _route.router(self.opts.wire).group_request(
                group, m.CommitOffsetsRequest(group, "", -1, entries), m.CommitOffsetsResponse,
                timeout_s=self.opts.retry_timeout_s)
        except FerryMQError as exc:  # monitoring only: never fail the query for it
            log.warning("commitToGroup %s failed: %s", group, exc)

    def stop(self) -> None:
        _route.forget(self.opts.wire)


# --- the data source -----------------------------------------------------------------------


class FerryMQDataSource(DataSource):
    """``format("ferrymq")``: read FerryMQ topics as tables or streams, write rows to topics."""

    @classmethod
    def name(cls) -> str:
        return DATA_SOURCE_NAME

    def schema(self) -> str:
        opts = options_dict(self.options)
        if any(k in opts for k in ("subscribe", "subscribepattern", "assign")):
            SourceOptions.parse({k: v for k, v in opts.items() if k != "endingoffsets"},
                                streaming=True)
        include = opts.get("includeproperties", "false").strip().lower() in ("true", "1", "yes")
        return source_ddl(include)

    def reader(self, schema: StructType) -> DataSourceReader:
        _check_user_schema(schema, self.options)
        return FerryMQBatchReader(options_dict(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        _check_user_schema(schema, self.options)
        return FerryMQStreamReader(options_dict(self.options))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceArrowWriter:
        from ferrymq.spark.sink import FerryMQBatchWriter

        return FerryMQBatchWriter(options_dict(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamArrowWriter:
        from ferrymq.spark.sink import FerryMQStreamWriter

        return FerryMQStreamWriter(options_dict(self.options), schema)


def _check_user_schema(schema: StructType, options: Mapping[str, str]) -> None:
    include = str(options.get("includeproperties", "false")).strip().lower() in ("true", "1", "yes")
    expected = source_ddl(include)
    names = [f.name for f in schema.fields]
    want = [part.strip().split(" ")[0] for part in expected.split(", ")]
    if names != want:
        raise ConfigError(f"the ferrymq source has a fixed schema ({expected}); "
                          f"do not pass .schema(...) (got columns {names})")
