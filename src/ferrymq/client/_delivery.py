"""The client side of delivery groups, shared by the simple and push consumers.

:class:`DeliveryCore` keeps a member registered (a heartbeat task of its own, so a slow handler
never starves it), leases messages with RECEIVE, and acks, nacks and renews them.

A member registers with its first subscription, never before: the broker checks the
subscription before it creates the group, so a consumer whose start fails (a bad topic name,
no right to read it) leaves no group behind. A subscribed topic that does not exist yet is not
an error (unless ``require_topic``): :meth:`DeliveryCore.check_topics` logs one warning naming
it (:class:`~ferrymq.client._missing_topics.MissingTopics`, as for the pull consumer), the
broker records the subscription and starts delivering the topic, from its first message, once
it exists (a long poll looks for it every second).
:class:`LeasedMessage` is a :class:`~ferrymq.client.message.ReceivedMessage` that also carries
its receipt and ``reconsume_times``; for a redelivered message (a letter of the group's retry
queue) it shows the original topic, queue, offset and id, and hides the ``%`` properties.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from ferrymq.client._cluster import Cluster
from ferrymq.client._coordinator import CoordinatorRoute, delivery_route
from ferrymq.client._missing_topics import MissingTopics
from ferrymq.client._session import Session
from ferrymq.client.message import BatchContext, ReceivedMessage
from ferrymq.errors import (
    BrokerError,
    ConfigError,
    ConnectionClosedError,
    CorruptRecordError,
    FerryMQError,
    FerryMQTimeoutError,
    InvalidReceiptError,
    UnknownGroupError,
    UnknownMemberError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.letters import RETRY_TOPIC_PREFIX, Letter, parse_letter, user_properties
from ferrymq.protocol.records import (
    ATTR_SCHEDULED,
    check_stored_batch,
    decode_properties,
    iter_batches,
    record_fields,
    walk_records,
)
from ferrymq.protocol.tags import parse_tag_expression

log = logging.getLogger("ferrymq.client")

class LeasedMessage(ReceivedMessage):
    """A message leased from a delivery group: ack it, nack it, or let its lease expire.

    Attributes:
        reconsume_times: how many earlier deliveries of it failed (0 on the first delivery).
        lease_id: the current lease (changes when the invisible time is changed).
    """

    __slots__ = ("_msg_id", "_rkey", "_roff", "lease_id", "reconsume_times")

    def __init__(self, ctx: BatchContext, buf: bytes, pos: int, offset: int, rkey: tuple[str, int],
                 roff: int, lease_id: int, reconsume: int, msg_id: str | None) -> None:
        super().__init__(ctx, buf, pos, offset)
        self._rkey = rkey
        self._roff = roff
        self.lease_id = lease_id
        self.reconsume_times = reconsume
        self._msg_id = msg_id

    @property
    def receipt(self) -> m.Receipt:
        """``(topic, queue, offset, lease id)`` as the broker knows the lease."""
        return (self._rkey[0], self._rkey[1], self._roff, self.lease_id)

    @property
    def msg_id(self) -> str:
        """The original message id (also for a redelivery from the retry queue)."""
        return self._msg_id if self._msg_id is not None else super().msg_id

    @property
    def properties(self) -> dict[str, str]:
        """User properties (the broker's ``%`` bookkeeping hidden)."""
        props = super().properties
        return user_properties(props) if self._msg_id is not None else props

    def __repr__(self) -> str:
        return (f"LeasedMessage(topic={self.topic!r}, queue={self.queue}, offset={self.offset}, "
                f"reconsume_times={self.reconsume_times}, body={self.body[:32]!r})")


def decode_deliveries(resp: m.ReceiveResponse) -> list[LeasedMessage]:
    """The leased messages of a RECEIVE answer, in delivery order.

    Raises:
        CorruptRecordError: a batch fails its CRC (nothing from it is returned).
    """
    out: list[LeasedMessage] = []
    for topic, queue, topic_id, lease_id, reconsume, first, last, data in resp.deliveries:
        buf = bytes(data)
        mv = memoryview(buf)
        rkey = (topic, queue)
        letter = topic.startswith(RETRY_TOPIC_PREFIX)
        for pos, h in iter_batches(mv):
            check_stored_batch(mv, pos)
            if h.last_offset < first or h.base_offset > last or h.attributes & ATTR_SCHEDULED:
                continue  # (a scheduled original is never handed out: its copy comes when due)
            if not letter:
                ctx = (BatchContext(topic, queue, topic_id, h.append_time_ms, h.first_timestamp),
                       rkey, lease_id, reconsume)
                if h.last_offset <= last:
                    out.extend(walk_records(buf, pos, h, first, _leased, ctx) or [])
                    continue
                # a batch leased in part (the broker sends whole batches): build messages only
                # for the leased records, not for the rest of a possibly large batch
                for p, off in walk_records(buf, pos, h, first, _raw, None) or []:
                    if off > last:
                        break
                    out.append(_leased(ctx, buf, p, off))
                continue
            for rec in walk_records(buf, pos, h, first, _raw, None) or []:
                p, off = rec
                if off > last:
                    break
                _t0, _t1, _s1, k1, p1, _end = record_fields(buf, p)
                try:
                    origin = parse_letter(decode_properties(buf[k1:p1]) if p1 > k1 else {})
                except CorruptRecordError:
                    log.warning("retry letter %s@%d without origin properties", topic, off)
                    origin = Letter(topic, queue, off, "", reconsume)
                octx = BatchContext(origin.topic, origin.queue, 0, h.append_time_ms,
                                    h.first_timestamp)
                out.append(LeasedMessage(octx, buf, p, origin.offset, rkey, off, lease_id,
                                         reconsume, origin.msg_id))
    return out


def _leased(ctx: tuple[BatchContext, tuple[str, int], int, int], b: bytes, p: int,
            off: int) -> LeasedMessage:
    return LeasedMessage(ctx[0], b, p, off, ctx[1], off, ctx[2], ctx[3], None)


def _raw(_ctx: None, _buf: bytes, p: int, off: int) -> tuple[int, int]:
    return (p, off)


def _results(codes: list[tuple[int, int]]) -> list[BrokerError | None]:
    return [None if c == 0 else error_for_code(c, "") for c, _ in codes]


class DeliveryCore:
    """Membership, RECEIVE, ACK, NACK and lease changes for one delivery group."""

    def __init__(
        self,
        session: Session,
        group: str,
        *,
        session_timeout_s: float = 30.0,
        heartbeat_interval_s: float | None = None,
        retry_delays: Sequence[float] | None = None,
        max_reconsume: int | None = None,
        start_from: str | int = "earliest",
        orderly: bool = False,
        exclusive: bool = False,
        ephemeral: bool = False,
    ) -> None:
        self.orderly = orderly
        self.exclusive = exclusive
        self.ephemeral = ephemeral
        """Ask for a group the broker removes once it has no members (see heartbeat)."""
        if start_from == "earliest":
            self.start_from = int(m.OffsetSpec.EARLIEST)
        elif start_from == "latest":
            self.start_from = int(m.OffsetSpec.LATEST)
        elif isinstance(start_from, int) and start_from >= 0:
            self.start_from = start_from
        else:
            raise ConfigError("start_from must be 'earliest', 'latest' or a timestamp in ms")
        if session_timeout_s <= 0:
            raise ConfigError("session_timeout must be positive")
        if retry_delays is not None and (not retry_delays or any(d < 0 for d in retry_delays)):
            raise ConfigError("retry_delays must be a non-empty list of delays >= 0 (seconds)")
        if max_reconsume is not None and max_reconsume < 0:
            raise ConfigError("max_reconsume must be >= 0")
        self.session = session
        self.group = group
        self._cluster = Cluster(session)
        self.route: CoordinatorRoute = delivery_route(self._cluster, group)
        """Where the group's requests go: the bootstrap broker, which coordinates every group
        of a single broker; in a cluster, the leader of the group's retry queue, found again
        after a refusal or a lost connection (:mod:`ferrymq.client._coordinator`)."""
        self.session_timeout_ms = int(session_timeout_s * 1000)
        self.heartbeat_interval_s = heartbeat_interval_s or min(3.0, session_timeout_s / 3)
        self.retry_delays_ms = (
            None if retry_delays is None else [int(d * 1000) for d in retry_delays]
        )
        self.max_reconsume = -1 if max_reconsume is None else max_reconsume
        self.subscriptions: dict[str, str] = {}
        self.awaiting = MissingTopics(session)
        """Subscribed topics that did not exist when checked (warned about once each); the
        broker delivers them once they exist, so only the first message of one ends the wait."""
        self.member_id = ""
        self.members = 0
        self._hb_task: asyncio.Task[None] | None = None

    def subscribe(self, topic: str, tags: str = "*") -> None:
        """Add (or change) a subscription; sent with the next heartbeat."""
        parse_tag_expression(tags)
        self.subscriptions[topic] = tags

    @property
    def registered(self) -> bool:
        """Whether the broker has this member (a heartbeat succeeded)."""
        return bool(self.member_id)

    async def check_topics(self, topics: Sequence[str], *, require: bool) -> None:
        """Look ``topics`` up (never creating them); log one warning per topic that does not
        exist yet, or raise when ``require``.

        Raises:
            UnknownTopicError: ``require`` and a topic does not exist.
            InvalidTopicNameError: a name no topic can have.
        """
        for topic in topics:
            await self.awaiting.check(topic, require=require)

    async def heartbeat(self) -> None:
        """Register or refresh this member (and the group's retry policy). Waits at most half
        the session timeout for the answer (or the request timeout, if shorter): a member whose
        heartbeat takes longer is about to be evicted, and the heartbeat loop then looks for
        the coordinator again."""
        resp = await self.route.request(
            m.DeliveryHeartbeatRequest(
                self.group, self.member_id, self.session.client_id,
                sorted(self.subscriptions.items()), self.session_timeout_ms,
                self.retry_delays_ms, self.max_reconsume, self.start_from, self.orderly,
                self.exclusive, self.ephemeral,
            ),
            m.DeliveryHeartbeatResponse,
            timeout_s=min(self.session.request_timeout_s, self.session_timeout_ms / 2000),
        )
        if self.ephemeral and not resp.ephemeral and not self.member_id:
            log.warning("delivery group %s is kept by the broker after this consumer leaves "
                        "(the broker predates ephemeral groups, or a durable member shares the "
                        "group): remove it with 'ferrymq group delete %s'", self.group,
                        self.group)
        self.member_id = resp.member_id
        self.members = resp.members

    async def start(self) -> None:
        """First heartbeat, then keep heartbeating in the background.

        Raises:
            ConfigError: nothing is subscribed (a member registers with its subscriptions).
        """
        if not self.subscriptions:
            raise ConfigError("subscribe to a topic before joining a delivery group")
        await self.heartbeat()
        if self._hb_task is None:
            self._hb_task = asyncio.get_running_loop().create_task(self._heartbeat_loop())

    async def _heartbeat_loop(self) -> None:
        while True:  # until close() cancels it
            await asyncio.sleep(self.heartbeat_interval_s)
            try:
                await self.heartbeat()
            except asyncio.CancelledError:
                raise
            except FerryMQError as exc:
                log.warning("heartbeat of group %s failed: %s", self.group, exc)
                if isinstance(exc, (ConnectionClosedError, FerryMQTimeoutError)):
                    # the coordinator is gone or silent (it may hang with its connection
                    # open): look for the group's coordinator now, so that the next requests
                    # go to the new one instead of waiting out their timeouts on the old one
                    with contextlib.suppress(FerryMQError):
                        await self.route.find()

    async def receive(
        self, max_messages: int, invisible_s: float, wait_s: float, max_bytes: int = 4 << 20,
        topics: Sequence[tuple[str, str]] | None = None,
    ) -> list[LeasedMessage]:
        """Lease up to ``max_messages``; wait up to ``wait_s`` for some to arrive."""
        if max_messages <= 0:
            raise ConfigError("max_messages must be positive")
        if invisible_s <= 0:
            raise ConfigError("invisible duration must be positive")
        req = m.ReceiveRequest(self.group, self.member_id, list(topics or []), max_messages,
                               max_bytes, int(invisible_s * 1000), int(wait_s * 1000))
        for attempt in range(2):
            try:
                resp = await self.route.request(
                    req, m.ReceiveResponse,
                    timeout_s=wait_s + self.session.request_timeout_s,
                )
                msgs = decode_deliveries(resp)
                if self.awaiting and msgs:
                    self._arrived(msgs)
                return msgs
            except (UnknownMemberError, UnknownGroupError):
                if attempt:
                    raise
                await self.heartbeat()  # evicted, or the broker restarted: register again
                req = m.ReceiveRequest(self.group, self.member_id, req.subscriptions,
                                       max_messages, max_bytes, req.invisible_ms, req.max_wait_ms)
        raise AssertionError("unreachable")

    def _arrived(self, msgs: list[LeasedMessage]) -> None:
        for topic in {x.topic for x in msgs}.intersection(self.awaiting.names):
            self.awaiting.discard(topic)
            log.info("delivery group %s: topic %r exists now; receiving", self.group, topic)

    async def ack(self, msgs: Sequence[LeasedMessage]) -> list[BrokerError | None]:
        """Ack; per message None or the error (InvalidReceiptError: lease not current)."""
        if not msgs:
            return []
        groups: dict[tuple[str, int, int], list[int]] = {}
        for x in msgs:
            rkey = x._rkey
            k = (rkey[0], rkey[1], x.lease_id)
            offs = groups.get(k)
            if offs is None:
                offs = groups[k] = []
            offs.append(x._roff)
        resp = await self.route.request(
            m.AckRequest(self.group, self.member_id,
                         [(t, q, lease, offs) for (t, q, lease), offs in groups.items()]),
            m.AckResponse,
        )
        if not resp.failed:
            return [None] * len(msgs)
        bad = {(t, q, o): c for t, q, o, c in resp.failed}
        return [
            None if (c := bad.get((x._rkey[0], x._rkey[1], x._roff))) is None
            else error_for_code(c, "")
            for x in msgs
        ]

    async def nack(
        self, msgs: Sequence[LeasedMessage], *, delay_s: float | None = None, reason: str = "",
        counts: bool = True,
    ) -> list[BrokerError | None]:
        """Give messages back: redelivered after ``delay_s`` (None: the group's retry ladder)."""
        if not msgs:
            return []
        if delay_s is not None and delay_s < 0:
            raise ConfigError("delay must be >= 0")
        delay_ms = -1 if delay_s is None else int(delay_s * 1000)
        entries = [(*x.receipt, delay_ms, reason[:1024], counts) for x in msgs]
        resp = await self.route.request(
            m.NackRequest(self.group, self.member_id, entries), m.ReceiptResponse
        )
        return _results(resp.results)

    async def change_invisible(
        self, msgs: Sequence[LeasedMessage], invisible_s: float
    ) -> list[BrokerError | None]:
        """Make messages visible again ``invisible_s`` from now (their receipts change)."""
        if not msgs:
            return []
        if invisible_s <= 0:
            raise ConfigError("invisible duration must be positive")
        ms = int(invisible_s * 1000)
        resp = await self.route.request(
            m.ChangeInvisibleRequest(self.group, self.member_id,
                                     [(*x.receipt[:4], ms) for x in msgs]),
            m.ReceiptResponse,
        )
        for x, (code, lease_id) in zip(msgs, resp.results, strict=True):
            if code == 0:
                x.lease_id = lease_id
        return _results(resp.results)

    async def close(self, *, leave: bool = True) -> None:
        """Stop heartbeating and leave the group (held leases go back at once); :meth:`start`
        joins again as a new member."""
        if self._hb_task is not None:
            self._hb_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._hb_task
            self._hb_task = None
        member_id, self.member_id = self.member_id, ""
        if leave and member_id:
            with contextlib.suppress(BrokerError, ConnectionClosedError, FerryMQTimeoutError):
                await self.route.request(
                    m.DeliveryLeaveRequest(self.group, member_id), m.Empty, timeout_s=5.0,
                    retry=False,
                )
        await self._cluster.close()  # sessions to other brokers; a new start() finds them again
        self._cluster = Cluster(self.session)
        self.route = delivery_route(self._cluster, self.group)


def raise_first(results: list[BrokerError | None], what: str) -> None:
    """Raise the first error of ``results`` with a count of failures, if any."""
    errors = [e for e in results if e is not None]
    if not errors:
        return
    first = errors[0]
    if isinstance(first, InvalidReceiptError):
        raise InvalidReceiptError(
            f"{len(errors)} of {len(results)} {what}: receipt not current (already acked, or "
            f"the lease expired and the message went back to the group)"
        )
    raise first
