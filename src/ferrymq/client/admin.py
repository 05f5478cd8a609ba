"""The asyncio admin client: topics, groups, offsets, delivery groups, dead letters, messages by
id or key, users. The CLI is a thin layer over it.

Its answers are typed results with named fields (:mod:`ferrymq.client._admin_results`,
re-exported here), made from the broker's wire answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

from ferrymq.client._admin_cluster import ClusterAdminCalls
from ferrymq.client._admin_results import (
    BlockedKey,
    BrokerDescription,
    ClusterDescription,
    CommittedOffset,
    DeadLetter,
    DeliveryGroupDescription,
    DeliveryMember,
    DeliveryQueue,
    DeliveryStatus,
    DrainResult,
    GroupDescription,
    GroupListing,
    GroupMember,
    KeyMatch,
    KeySearch,
    MessageStatus,
    OffsetLookup,
    QueueDescription,
    QueueOffset,
    QueueReplication,
    Reassignment,
    SinkFence,
    TopicDescription,
    TopicListing,
    TxnDescription,
    TxnsDescription,
    UserInfo,
    merge_group_listings,
    merge_message_statuses,
)
from ferrymq.client._admin_users import UserAdminCalls
from ferrymq.client._cluster import SAME_BROKER_RETRY_CODES, Cluster
from ferrymq.client._coordinator import CoordinatorRoute, delivery_route
from ferrymq.client._session import Auth, Session, TLSOption
from ferrymq.client.message import BatchContext, ReceivedMessage
from ferrymq.errors import (
    ConfigError,
    FerryMQError,
    InvalidRequestError,
    OffsetOutOfRangeError,
    UnknownTopicError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.coordinator import TXN_TOPIC
from ferrymq.protocol.messages import DlqAction, OffsetSpec
from ferrymq.protocol.records import (
    ATTR_SCHEDULED,
    check_stored_batch,
    decode_msg_id,
    decode_records,
    iter_batches,
    walk_records,
)

__all__ = [
    "DLQ_PREFIX",
    "AsyncAdminClient",
    "BlockedKey",
    "BrokerDescription",
    "ClusterDescription",
    "CommittedOffset",
    "DeadLetter",
    "DeliveryGroupDescription",
    "DeliveryMember",
    "DeliveryQueue",
    "DeliveryStatus",
    "DrainResult",
    "GroupDescription",
    "GroupListing",
    "GroupMember",
    "KeyMatch",
    "KeySearch",
    "MessageStatus",
    "OffsetLookup",
    "QueueDescription",
    "QueueOffset",
    "QueueReplication",
    "Reassignment",
    "SinkFence",
    "TopicDescription",
    "TopicListing",
    "TxnDescription",
    "TxnsDescription",
    "UserInfo",
]

DLQ_PREFIX = "%DLQ%"
"""Dead letters of group ``G`` live in topic ``%DLQ%G`` (one queue)."""
"""Properties the broker adds to retry and dead letters (hidden from users)."""
DLQ_FETCH_BYTES = 1024 * 1024
"""Bytes per FETCH while listing dead letters."""
MAX_DLQ_SCAN = 100_000
"""Most dead letters :meth:`AsyncAdminClient.dlq_get` looks through for one id."""
MAX_DLQ_OFFSET = (1 << 63) - 1
"""Largest dead-letter offset a redrive or purge of one letter may name (a signed 64-bit int on
the wire)."""


class AsyncAdminClient(ClusterAdminCalls, UserAdminCalls):
    """Administrative requests to one broker.

    Args:
        servers: ``"host:port"``.
        request_timeout_s: deadline of each request.
        connect_timeout_s: how long the first connection may take (made by the first request,
            or on entering ``with``): after it, ``ConnectionClosedError`` names every address
            tried and why it failed (connection refused, timed out, name not resolved).
        reconnect_timeout_s: after a connection was lost, how long to keep trying to reconnect.
    """

    def __init__(
        self, servers: str | list[str] = "127.0.0.1:9876", *, request_timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        reconnect_timeout_s: float = 10.0,
        auth: Auth | None = None,
        tls: TLSOption = None,
    ) -> None:
        self._session = Session(servers, client_id="ferrymq-admin",
                                request_timeout_s=request_timeout_s,
                                connect_timeout_s=connect_timeout_s,
                                reconnect_timeout_s=reconnect_timeout_s,
                                auth=auth, tls=tls)
        self._cluster = Cluster(self._session)  # (a group's requests go to its coordinator)
        self._txn_route: CoordinatorRoute | None = None

    def _coordinator(self, group: str) -> CoordinatorRoute:
        return CoordinatorRoute(self._cluster, group)

    def _txn_coordinator(self) -> CoordinatorRoute:
        """Where transaction requests go (on a cluster: the leader of ``%TXN%state``)."""
        if self._txn_route is None:
            self._txn_route = CoordinatorRoute(self._cluster, "", TXN_TOPIC)
        return self._txn_route

    def _delivery(self, group: str) -> CoordinatorRoute:
        return delivery_route(self._cluster, group)

    async def __aenter__(self) -> AsyncAdminClient:
        await self._session.connection()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection."""
        await self._cluster.close()
        await self._session.close()

    async def hello(self) -> m.HelloResponse:
        """The broker's version and limits."""
        await self._session.connection()
        assert self._session.hello is not None
        return self._session.hello

    async def whoami(self) -> m.WhoAmIResponse:
        """The user this client authenticated as and its rights (``""`` and admin when the
        broker has authentication off)."""
        return await self._session.request(m.WhoAmIRequest(), m.WhoAmIResponse)

    async def create_topic(self, name: str, queues: int = 4,
                           config: dict[str, str] | None = None, *, replicas: int | None = None,
                           min_insync: int | None = None) -> m.CreateTopicResponse:
        """Create a topic (config keys: retention_ms, retention_bytes, segment_bytes,
        segment_ms, dedup_window_ms).

        Args:
            replicas: on a cluster, copies of each queue, on as many brokers (None: the
                brokers' ``default_replicas``: 1 on a one-broker cluster, else up to 3). A
                single broker keeps one copy whatever is asked.
            min_insync: in-sync replicas a send with ``acks="all"`` needs (None: the brokers'
                ``default_min_insync``); with fewer, such sends get the retriable
                ``NotEnoughReplicasError``.

        Raises:
            ConfigError: ``replicas`` or ``min_insync`` below 1, or ``min_insync`` above
                ``replicas`` (nothing is sent).
            InvalidReplicationFactorError: more replicas than live brokers.
            TopicExistsError, InvalidTopicNameError, ...: refused by the broker.
        """
        for what, value in (("replicas", replicas), ("min_insync", min_insync)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigError(f"{what} must be an integer >= 1, not {value!r}")
        if replicas is not None and min_insync is not None and min_insync > replicas:
            raise ConfigError(f"min_insync ({min_insync}) cannot exceed replicas ({replicas}): "
                              f"acks=\"all\" sends could never be acknowledged")
        req = m.CreateTopicRequest(name, queues, config or {},
                                   -1 if replicas is None else replicas,
                                   -1 if min_insync is None else min_insync)
        return await self._session.request(req, m.CreateTopicResponse, retry=False)

    async def delete_topic(self, name: str) -> None:
        """Delete a topic and its data."""
        await self._session.request(m.DeleteTopicRequest(name), m.Empty, retry=False)

    async def list_topics(self) -> list[TopicListing]:
        """(name, topic id, queues, error code, dedup window ms) of every topic."""
        resp = await self._session.request(m.MetadataRequest(None, False), m.MetadataResponse)
        return [TopicListing._make(t) for t in resp.topics]

    async def describe_topic(self, name: str) -> TopicDescription:
        """Per-queue offsets and sizes."""
        return TopicDescription.from_wire(
            await self._session.request(m.DescribeTopicRequest(name), m.DescribeTopicResponse))

    async def describe_topic_from_leaders(self, name: str) -> TopicDescription:
        """As :meth:`describe_topic`, with each queue's offsets and size as its leader reports
        them: on a cluster the broker asked holds only the queues it has a replica of (and a
        follower's end may lag), so every other broker leading a queue of the topic is asked
        too (one DESCRIBE_TOPIC each, together). A single broker: one request.

        Raises:
            UnknownTopicError: no such topic.
        """
        desc = await self.describe_topic(name)
        await self._cluster.ensure(name)
        asked: dict[Session, list[int]] = {}
        for q in desc.queues:
            leader = self._cluster.route(name, q.queue)
            if leader is not None and leader is not self._session:
                asked.setdefault(leader, []).append(q.queue)
        if not asked:
            return desc
        answers = await asyncio.gather(*(
            s.request(m.DescribeTopicRequest(name), m.DescribeTopicResponse) for s in asked))
        rows = {q.queue: q for q in desc.queues}
        for queues, resp in zip(asked.values(), answers, strict=True):
            theirs = {row[0]: QueueDescription._make(row) for row in resp.queues}
            rows.update((q, theirs[q]) for q in queues if q in theirs)
        return dataclasses.replace(desc, queues=[rows[q.queue] for q in desc.queues])

    async def list_groups(self) -> list[GroupListing]:
        """(group, state, members) of every group, sorted: consumer groups with their
        rebalance state, delivery groups with state ``DELIVERY`` (a name used by both is
        listed twice).

        On a cluster every live broker is asked and the answers merged, as Kafka's admin
        client does: a consumer group is listed by its coordinator, a delivery group by each
        broker it has members on (its members counted together).

        Raises:
            FerryMQError: a broker did not answer (the list would be partial).
        """
        sessions = await self._cluster.every_broker()
        answers = await asyncio.gather(*(
            s.request(m.ListGroupsRequest(), m.ListGroupsResponse) for s in sessions))
        return merge_group_listings([GroupListing._make(g) for a in answers for g in a.groups])

    async def describe_group(self, group: str) -> GroupDescription:
        """Members, assignment, committed offsets and lag."""
        return GroupDescription.from_wire(
            await self._coordinator(group).request(m.DescribeGroupRequest(group),
                                                   m.DescribeGroupResponse))

    async def delete_group(self, group: str, *, delete_dlq: bool = False) -> m.DeleteGroupResponse:
        """Delete a group that has no live member: the consumer (pull) group of that name with
        its committed offsets, and the delivery (push/simple) group with its state, retry queue
        and dead-letter queue. A consumer that later uses the name starts afresh, where its
        ``auto_offset_reset`` / ``start_from`` says.

        Args:
            group: the group's name (both kinds are deleted when both exist).
            delete_dlq: also delete the delivery group's dead letters; without it a group with
                dead letters is refused (redrive or purge them first).

        Returns:
            Which kinds were deleted, and how many dead letters went with the group.

        Raises:
            NonEmptyGroupError: the group has live members (stop its consumers first), or dead
                letters and not ``delete_dlq``. Nothing was deleted.
            UnknownGroupError: no group has this name.
            AccessDeniedError: the user is not an admin.
        """
        return await self._coordinator(group).request(m.DeleteGroupRequest(group, delete_dlq),
                                                      m.DeleteGroupResponse, retry=False)

    async def reset_offsets(self, group: str, topic: str, *, to: str | int) -> list[QueueOffset]:
        """Move a group's offsets on a topic: ``to`` is "earliest", "latest", an offset (int)
        or a timestamp in ms given as ``("time", ms)`` via :meth:`reset_offsets_to_time`."""
        if to == "earliest":
            req = m.ResetOffsetsRequest(group, topic, OffsetSpec.EARLIEST, False)
        elif to == "latest":
            req = m.ResetOffsetsRequest(group, topic, OffsetSpec.LATEST, False)
        else:
            req = m.ResetOffsetsRequest(group, topic, int(to), True)
        return await self._reset_offsets(req)

    async def reset_offsets_to_time(
        self, group: str, topic: str, timestamp_ms: int
    ) -> list[QueueOffset]:
        """Move a group's offsets on a topic to the first message stored at or after a time."""
        return await self._reset_offsets(m.ResetOffsetsRequest(group, topic, timestamp_ms, False))

    async def _reset_offsets(self, req: m.ResetOffsetsRequest) -> list[QueueOffset]:
        resp = await self._coordinator(req.group).request(req, m.ResetOffsetsResponse,
                                                          retry=False)
        return [QueueOffset._make(x) for x in resp.offsets]

    async def list_offsets(self, entries: list[tuple[str, int, int]]) -> list[OffsetLookup]:
        """Offsets by spec (-1 latest, -2 earliest, or a timestamp in ms)."""
        resp = await self._session.request(m.ListOffsetsRequest(entries), m.ListOffsetsResponse)
        return [OffsetLookup._make(x) for x in resp.results]

    # -- delivery groups -------------------------------------------------------------------------

    async def describe_delivery(self, group: str) -> DeliveryGroupDescription:
        """A delivery group's members, per-queue progress and lag, retry and DLQ sizes and
        retry policy (also when no member is online).

        Raises:
            UnknownGroupError: no delivery group has this name.
        """
        return DeliveryGroupDescription.from_wire(await self._delivery(group).request(
            m.DescribeDeliveryRequest(group), m.DescribeDeliveryResponse))

    async def skip_message(self, group: str, msg_id: str) -> None:
        """Send a stuck message of an orderly group to its dead-letter queue on purpose, so its
        sharding key moves on (``ferrymq group skip``).

        Raises:
            InvalidRequestError: not a message id, or not the first pending message of its key
                in this orderly group.
            UnknownGroupError: no delivery group has this name.
        """
        await self._delivery(group).request(m.SkipMessageRequest(group, msg_id), m.Empty)

    async def message_status(self, msg_id: str) -> MessageStatus:
        """Where a message is, and its state in each delivery group that reads its topic:
        WAITING, DELIVERED (member, lease until), CONSUMED, FILTERED (its tag does not match the
        group's tag expression: never delivered), RETRYING (attempt, next at) or DEAD (reason).

        Raises:
            InvalidRequestError: not a message id, or the message is not stored (any more).
            UnknownTopicError: its topic was deleted.
            NotLeaderError: a cluster's scheduled message whose queue no broker leads now.

        On a cluster every live broker is asked and the answers merged: each answers for the
        delivery groups it coordinates, and a scheduled message's state is answered by its
        queue's leader (the others say NOT_LEADER).
        """
        req = m.MessageStatusRequest(msg_id)
        sessions = await self._cluster.every_broker()
        if len(sessions) == 1:
            return MessageStatus.from_wire(await sessions[0].request(
                req, m.MessageStatusResponse, retry_codes=SAME_BROKER_RETRY_CODES))
        # a cluster: each broker knows the delivery groups it coordinates (a scheduled
        # message's state only its queue's leader: the others answer NOT_LEADER)
        answers = await asyncio.gather(*(s.request(req, m.MessageStatusResponse,
                                                   retry_codes=SAME_BROKER_RETRY_CODES)
                                         for s in sessions), return_exceptions=True)
        ok = [a for a in answers if isinstance(a, m.MessageStatusResponse)]
        if not ok:
            first = answers[0]
            assert isinstance(first, BaseException)
            raise first
        return MessageStatus.from_wire(merge_message_statuses(ok))

    async def cancel_scheduled(self, msg_id: str) -> None:
        """Cancel a scheduled message that is not yet due (as ``Producer.cancel``).

        Raises:
            NotScheduledError: not a pending scheduled message (already delivered, already
                cancelled, or not scheduled).
            InvalidRequestError: not a message id.
        """
        await self._cluster.ask_leader(lambda s: s.request(
            m.CancelScheduledRequest(msg_id), m.Empty, retry_codes=frozenset()))

    async def get_message(self, msg_id: str) -> ReceivedMessage:
        """The message with this id, read from its queue.

        Raises:
            InvalidRequestError: not a message id.
            UnknownTopicError: no topic has the id's topic id (deleted).
            OffsetOutOfRangeError: the message is gone (retention) or was never written.
        """
        try:
            topic_id, queue, offset = decode_msg_id(msg_id)
        except ValueError:
            raise InvalidRequestError(
                f"not a message id: {msg_id[:64]!r} (28 hex digits: topic id, queue, offset)"
            ) from None
        name = next((t.name for t in await self.list_topics() if t.topic_id == topic_id), None)
        if name is None:
            raise UnknownTopicError(
                f"message {msg_id}: no topic has id {topic_id} (was it deleted?)")
        topic, queue, code, text, _end, _start, tid, data = await self._fetch_one(name, queue,
                                                                                 offset, 1)
        if code == ErrorCode.OFFSET_OUT_OF_RANGE or (code == 0 and not data):
            await self._raise_gone(msg_id, name, queue, offset)
        if code:
            raise error_for_code(code, text)
        buf = bytes(data)
        mv = memoryview(buf)
        for pos, h in iter_batches(mv):
            if not h.base_offset <= offset <= h.last_offset:
                continue
            if h.attributes & ATTR_SCHEDULED:
                raise OffsetOutOfRangeError(
                    f"message {msg_id} is a scheduled message: consumers get a copy of it (with "
                    f"property %SCHEDULED_ID={msg_id}) when it is due")
            check_stored_batch(mv, pos)
            ctx = BatchContext(topic, queue, tid, h.append_time_ms, h.first_timestamp)
            for msg in walk_records(buf, pos, h, offset, ReceivedMessage, ctx) or []:
                if msg.offset == offset:
                    return msg
        raise OffsetOutOfRangeError(
            f"message {msg_id} is gone: {name}/{queue} has no record at offset {offset}")

    async def _raise_gone(self, msg_id: str, topic: str, queue: int, offset: int) -> None:
        queues = {q: (first, end) for q, first, end, *_ in
                  (await self.describe_topic(topic)).queues}
        first, end = queues.get(queue, (0, 0))
        if offset < first:
            what = "deleted by retention"
        elif offset >= end:
            what = "beyond the end of the queue (never written)"
        else:
            what = "not readable"
        held = f"offsets {first}..{end - 1}" if end > first else "no messages"
        raise OffsetOutOfRangeError(
            f"message {msg_id} is gone: {topic}/{queue} offset {offset} is {what}; "
            f"the queue holds {held}"
        )

    async def _fetch_one(self, topic: str, queue: int, offset: int,
                         max_bytes: int) -> m.FetchResult:
        """One read of ``topic``/``queue`` from its leader (a cluster: asked again once after a
        refresh when the broker asked no longer leads it)."""
        req = m.FetchRequest(0, 0, max_bytes, [(topic, queue, offset, max_bytes, "*")])
        cluster = self._cluster
        with contextlib.suppress(FerryMQError):  # an unknown topic: the fetch says so
            await cluster.ensure(topic)
        for attempt in range(2):
            session = cluster.route(topic, queue) or self._session
            res = (await session.request(req, m.FetchResponse)).results[0]
            if attempt or res[2] not in (ErrorCode.NOT_LEADER, ErrorCode.LEADER_NOT_AVAILABLE):
                return res
            await cluster.await_refresh([topic])
        raise AssertionError("unreachable")

    # -- dead letters ------------------------------------------------------------------------

    async def dlq_list(self, group: str, limit: int = 100) -> list[DeadLetter]:
        """The oldest ``limit`` dead letters of a delivery group not yet redriven or purged.

        Raises:
            UnknownGroupError: no delivery group has this name.
        """
        live = await self._dlq_admin(group, DlqAction.REDRIVE, 1, True)
        out: list[DeadLetter] = []
        async for letter in self._dlq_scan(group, live):
            if len(out) >= limit:
                break
            out.append(letter)
        return out

    async def dlq_get(self, group: str, msg_id: str) -> DeadLetter | None:
        """The dead letter of ``group`` whose original message id (or id in the dead-letter
        queue) is ``msg_id``; None when the message is not (or no longer) dead.

        Raises:
            UnknownGroupError: no delivery group has this name.
        """
        live = await self._dlq_admin(group, DlqAction.REDRIVE, 1, True)
        found: DeadLetter | None = None
        n = 0
        async for letter in self._dlq_scan(group, live):
            if msg_id in (letter.msg_id, letter.dlq_msg_id):
                found = letter  # the newest letter of a message dead-lettered twice wins
            n += 1
            if n >= MAX_DLQ_SCAN:
                break
        return found

    async def dlq_at(self, group: str, dlq_offset: int) -> DeadLetter | None:
        """The dead letter at ``dlq_offset`` of the group's dead-letter queue (one FETCH, for
        browsing letter by letter); None when no letter is there or it was redriven or purged.

        Raises:
            UnknownGroupError: no delivery group has this name.
        """
        live = await self._dlq_admin(group, DlqAction.REDRIVE, 1, True)
        if dlq_offset < live.first or dlq_offset in live.done:
            return None
        try:
            async for letter in self._dlq_scan(group, live, dlq_offset):
                return letter if letter.dlq_offset == dlq_offset else None
        except OffsetOutOfRangeError:  # beyond the end of the dead-letter queue
            return None
        return None

    async def _dlq_scan(self, group: str, live: m.DlqAdminResponse,
                        start: int = -1) -> AsyncIterator[DeadLetter]:
        """The dead letters from ``start`` (-1: the oldest, ``live.first``), leaving out those
        redriven or purged one by one (``live.done``)."""
        topic = DLQ_PREFIX + group
        pos = live.first if start < 0 else start
        done = set(live.done)
        while True:
            _t, _q, code, text, end, start, tid, data = await self._fetch_one(topic, 0, pos,
                                                                             DLQ_FETCH_BYTES)
            if code == ErrorCode.UNKNOWN_TOPIC:
                return  # nothing was ever dead-lettered
            if code == ErrorCode.OFFSET_OUT_OF_RANGE and start > pos:
                pos = start  # retention deleted the oldest letters
                continue
            if code:
                raise error_for_code(code, text)
            if not data:
                return
            recs = [r for r in decode_records(data) if r.offset >= pos]
            if not recs:
                return
            for r in recs:
                if r.offset not in done:
                    yield DeadLetter.from_record(group, tid, r)
            pos = recs[-1].offset + 1
            if pos >= end:
                return

    async def _dlq_admin(self, group: str, action: DlqAction, max_messages: int,
                         dry_run: bool, offset: int | None = None) -> m.DlqAdminResponse:
        if offset is not None and not 0 <= offset <= MAX_DLQ_OFFSET:
            raise ConfigError(f"offset must be 0..{MAX_DLQ_OFFSET} (a dead letter's offset), "
                              f"not {offset}")
        return await self._delivery(group).request(
            m.DlqAdminRequest(group, int(action), max_messages, dry_run,
                              -1 if offset is None else offset),
            m.DlqAdminResponse, retry=dry_run,
        )

    async def dlq_redrive(self, group: str, max_messages: int = 0, dry_run: bool = False, *,
                          offset: int | None = None) -> m.DlqAdminResponse:
        """Send the oldest ``max_messages`` dead letters (0: all) back to the group, or only the
        one at ``offset`` of its dead-letter queue: they are delivered again from its retry
        queue, at once, with a fresh attempt count.

        Args:
            group: the delivery group.
            max_messages: how many of the oldest (0: all); ignored with ``offset``.
            dry_run: change nothing; the answer says what would be done.
            offset: one dead letter, by its offset in the dead-letter queue
                (:attr:`DeadLetter.dlq_offset`), wherever it is.

        Returns:
            The DLQ offsets covered (``first``, ``end``) and how many letters were (or, with
            ``dry_run``, would be) redriven.

        Raises:
            UnknownGroupError: no delivery group has this name.
            InvalidOffsetError: ``offset`` is not a dead letter now (redriven or purged
                already, below the oldest, beyond the end); nothing changed.
            UnsupportedVersionError: ``offset`` given and the broker predates it.
        """
        resp = await self._dlq_admin(group, DlqAction.REDRIVE, max_messages, dry_run, offset)
        if max_messages > 0 or offset is not None:
            return resp
        if dry_run:  # one letter per DLQ offset, less those done one by one
            done = sum(1 for o in resp.done if resp.first <= o < resp.end)
            return m.DlqAdminResponse(resp.first, resp.end,
                                      max(0, resp.end - resp.first - done), resp.done)
        first, total = resp.first, resp.count
        while resp.count and resp.end > resp.first + resp.count:  # the broker moves 10k a call
            resp = await self._dlq_admin(group, DlqAction.REDRIVE, 0, False)
            total += resp.count
        return m.DlqAdminResponse(first, resp.end, total, resp.done)

    async def dlq_purge(self, group: str, max_messages: int = 0, dry_run: bool = False, *,
                        offset: int | None = None) -> m.DlqAdminResponse:
        """Drop the oldest ``max_messages`` dead letters (0: all) of a group, or only the one
        at ``offset`` of its dead-letter queue.

        Returns:
            The DLQ offsets covered and how many letters were (or would be) dropped.

        Raises:
            UnknownGroupError: no delivery group has this name.
            InvalidOffsetError: ``offset`` is not a dead letter now; nothing changed.
            UnsupportedVersionError: ``offset`` given and the broker predates it.
        """
        return await self._dlq_admin(group, DlqAction.PURGE, max_messages, dry_run, offset)

    # -- messages by key -----------------------------------------------------------------------

    async def find_by_key(self, topic: str, key: str, limit: int = 32) -> KeySearch:
        """Messages of ``topic`` whose keys include ``key``, newest first (by stored time), at
        most ``limit`` (RocketMQ's query by key; served from the broker's key index).

        ``unindexed`` in the answer counts offsets the broker could not search yet (its
        background indexer is behind and the request's scan budget ran out); 0 means complete.

        Raises:
            UnknownTopicError, InvalidRequestError: empty key, key with NUL, bad limit.
        """
        return KeySearch.from_wire(await self._session.request(
            m.FindByKeyRequest(topic, key, limit), m.FindByKeyResponse))

    # -- exactly-once transactions ---------------------------------------------------------------

    async def commit_staged(self, sink_id: str, batch_id: int,
                            handles: Sequence[tuple[str, int, int]]) -> int:
        """Commit the staged transactions of one sink batch at once (the Spark sink driver's
        commit): ``handles`` are the tasks' :class:`~ferrymq.client.producer.StagedHandle`.
        Returns the sink's last committed batch id. Not retried blindly: a retry after a lost
        answer gets BATCH_ALREADY_COMMITTED, which means the first call committed.

        Raises:
            BatchAlreadyCommittedError: ``batch_id`` is at or below the sink's last committed
                batch: nothing was written again (the staged rows were dropped).
            StagedTxnExpiredError: a handle is no longer staged: nothing was committed.
        """
        resp = await self._txn_coordinator().request(
            m.CommitStagedRequest(sink_id, batch_id, [(h[0], h[1], h[2]) for h in handles]),
            m.CommitStagedResponse, retry=False)
        return resp.committed_batch_id

    async def abort_staged(self, sink_id: str, batch_id: int,
                           handles: Sequence[tuple[str, int, int]] = ()) -> int:
        """Abort staged transactions of one sink batch (all of them when ``handles`` is
        empty); returns how many were aborted."""
        resp = await self._txn_coordinator().request(
            m.AbortStagedRequest(sink_id, batch_id, [(h[0], h[1], h[2]) for h in handles]),
            m.AbortStagedResponse)
        return resp.aborted

    async def describe_transactions(self, transactional_id: str = "",
                                    sink_id: str = "") -> TxnsDescription:
        """Transactional ids (state, producer id and epoch, queues and groups of the open
        transaction) and sink fences (last committed batch id per sink)."""
        return TxnsDescription.from_wire(await self._txn_coordinator().request(
            m.DescribeTxnsRequest(transactional_id, sink_id), m.DescribeTxnsResponse))
