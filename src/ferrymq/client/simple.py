"""The simple consumer (RocketMQ 5 SimpleConsumer, SQS style): receive, then ack each message.

Work is shared per message, not per queue: any number of consumers of one group may receive
from the same topic. A received message stays invisible to the rest of the group for its
invisible duration; ack it before then, nack it to have it redelivered after a delay, or extend
the lease with :meth:`AsyncSimpleConsumer.change_invisible_duration`. Messages that are never
acked come back (``reconsume_times`` raised) and after ``max_reconsume`` failures go to the
group's dead-letter queue ``%DLQ%<group>``.

Starting connects only; the member joins its group with its first subscription (so a refused
subscription leaves no group behind, see :mod:`ferrymq.client._delivery`). Subscribing to a
topic that does not exist yet is not an error unless ``require_topic=True``: a warning is
logged and :meth:`AsyncSimpleConsumer.receive` returns its messages, from the first one, once
it exists.
"""

from __future__ import annotations

from collections.abc import Sequence

from ferrymq import tracing
from ferrymq.client._delivery import DeliveryCore, LeasedMessage, raise_first
from ferrymq.client._renamed import renamed
from ferrymq.client._session import Auth, Session, TLSOption
from ferrymq.errors import ConfigError
from ferrymq.protocol.letters import delivery_group_name_problem


class AsyncSimpleConsumer:
    """A member of a delivery group that receives and acks explicitly (asyncio).

    Args:
        servers: ``host:port`` (or a list) of brokers.
        group: the delivery group (1-200 characters of ``[A-Za-z0-9._-]``).
        invisible_duration: default seconds a received message stays leased.
        await_duration: default seconds :meth:`receive` waits when nothing is there.
        max_reconsume: failed deliveries before a message is dead-lettered (None: keep the
            group's setting, 16 for a new group).
        retry_delays: the group's retry ladder in seconds (None: keep; RocketMQ's ladder
            10s 30s 1m ... 2h for a new group).
        session_timeout_s: seconds without a heartbeat after which the broker evicts this member
            and gives its leases to the others.
        start_from: where a *new* group starts on each queue: ``"earliest"`` (every retained
            message, the default), ``"latest"`` (only messages sent from now on) or a
            timestamp in ms. Ignored when the group exists.
        orderly: an orderly group: messages of one sharding key are leased one at a time, in
            send order, and a failed one is retried in place (after the broker's
            ``orderly_retry_ms``, 1 s, or the nack's delay) until it is acked or, past
            ``max_reconsume``, dead-lettered; other keys keep flowing. Fixed when the group is
            created.
        require_topic: :meth:`subscribe` to a topic that does not exist raises
            ``UnknownTopicError`` (default: a warning, and the topic is consumed once it
            exists).
        request_timeout_s: seconds to wait for a broker answer.
        connect_timeout_s: seconds the first connection may take before :meth:`start` fails
            with ``ConnectionClosedError`` ("cannot connect to HOST:PORT").
        reconnect_timeout_s: seconds to keep trying to reconnect before a request fails.
        session_timeout, request_timeout, reconnect_timeout: deprecated names of the options
            above with ``_s`` (the names every client uses); they warn.

    Raises:
        ConfigError: an option is out of range, or ``group`` is not a valid group name.
    """

    def __init__(
        self,
        servers: str | list[str] = "127.0.0.1:9876",
        group: str = "default",
        *,
        client_id: str = "ferrymq-simple-consumer",
        invisible_duration: float = 30.0,
        await_duration: float = 5.0,
        max_reconsume: int | None = None,
        retry_delays: Sequence[float] | None = None,
        session_timeout_s: float = 30.0,
        start_from: str | int = "earliest",
        orderly: bool = False,
        require_topic: bool = False,
        request_timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        reconnect_timeout_s: float = 60.0,
        session_timeout: float | None = None,
        request_timeout: float | None = None,
        reconnect_timeout: float | None = None,
        auth: Auth | None = None,
        tls: TLSOption = None,
    ) -> None:
        session_timeout_s = renamed("session_timeout", session_timeout, session_timeout_s)
        request_timeout_s = renamed("request_timeout", request_timeout, request_timeout_s)
        reconnect_timeout_s = renamed("reconnect_timeout", reconnect_timeout, reconnect_timeout_s)
        if invisible_duration <= 0 or await_duration < 0:
            raise ConfigError("invisible_duration must be > 0 and await_duration >= 0")
        problem = delivery_group_name_problem(group)
        if problem is not None:
            raise ConfigError(problem)
        self.group = group
        self.invisible_duration = invisible_duration
        self.await_duration = await_duration
        self.require_topic = require_topic
        self._session = Session(servers, client_id=client_id, request_timeout_s=request_timeout_s,
                                connect_timeout_s=connect_timeout_s,
                                reconnect_timeout_s=reconnect_timeout_s, auth=auth, tls=tls)
        self._core = DeliveryCore(self._session, group, session_timeout_s=session_timeout_s,
                                  retry_delays=retry_delays, max_reconsume=max_reconsume,
                                  start_from=start_from, orderly=orderly)
        self._started = False

    @property
    def member_id(self) -> str:
        """This member's id in the group (empty before the first heartbeat)."""
        return self._core.member_id

    async def start(self) -> AsyncSimpleConsumer:
        """Connect to the broker (done by the first subscribe too); the member joins the group
        with its first subscription.

        Raises:
            ConnectionClosedError: the broker cannot be reached.
        """
        if not self._started:
            await self._session.connection()
            self._started = True
        return self

    async def __aenter__(self) -> AsyncSimpleConsumer:
        try:
            return await self.start()
        except BaseException:
            await self.close()  # no __aexit__ follows a failed __aenter__
            raise

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def subscribe(self, topic: str, tags: str = "*") -> None:
        """Receive messages of ``topic`` whose tag matches ``tags`` (``*``, ``A || B``); the
        first subscription joins the group. A topic that does not exist yet is waited for (a
        warning is logged) unless ``require_topic``.

        Raises:
            UnknownTopicError: the topic does not exist and ``require_topic`` is set.
            InvalidTopicNameError: ``topic`` cannot name a topic.
            AccessDeniedError: the user may not consume it or join the group.
        """
        before = self._core.subscriptions.get(topic)
        self._core.subscribe(topic, tags)
        try:
            await self.start()
            await self._core.check_topics([topic], require=self.require_topic)
            if self._core.registered:
                await self._core.heartbeat()
            else:
                await self._core.start()
        except BaseException:
            if before is None:
                del self._core.subscriptions[topic]
            else:
                self._core.subscriptions[topic] = before
            raise

    async def receive(
        self, max_messages: int = 16, invisible_duration: float | None = None,
        wait: float | None = None,
    ) -> list[LeasedMessage]:
        """Lease up to ``max_messages`` messages; wait up to ``wait`` seconds for some."""
        if not self._core.subscriptions:
            raise ConfigError("subscribe to a topic before receive()")
        await self.start()
        msgs = await self._core.receive(
            max_messages,
            self.invisible_duration if invisible_duration is None else invisible_duration,
            self.await_duration if wait is None else wait,
        )
        if tracing.ENABLED and msgs:
            tracing.record_receive(msgs, self.group)
        return msgs

    async def ack(self, msg: LeasedMessage) -> None:
        """Acknowledge one message: it is never delivered to this group again.

        Raises:
            InvalidReceiptError: its lease is not current (expired and redelivered, or acked).
        """
        raise_first(await self._core.ack([msg]), "acks")

    async def ack_batch(self, msgs: Sequence[LeasedMessage]) -> None:
        """Acknowledge many messages in one request.

        Raises:
            InvalidReceiptError: some receipts were not current (the others are acked).
        """
        raise_first(await self._core.ack(msgs), "acks")

    async def nack(self, msg: LeasedMessage, delay: float | None = None, reason: str = "") -> None:
        """Give a message back: redelivered after ``delay`` seconds (None: the retry ladder),
        or dead-lettered if it has failed ``max_reconsume`` times.

        Raises:
            InvalidReceiptError: its lease is not current.
        """
        raise_first(await self._core.nack([msg], delay_s=delay, reason=reason), "nacks")

    async def change_invisible_duration(self, msg: LeasedMessage, seconds: float) -> None:
        """Keep (or release sooner) a message: it becomes visible ``seconds`` from now. The
        message's receipt changes; use the same message object to ack it later.

        Raises:
            InvalidReceiptError: its lease is not current.
        """
        raise_first(await self._core.change_invisible([msg], seconds), "lease changes")

    async def close(self) -> None:
        """Leave the group (unacked messages go back to it at once) and disconnect."""
        try:
            await self._core.close()
        finally:
            await self._session.close()
