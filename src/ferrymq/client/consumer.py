"""The asyncio pull consumer: offsets, long polling, group membership, commits, seeks.

Theory of operation
-------------------
The consumer holds two offsets per assigned queue: the *fetch position* (next offset to ask the
broker for) and the *position* (next offset to hand to the application). One FETCH covering every
assigned queue is in flight at a time; the broker holds it until data arrives (long polling). As
soon as messages are handed out and the buffer runs low, the next fetch starts, so the network
overlaps the application's work. ``commit()`` stores positions: everything before them counts as
consumed by the group.

What auto-commit stores (at-least-once): a batch counts as *finished* when the application calls
``poll()`` again. Each queue also has a *finished position*, set to its position when ``poll()``
is entered, and to the new offset by a seek, a reset or an explicit commit. Auto-commits (every
``auto_commit_interval_s`` inside ``poll()``, before a rebalance, in ``close()`` and so on leaving
a ``with`` block, cleanly or on an exception such as Ctrl-C) store finished positions only, so
the batch the application was working on when it stopped is read again by the group, never
skipped. ``commit()`` without arguments stores everything returned so far: the application says
it is done with it.

With ``subscribe`` the broker assigns queues (see ``broker/consumer_groups.py``); a heartbeat task keeps
the membership alive and, when the group rebalances, the consumer commits what it finished
(auto-commit), rejoins and continues from the committed offsets of its new queues. With
``assign`` the application picks queues and no heartbeats are sent.

A topic that does not exist yet is waited for (``_missing_topics.py``: one warning, a metadata
check at most every second): a member joins with it anyway and the broker gives it the topic's
queues once the topic is created (the group rebalances); an assigned queue of a missing topic is
read from when its topic appears. Such a topic is read from its first message (where no offset
is committed), also with "latest": all of it is newer than the subscription.
``require_topic=True`` raises ``UnknownTopicError`` instead.

A queue with no committed offset starts at ``auto_offset_reset`` ("latest" or "earliest"), as
after an OFFSET_OUT_OF_RANGE (retention deleted the data under a committed offset).
A seek drops what was buffered for that queue; results of a fetch started before the seek are
ignored for it (a per-queue epoch).

On a cluster each queue is read from its leader (:mod:`ferrymq.client._cluster`): a fetch is
one FETCH per leader, sent together; when some answer brings messages the others are not
waited for (their queues are fetched again, from the same offsets). A queue answered with
NOT_LEADER, FENCED_LEADER_EPOCH or LEADER_NOT_AVAILABLE, or whose leader's connection was lost,
makes the leaders be refreshed and is fetched again from the same offset. Log-end and time look-ups
(LIST_OFFSETS) go to the leaders too. Group membership and committed offsets stay on the
bootstrap connection (one broker is the group coordinator today; a cluster-wide coordinator is
a later step of issue 20). A single broker is a cluster of one: one connection, one FETCH.

Where each part lives: this module is the public :class:`AsyncPullConsumer` (subscriptions and
assignments, positions, commits and seeks, the poll loop and its FETCH requests); the buffer of
fetched messages and each queue's offsets are :mod:`ferrymq.client._pull_buffer` (no I/O); the
group membership (JOIN_GROUP, the heartbeat task, LEAVE_GROUP) is
:mod:`ferrymq.client._pull_group`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from ferrymq import tracing
from ferrymq.client._cluster import SAME_BROKER_RETRY_CODES, Cluster, means_stale_view
from ferrymq.client._coordinator import CoordinatorRoute
from ferrymq.client._missing_topics import MissingTopics
from ferrymq.client._pull_buffer import FetchBuffer, QueueState
from ferrymq.client._pull_buffer import TopicQueue as TopicQueue  # re-exported: its old home
from ferrymq.client._pull_group import GroupMembership
from ferrymq.client._session import Auth, Session, TLSOption
from ferrymq.client.message import ReceivedMessage
from ferrymq.errors import (
    BrokerError,
    ClientError,
    ConfigError,
    ConnectionClosedError,
    FerryMQError,
    FerryMQTimeoutError,
    IllegalGenerationError,
    LeaderNotAvailableError,
    RebalanceInProgressError,
    UnknownMemberError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.messages import Isolation, OffsetSpec
from ferrymq.protocol.tags import parse_tag_expression

log = logging.getLogger("ferrymq.client")
# Group-fencing errors are "retriable" only after a rejoin: never resend the same commit blindly.
_COMMIT_RETRY = frozenset({ErrorCode.BROKER_SHUTTING_DOWN, ErrorCode.STORAGE_ERROR,
                           ErrorCode.REQUEST_TIMED_OUT, ErrorCode.BUSY})
DEFAULT_FETCH_MAX_BYTES = 4 * 1024 * 1024
MAX_POLL_WAIT_S = 30.0
MIN_CHECK_WAIT_S = 1.0
"""Least time poll() gives a check for awaited topics (it may outlast a shorter poll timeout)."""


class AsyncPullConsumer:
    """Pulls messages by offset, alone or as a member of a consumer group (asyncio).

    Commits are at-least-once: a batch returned by :meth:`poll` counts as finished when the
    application calls :meth:`poll` again. Auto-commit (periodic, before a rebalance, on
    :meth:`close` and on leaving ``async with``, cleanly or on an exception) stores only
    finished batches, so an interrupted loop loses nothing: the group reads the unfinished batch
    again. :meth:`commit` without arguments stores everything returned so far (call it after
    the last batch when stopping cleanly, or that batch is read again).

    Args:
        servers: ``"host:port"``, or a bootstrap list (``"h1:9876,h2:9876,h3:9876"``): each
            queue is read from its leader, found again by itself after a failover.
        group: the consumer group (offsets are committed per group).
        client_id: shown in group listings.
        auto_commit: commit finished positions every ``auto_commit_interval_s`` (checked in
            :meth:`poll`), before a rebalance and on close.
        auto_commit_interval_s: seconds between two periodic auto-commits.
        auto_offset_reset: where a queue without a committed offset starts: "latest" or
            "earliest". A topic this consumer waited for (created after :meth:`subscribe` or
            :meth:`assign`) starts at its first message either way: all of it is newer than
            the subscription.
        require_topic: :meth:`subscribe` and :meth:`assign` raise ``UnknownTopicError`` for a
            topic that does not exist (default False: wait for it to be created, logging one
            warning, checking at most every second).
        fetch_max_bytes: bytes asked for per fetch (over all queues).
        queue_fetch_max_bytes: bytes asked for per queue per fetch.
        session_timeout_s: the broker drops a member silent this long.
        heartbeat_interval_s: how often a member heartbeats.
        request_timeout_s: deadline of one request.
        connect_timeout_s: how long the first connection may take (the constructor of the
            blocking ``PullConsumer`` fails after it with ``ConnectionClosedError("cannot
            connect to HOST:PORT (connection refused) ...")``), and the longest single attempt
            later.
        reconnect_timeout_s: after a connection was lost, how long to keep trying to reconnect
            before the waiting request fails (one warning is logged per outage).
        isolation: "read_committed" (default): only messages of committed transactions, up to
            the last stable offset; "read_uncommitted": everything written, aborted
            transactions too (never the transaction markers).
    """

    def __init__(
        self,
        servers: str | list[str] = "127.0.0.1:9876",
        group: str = "default",
        *,
        client_id: str = "ferrymq-consumer",
        auto_commit: bool = True,
        auto_commit_interval_s: float = 5.0,
        auto_offset_reset: str = "latest",
        fetch_max_bytes: int = DEFAULT_FETCH_MAX_BYTES,
        queue_fetch_max_bytes: int = DEFAULT_FETCH_MAX_BYTES,
        session_timeout_s: float = 15.0,
        heartbeat_interval_s: float = 3.0,
        request_timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        reconnect_timeout_s: float = 60.0,
        require_topic: bool = False,
        isolation: str = "read_committed",
        auth: Auth | None = None,
        tls: TLSOption = None,
    ) -> None:
        if auto_offset_reset not in ("latest", "earliest"):
            raise ConfigError("auto_offset_reset must be 'latest' or 'earliest'")
        if isolation not in ("read_committed", "read_uncommitted"):
            raise ConfigError("isolation must be 'read_committed' or 'read_uncommitted', not "
                              f"{isolation!r}")
        self._isolation = (Isolation.READ_COMMITTED if isolation == "read_committed"
                           else Isolation.READ_UNCOMMITTED)
        if fetch_max_bytes <= 0 or queue_fetch_max_bytes <= 0:
            raise ConfigError("fetch sizes must be > 0")
        self.group = group
        self._session = Session(servers, client_id=client_id, request_timeout_s=request_timeout_s,
                                connect_timeout_s=connect_timeout_s,
                                reconnect_timeout_s=reconnect_timeout_s,
                                auth=auth, tls=tls)
        self._cluster = Cluster(self._session)
        self._require_topic = require_topic
        self._missing = MissingTopics(self._session)
        self._auto_commit = auto_commit
        self._auto_commit_interval_s = auto_commit_interval_s
        self._reset = OffsetSpec.LATEST if auto_offset_reset == "latest" else OffsetSpec.EARLIEST
        self._fetch_max_bytes = fetch_max_bytes
        self._queue_fetch_max_bytes = queue_fetch_max_bytes
        self._coordinator = CoordinatorRoute(self._cluster, group)
        self._membership = GroupMembership(self._coordinator, group, client_id,
                                           int(session_timeout_s * 1000), heartbeat_interval_s)
        self._subscriptions: dict[str, str] = {}
        self._manual: list[TopicQueue] | None = None
        self._queues: dict[TopicQueue, QueueState] = {}
        self._buffer = FetchBuffer()
        self._fetch: asyncio.Task[None] | None = None
        self._last_commit = 0.0
        self._committed_positions: dict[TopicQueue, int] = {}
        self._closed = False
        self._started = False

    @property
    def _member_id(self) -> str:
        """The member id in the group ("": not a member); a transaction's offsets name it."""
        return self._membership.member_id

    @property
    def _generation(self) -> int:
        """The group generation this member joined (-1: none)."""
        return self._membership.generation

    # -- subscription ------------------------------------------------------------------------

    async def start(self) -> AsyncPullConsumer:
        """Connect to the broker."""
        await self._session.connection()
        self._started = True
        self._last_commit = asyncio.get_running_loop().time()
        return self

    async def __aenter__(self) -> AsyncPullConsumer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def subscribe(self, topic: str, tags: str = "*") -> None:
        """Consume ``topic`` (messages matching ``tags``) as a member of the group; queues are
        spread over the group's members. A topic that does not exist yet is waited for (one
        warning; its queues come once it is created) unless ``require_topic=True``.

        Raises:
            UnknownTopicError: the topic does not exist and ``require_topic=True``.
            InvalidTopicNameError: no topic can have this name.
            InvalidRequestError: a malformed tag expression.
        """
        if self._manual is not None:
            raise ClientError("assign() and subscribe() cannot be mixed")
        parse_tag_expression(tags)
        waiting = not await self._missing.check(topic, require=self._require_topic)
        before = self._subscriptions.get(topic)
        self._subscriptions[topic] = tags
        self._membership.need_join = True
        try:
            await self._join()
        except BaseException:  # refused (e.g. max_member_topics): not subscribed after all
            if before is None:
                del self._subscriptions[topic]
                if waiting:
                    self._missing.discard(topic)
            else:
                self._subscriptions[topic] = before
            raise

    async def assign(self, queues: list[TopicQueue]) -> None:
        """Consume exactly these queues, outside group membership (no rebalancing). Queues of
        a topic that does not exist yet are read once it is created (one warning) unless
        ``require_topic=True``.

        Raises:
            UnknownTopicError: a topic does not exist and ``require_topic=True``.
            InvalidTopicNameError: no topic can have this name.
        """
        if self._subscriptions:
            raise ClientError("assign() and subscribe() cannot be mixed")
        for topic in sorted({t for t, _ in queues}):
            await self._missing.check(topic, require=self._require_topic)
        self._manual = list(queues)
        self._set_assignment([tq for tq in self._manual if tq[0] not in self._missing])

    def assignment(self) -> list[TopicQueue]:
        """The queues this consumer reads now."""
        return sorted(self._queues)

    def _set_assignment(self, queues: list[TopicQueue]) -> None:
        old = self._queues
        self._queues = {tq: old.get(tq) or QueueState() for tq in queues}
        for st in self._queues.values():
            st.epoch += 1
        self._buffer.drop(self._queues, lambda tq: tq not in self._queues)

    async def _join(self) -> None:
        if self._auto_commit and self._membership.generation >= 0:
            with contextlib.suppress(FerryMQError):
                await self._commit_finished()
        assignment = await self._membership.join(sorted(self._subscriptions))
        # positions come from the committed offsets: they may have moved (reset-offset)
        self._set_assignment(assignment)
        for st in self._queues.values():
            st.position = st.fetch_position = st.finished = None
            st.buffered = 0
        self._buffer.clear()
        self._membership.start_heartbeat()

    # -- positions -----------------------------------------------------------------------------

    async def _resolve_positions(self) -> None:
        missing = [tq for tq, st in self._queues.items() if st.position is None]
        if not missing:
            return
        committed = {}
        if self.group:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._session.request_timeout_s
            while True:
                resp = await self._coordinator.request(
                    m.FetchOffsetsRequest(self.group, sorted({t for t, _ in missing})),
                    m.FetchOffsetsResponse,
                )
                # offsets sent in a transaction still open may be about to move: wait for it
                unstable = set(resp.unstable).intersection(missing)
                if not unstable or loop.time() >= deadline:
                    break
                log.info("group %s: offsets of %s pending in a transaction; waiting",
                         self.group, sorted(unstable))
                await asyncio.sleep(0.1)
            committed = {(t, q): o for t, q, o in resp.offsets}
        unresolved = []
        for tq in missing:
            st = self._queues[tq]
            if tq in committed:
                st.position = st.fetch_position = st.finished = committed[tq]
                self._committed_positions[tq] = committed[tq]
            else:
                unresolved.append(tq)
        waited = [tq for tq in unresolved if tq[0] in self._missing.waited]
        if waited:  # created after the subscription: all of it is new to this consumer
            await self._reset_to(waited, OffsetSpec.EARLIEST)
        rest = [tq for tq in unresolved if tq[0] not in self._missing.waited]
        if rest:
            await self._reset_to(rest, self._reset)

    async def _reset_to(self, queues: list[TopicQueue], spec: int) -> None:
        if not queues:
            return
        for t, q, off in await self._list_offsets(queues, spec):
            st = self._queues.get((t, q))
            if st is not None:
                st.position = st.fetch_position = st.finished = off
                st.epoch += 1
        wanted = set(queues)
        self._buffer.drop(self._queues, wanted.__contains__)

    async def _list_offsets(self, queues: list[TopicQueue], spec: int
                            ) -> list[tuple[str, int, int]]:
        """LIST_OFFSETS of ``queues`` at ``spec``, asked of each queue's leader; a queue whose
        leader moved is asked again of the new one within the request timeout.

        Raises:
            BrokerError subclass: refused; LeaderNotAvailableError once the request timeout
                passed without a live leader.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._session.request_timeout_s
        todo = [(t, q, spec) for t, q in queues]
        out: list[tuple[str, int, int]] = []
        while todo:
            groups, unrouted = await self._cluster.split_routed(todo)
            todo = list(unrouted)
            last: BaseException = LeaderNotAvailableError(
                f"list offsets: no live leader of {', '.join(f'{t}/{q}' for t, q, _ in todo)}")
            for session, entries in groups.items():
                try:
                    resp = await session.request(
                        m.ListOffsetsRequest(entries, self._isolation), m.ListOffsetsResponse,
                        retry_codes=SAME_BROKER_RETRY_CODES)
                except (ConnectionClosedError, BrokerError) as exc:
                    if not means_stale_view(exc) or (
                            session is self._session and isinstance(exc, ConnectionClosedError)):
                        raise
                    todo += entries
                    last = exc
                    continue
                for t, q, code, off in resp.results:
                    if not code:
                        out.append((t, q, off))
                        continue
                    err = error_for_code(code, f"list offsets of {t}/{q}")
                    if not means_stale_view(err):
                        raise err
                    todo.append((t, q, spec))
                    last = err
            if todo:
                if loop.time() >= deadline:
                    raise last
                await self._cluster.await_refresh(t for t, _, _ in todo)  # paced
        return out

    def position(self) -> dict[TopicQueue, int]:
        """Next offset to be returned, per assigned queue (resolved ones)."""
        return {tq: st.position for tq, st in self._queues.items() if st.position is not None}

    def high_watermarks(self) -> dict[TopicQueue, int]:
        """The high watermark each assigned queue's leader reported in its last fetch answer
        (queues not fetched yet are left out): the end of what is committed there, so
        ``high_watermarks()[tq] - position()[tq]`` is this consumer's lag (Kafka's
        ``currentLag``)."""
        return {tq: st.high_watermark for tq, st in self._queues.items()
                if st.high_watermark >= 0}

    async def committed(self) -> dict[TopicQueue, int]:
        """The group's committed offsets for the assigned queues."""
        topics = sorted({t for t, _ in self._queues}) or None
        resp = await self._coordinator.request(m.FetchOffsetsRequest(self.group, topics),
                                               m.FetchOffsetsResponse)
        return {(t, q): o for t, q, o in resp.offsets if (t, q) in self._queues}

    async def commit(self, offsets: dict[TopicQueue, int] | None = None) -> None:
        """Commit everything :meth:`poll` returned so far (its positions), or the given offsets
        (the next offset to consume per queue). Either counts as finished for auto-commit too.

        Raises:
            IllegalGenerationError: the group rebalanced: these queues may belong to another
                member now (rejoin happens on the next poll).
        """
        if offsets is None:
            offsets = self._uncommitted(lambda st: st.position)
        for tq, off in offsets.items():
            st = self._queues.get(tq)
            if st is not None:
                st.finished = off
        await self._store_offsets(offsets)

    async def _commit_finished(self) -> None:
        """Auto-commit: store the finished positions (see the module docstring)."""
        await self._store_offsets(self._uncommitted(lambda st: st.finished))

    def _uncommitted(self, pick: Callable[[QueueState], int | None]) -> dict[TopicQueue, int]:
        out: dict[TopicQueue, int] = {}
        for tq, st in self._queues.items():
            off = pick(st)
            if off is not None and self._committed_positions.get(tq) != off:
                out[tq] = off
        return out

    async def _store_offsets(self, offsets: dict[TopicQueue, int]) -> None:
        if not offsets:
            return
        generation = self._membership.generation if self._subscriptions else -1
        try:
            resp = await self._coordinator.request(
                m.CommitOffsetsRequest(self.group, self._membership.member_id, generation,
                                       [(t, q, o) for (t, q), o in offsets.items()]),
                m.CommitOffsetsResponse,
                retry_codes=_COMMIT_RETRY,
            )
        except (UnknownMemberError, IllegalGenerationError) as exc:
            # the next poll rejoins at once (Kafka's consumer too), not after a heartbeat
            if isinstance(exc, UnknownMemberError):
                self._membership.member_id = ""
            self._membership.need_join = True
            raise
        for t, q, code in resp.results:
            if code:
                raise error_for_code(code, f"commit of {t}/{q}")
            self._committed_positions[(t, q)] = offsets[(t, q)]
        self._last_commit = asyncio.get_running_loop().time()

    async def seek(self, topic: str, queue: int, offset: int) -> None:
        """Continue ``topic``/``queue`` from ``offset`` (also what auto-commit stores for it
        until the next batch is finished)."""
        st = self._queues.get((topic, queue))
        if st is None:
            raise ClientError(f"{topic}/{queue} is not assigned to this consumer")
        st.position = st.fetch_position = st.finished = offset
        st.epoch += 1
        self._buffer.drop(self._queues, lambda tq: tq == (topic, queue))

    async def seek_to_time(self, topic: str, timestamp_ms: int) -> None:
        """Continue every assigned queue of ``topic`` from the first message stored at or after
        ``timestamp_ms`` (ms since the epoch)."""
        await self._reset_to([tq for tq in self._queues if tq[0] == topic], timestamp_ms)

    async def seek_to_beginning(self) -> None:
        """Continue every assigned queue from its first offset."""
        await self._reset_to(list(self._queues), OffsetSpec.EARLIEST)

    async def seek_to_end(self) -> None:
        """Continue every assigned queue from its end (only new messages)."""
        await self._reset_to(list(self._queues), OffsetSpec.LATEST)

    # -- polling -------------------------------------------------------------------------------

    async def poll(self, timeout: float = 1.0, max_messages: int = 500) -> list[ReceivedMessage]:
        """Messages from the assigned queues: returns as soon as some are there, or an empty
        list after ``timeout`` seconds.

        Calling it marks the messages the previous calls returned as finished: auto-commit
        (periodic here, and on rebalance and close) stores only those.

        Raises:
            ConnectionClosedError: the broker stayed unreachable beyond ``reconnect_timeout_s``.
        """
        if self._closed:
            raise ClientError("consumer is closed")
        for st in self._queues.values():
            st.finished = st.position
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout, 0.0)
        while True:
            if self._missing:  # (an outage must not hold poll() for a whole request timeout)
                await self._read_appeared_topics(max(deadline - loop.time(), MIN_CHECK_WAIT_S))
            if self._membership.need_join and self._subscriptions:
                await self._join()
            if self._buffer:
                out = self._take(max_messages)
                if tracing.ENABLED:
                    tracing.record_receive(out, self.group or None)
                await self._maybe_auto_commit()
                return out
            if self._buffer.corrupt:
                raise self._buffer.corrupt.pop(0)
            await self._resolve_positions()
            remaining = deadline - loop.time()
            if self._fetch is None or self._fetch.done():
                if self._fetch is not None:
                    self._fetch_result()
                    if self._buffer:
                        continue
                if not self._queues:
                    if remaining <= 0:
                        return []
                    await asyncio.sleep(min(remaining, 0.1))
                    continue
                self._fetch = loop.create_task(self._do_fetch(min(max(remaining, 0), MAX_POLL_WAIT_S)))
            if remaining <= 0:
                await self._maybe_auto_commit()
                return []
            done, _ = await asyncio.wait({self._fetch}, timeout=remaining)
            if done:
                self._fetch_result()
            if not self._buffer and loop.time() >= deadline:
                await self._maybe_auto_commit()
                return []

    def _fetch_result(self) -> None:
        fut = self._fetch
        if fut is None or not fut.done():
            return
        self._fetch = None
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            if isinstance(exc, (ConnectionClosedError, FerryMQTimeoutError)):
                log.debug("fetch failed (%s); will retry", exc)  # the session logs outages
                return
            raise exc

    def _take(self, n: int) -> list[ReceivedMessage]:
        out = self._buffer.take(n, self._queues)
        if (self._fetch is None or self._fetch.done()) and self._queues and (
                not self._buffer or self._buffer.pending() < n):
            # fewer than one more poll's worth is buffered: prefetch while the application works
            if self._fetch is not None:
                self._fetch_result()
            if self._fetch is None:
                self._fetch = asyncio.get_running_loop().create_task(self._do_fetch(0.0))
        return out

    async def _do_fetch(self, wait_s: float) -> None:
        entries: list[m.FetchEntry] = []
        epochs = {}
        for (topic, queue), st in self._queues.items():
            if st.fetch_position is None:
                continue
            entries.append((topic, queue, st.fetch_position, self._queue_fetch_max_bytes,
                            self._subscriptions.get(topic, "*")))
            epochs[(topic, queue)] = st.epoch
        if not entries:
            return
        groups, unrouted = self._cluster.split(entries)
        if unrouted:
            groups, unrouted = await self._cluster.split_routed(entries)
            if not groups:  # no queue has a live leader now: a failover is under way
                await asyncio.sleep(self._session.backoff.delay(1))
                return
        if len(groups) == 1:  # one broker (or all the queues led by one): one FETCH
            [(session, some)] = groups.items()
            await self._fetch_from(session, some, wait_s, epochs)
            return
        tasks = [asyncio.ensure_future(self._fetch_from(s, some, wait_s, epochs))
                 for s, some in groups.items()]
        try:
            # as soon as one leader's answer brought messages, the others are not waited for
            # (their queues are fetched again from the same offsets)
            pending: set[asyncio.Future[None]] = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()
                if self._buffer:
                    break
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
            for t in tasks:
                with contextlib.suppress(BaseException):
                    await t

    async def _fetch_from(self, session: Session, entries: list[m.FetchEntry], wait_s: float,
                          epochs: dict[TopicQueue, int]) -> None:
        """One FETCH of ``entries`` from their leader's ``session``; its messages go into the
        buffer (of queues neither sought nor reassigned meanwhile: ``epochs``)."""
        req = m.FetchRequest(int(wait_s * 1000), 1, self._fetch_max_bytes, entries,
                             self._isolation)
        try:
            resp = await session.request(req, m.FetchResponse,
                                         timeout_s=wait_s + session.request_timeout_s,
                                         retry_codes=SAME_BROKER_RETRY_CODES)
        except ConnectionClosedError:
            topics = {e[0] for e in entries}
            if session is self._session:  # it reconnects (one broker restarting, or another)
                self._cluster.refresh_soon(topics)
                await asyncio.sleep(session.backoff.delay(1))
            else:  # a leader lost: ask who leads now
                await self._cluster.await_refresh(topics)
            raise
        except BrokerError as exc:
            if not means_stale_view(exc):
                raise
            # fetched again, from the same offsets, from the leader the refresh names
            await self._cluster.await_refresh({e[0] for e in entries})
            return
        reset: list[TopicQueue] = []
        stale: set[str] = set()
        aborted = {(t, q): ab for t, q, _lso, ab in resp.txn if ab}
        for topic, queue, code, msg, hw, _start, topic_id, data in resp.results:
            qst = self._queues.get((topic, queue))
            if qst is None or epochs.get((topic, queue)) != qst.epoch:
                continue  # reassigned or sought meanwhile
            if code:
                if code == ErrorCode.OFFSET_OUT_OF_RANGE:
                    log.warning("%s/%d: %s; resetting to %s", topic, queue, msg, self._reset.name)
                    reset.append((topic, queue))
                    continue
                err = error_for_code(code, msg)
                if means_stale_view(err):  # the leader moved: fetch again from the same offset
                    stale.add(topic)
                    continue
                if isinstance(err, BrokerError) and err.retriable:
                    continue
                raise err
            qst.topic_id = topic_id
            qst.high_watermark = hw
            if data:
                self._buffer.add_fetched(topic, queue, qst,
                                         data if isinstance(data, bytes) else bytes(data),
                                         aborted.get((topic, queue), ()))
        if reset:
            await self._reset_to(reset, self._reset)
        if stale:
            await self._cluster.await_refresh(stale)

    async def _read_appeared_topics(self, timeout_s: float) -> None:
        """Start reading the awaited topics that exist now (a rejoin gets their queues)."""
        if not await self._missing.appeared(timeout_s):
            return
        if self._subscriptions:
            self._membership.need_join = True
        elif self._manual is not None:
            self._set_assignment([tq for tq in self._manual if tq[0] not in self._missing])

    async def _maybe_auto_commit(self) -> None:
        if not self._auto_commit:
            return
        now = asyncio.get_running_loop().time()
        if now - self._last_commit >= self._auto_commit_interval_s:
            try:
                await self._commit_finished()
            except (IllegalGenerationError, UnknownMemberError, RebalanceInProgressError):
                self._membership.need_join = True
            except FerryMQError as exc:
                log.warning("auto-commit failed: %s", exc)

    async def close(self) -> None:
        """Commit the finished batches (auto-commit mode: not the batch the last :meth:`poll`
        returned, which the application may not have finished; :meth:`commit` first if it
        did), leave the group, close the connection."""
        if self._closed:
            return
        try:
            if self._auto_commit and self._started:
                with contextlib.suppress(FerryMQError):
                    await self._commit_finished()
            await self._membership.leave()
        finally:
            self._closed = True
            self._membership.closed = True
            for t in (self._membership.heartbeat, self._fetch):
                if t is not None:
                    t.cancel()
                    with contextlib.suppress(BaseException):
                        await t
            await self._cluster.close()
            await self._session.close()


