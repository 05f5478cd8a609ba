"""The synchronous facade: the asyncio clients run on one private event loop in a daemon thread.

Every sync client proxies to its async twin with ``run_coroutine_threadsafe``, so there is one
implementation of the protocol and of the client logic (no hand-kept sync copy). The loop
thread is shared by every sync client of the process and started on first use.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import threading
from collections.abc import Coroutine, Sequence
from types import TracebackType
from typing import Any, TypeVar

from ferrymq import tracing
from ferrymq.client._delivery import LeasedMessage
from ferrymq.client._renamed import rename_options
from ferrymq.client.admin import (
    AsyncAdminClient,
    ClusterDescription,
    DeadLetter,
    DeliveryGroupDescription,
    DrainResult,
    KeySearch,
    MessageStatus,
    Reassignment,
    UserInfo,
)
from ferrymq.client.consumer import AsyncPullConsumer, TopicQueue
from ferrymq.client.message import Message, ReceivedMessage, SendResult
from ferrymq.client.producer import AsyncProducer, StagedHandle
from ferrymq.client.simple import AsyncSimpleConsumer
from ferrymq.errors import ClientError
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import DEFAULT_ITERATIONS, ScramCredential

T = TypeVar("T")


class _LoopThread:
    _lock = threading.Lock()
    _instance: _LoopThread | None = None

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="ferrymq-client",
                                       daemon=True)
        self.thread.start()

    @classmethod
    def get(cls) -> _LoopThread:
        with cls._lock:
            if cls._instance is None or not cls._instance.thread.is_alive():
                cls._instance = _LoopThread()
            return cls._instance


def _run(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    lt = _LoopThread.get()
    if threading.current_thread() is lt.thread:
        coro.close()
        raise ClientError("sync FerryMQ clients cannot be used from their own loop thread")
    fut = asyncio.run_coroutine_threadsafe(coro, lt.loop)
    try:
        return fut.result(timeout)
    except BaseException:
        # Ctrl-C or a timeout in the caller's thread: stop the coroutine too, so that (say) an
        # abandoned poll() cannot advance positions for messages nobody received
        fut.cancel()
        raise


class Producer:
    """Sends messages (blocking API). See :class:`~ferrymq.client.producer.AsyncProducer` for
    the options. Use as a context manager, or call :meth:`close`."""

    def __init__(self, servers: str | list[str] = "127.0.0.1:9876", **options: Any) -> None:
        self._loop = _LoopThread.get().loop
        self._async = _run(self._make(servers, options))
        self._pending: collections.deque[tuple[Message, concurrent.futures.Future[SendResult] | None]] = (
            collections.deque()
        )
        self._drain_scheduled = False
        self._lock = threading.Lock()

    @staticmethod
    async def _make(servers: str | list[str], options: dict[str, Any]) -> AsyncProducer:
        return await AsyncProducer(servers, **options).start()

    @property
    def producer_id(self) -> int:
        """The broker-assigned producer id."""
        return self._async.producer_id

    def send(self, msg: Message) -> SendResult:
        """Send and wait until stored (or acknowledged as a duplicate of a stored message:
        ``SendResult.duplicate``, see ``Message(dedup_key=...)``)."""
        if tracing.ENABLED:  # here, in the caller's thread: its trace is the parent
            with tracing.send_span([msg]) as span:
                result = _run(self._async._send(msg))
                tracing.record_result(span, result)
                return result
        return _run(self._async._send(msg))

    def send_batch(self, msgs: Sequence[Message]) -> Sequence[SendResult]:
        """Send many, wait for all; results in input order (duplicates marked)."""
        if not msgs:
            return []
        if tracing.ENABLED:
            with tracing.send_span(msgs):
                return _run(self._async._send_batch(msgs))
        return _run(self._async._send_batch(msgs))

    # transactions (transactional_id=...): see AsyncProducer

    def begin(self) -> None:
        """Begin a transaction (see :meth:`~ferrymq.client.producer.AsyncProducer.begin`)."""
        _run(self._async.begin())

    def send_offsets(self, group: str, offsets: dict[tuple[str, int], int], *,
                     consumer: Any = None) -> None:
        """Commit ``group``'s offsets with the transaction (see
        :meth:`~ferrymq.client.producer.AsyncProducer.send_offsets`)."""
        _run(self._async.send_offsets(group, offsets, consumer=consumer))

    def commit(self) -> None:
        """Flush and commit the transaction (see
        :meth:`~ferrymq.client.producer.AsyncProducer.commit`)."""
        _run(self._async.commit())

    def abort(self) -> None:
        """Abort the transaction (see :meth:`~ferrymq.client.producer.AsyncProducer.abort`)."""
        _run(self._async.abort())

    def stage(self, sink_id: str, batch_id: int, *, ttl_s: float | None = None) -> StagedHandle:
        """Stage the transaction for a sink batch (see
        :meth:`~ferrymq.client.producer.AsyncProducer.stage`)."""
        return _run(self._async.stage(sink_id, batch_id, ttl_s=ttl_s))

    def cancel(self, msg_id: str) -> None:
        """Cancel a scheduled message that is not yet due (see
        :meth:`~ferrymq.client.producer.AsyncProducer.cancel`)."""
        _run(self._async.cancel(msg_id))

    def send_async(self, msg: Message) -> concurrent.futures.Future[SendResult]:
        """Buffer a message (sent after ``linger_ms``); the future gets its result."""
        fut: concurrent.futures.Future[SendResult] = concurrent.futures.Future()
        if tracing.ENABLED:
            span = tracing.start_send(msg)
            tracing.end_when_done(span, fut)
        self._submit(msg, fut)
        return fut

    def send_oneway(self, msg: Message) -> None:
        """Send without waiting for the result."""
        if tracing.ENABLED:
            tracing.end_send(tracing.start_send(msg), None, None)
        self._submit(msg, None)

    def _submit(self, msg: Message, fut: concurrent.futures.Future[SendResult] | None) -> None:
        with self._lock:
            self._pending.append((msg, fut))
            if self._drain_scheduled:
                return
            self._drain_scheduled = True
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items = list(self._pending)
            self._pending.clear()
            self._drain_scheduled = False
        for msg, cfut in items:
            afut = self._async._send_nowait(msg, oneway=cfut is None)  # traced by the caller
            if cfut is not None and afut is not None:
                afut.add_done_callback(functools.partial(_chain, dst=cfut))

    def flush(self) -> None:
        """Send everything buffered and wait for the answers."""
        _run(self._flush())

    async def _flush(self) -> None:
        self._drain()
        await self._async.flush()

    def close(self) -> None:
        """Flush and close."""
        _run(self._close())

    async def _close(self) -> None:
        self._drain()
        await self._async.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _chain(src: asyncio.Future[SendResult], dst: concurrent.futures.Future[SendResult]) -> None:
    if src.cancelled():
        dst.cancel()
    elif src.exception() is not None:
        dst.set_exception(src.exception())
    else:
        dst.set_result(src.result())


class PullConsumer:
    """Pulls messages by offset (blocking API). See
    :class:`~ferrymq.client.consumer.AsyncPullConsumer` for the options.

    At-least-once: a batch :meth:`poll` returned counts as finished when you call :meth:`poll`
    again. Auto-commit (every ``auto_commit_interval_s``, before a rebalance, on :meth:`close`
    and on leaving ``with``, also on Ctrl-C) commits finished batches only, so an interrupted
    loop skips nothing; :meth:`commit` commits everything returned so far."""

    def __init__(self, servers: str | list[str] = "127.0.0.1:9876", group: str = "default",
                 **options: Any) -> None:
        self._async = _run(self._make(servers, group, options))

    @staticmethod
    async def _make(servers: str | list[str], group: str, options: dict[str, Any]) -> AsyncPullConsumer:
        return await AsyncPullConsumer(servers, group, **options).start()

    def subscribe(self, topic: str, tags: str = "*") -> None:
        """Consume ``topic`` as a group member (see the async class)."""
        _run(self._async.subscribe(topic, tags))

    def assign(self, queues: list[TopicQueue]) -> None:
        """Consume exactly these queues."""
        _run(self._async.assign(queues))

    def assignment(self) -> list[TopicQueue]:
        """The queues read now."""
        return self._async.assignment()

    def poll(self, timeout: float = 1.0, max_messages: int = 500) -> list[ReceivedMessage]:
        """Messages, or [] after ``timeout`` seconds; the batches returned before count as
        finished (auto-commit stores them)."""
        return _run(self._async.poll(timeout, max_messages))

    def commit(self, offsets: dict[TopicQueue, int] | None = None) -> None:
        """Commit everything :meth:`poll` returned so far (or the given next offsets)."""
        _run(self._async.commit(offsets))

    def committed(self) -> dict[TopicQueue, int]:
        """Committed offsets of the assigned queues."""
        return _run(self._async.committed())

    def position(self) -> dict[TopicQueue, int]:
        """Next offsets to be returned."""
        return self._async.position()

    def high_watermarks(self) -> dict[TopicQueue, int]:
        """Each assigned queue's high watermark as its leader last reported it."""
        return self._async.high_watermarks()

    def seek(self, topic: str, queue: int, offset: int) -> None:
        """Continue a queue from ``offset``."""
        _run(self._async.seek(topic, queue, offset))

    def seek_to_time(self, topic: str, timestamp_ms: int) -> None:
        """Continue a topic's assigned queues from a time (ms since the epoch)."""
        _run(self._async.seek_to_time(topic, timestamp_ms))

    def seek_to_beginning(self) -> None:
        """Continue every assigned queue from its start."""
        _run(self._async.seek_to_beginning())

    def seek_to_end(self) -> None:
        """Continue every assigned queue from its end."""
        _run(self._async.seek_to_end())

    def close(self) -> None:
        """Commit the finished batches (auto-commit; not the last batch :meth:`poll` returned:
        :meth:`commit` first if it is done), leave the group, close."""
        _run(self._async.close())

    def __enter__(self) -> PullConsumer:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class SimpleConsumer:
    """Receives and acks messages one by one (blocking API). See
    :class:`~ferrymq.client.simple.AsyncSimpleConsumer` for the options."""

    def __init__(self, servers: str | list[str] = "127.0.0.1:9876", group: str = "default",
                 **options: Any) -> None:
        self._async = _run(self._make(servers, group, rename_options(options)))

    @staticmethod
    async def _make(servers: str | list[str], group: str,
                    options: dict[str, Any]) -> AsyncSimpleConsumer:
        consumer = AsyncSimpleConsumer(servers, group, **options)
        try:
            return await consumer.start()  # connects: a wrong address fails here
        except BaseException:
            await consumer.close()
            raise

    @property
    def member_id(self) -> str:
        """This member's id in the group."""
        return self._async.member_id

    def subscribe(self, topic: str, tags: str = "*") -> None:
        """Receive messages of ``topic`` matching ``tags``."""
        _run(self._async.subscribe(topic, tags))

    def receive(self, max_messages: int = 16, invisible_duration: float | None = None,
                wait: float | None = None) -> list[LeasedMessage]:
        """Lease up to ``max_messages`` messages (see the async class)."""
        return _run(self._async.receive(max_messages, invisible_duration, wait))

    def ack(self, msg: LeasedMessage) -> None:
        """Acknowledge one message."""
        _run(self._async.ack(msg))

    def ack_batch(self, msgs: Sequence[LeasedMessage]) -> None:
        """Acknowledge many messages in one request."""
        _run(self._async.ack_batch(msgs))

    def nack(self, msg: LeasedMessage, delay: float | None = None, reason: str = "") -> None:
        """Give a message back for a later attempt."""
        _run(self._async.nack(msg, delay, reason))

    def change_invisible_duration(self, msg: LeasedMessage, seconds: float) -> None:
        """Make a message visible again ``seconds`` from now."""
        _run(self._async.change_invisible_duration(msg, seconds))

    def close(self) -> None:
        """Leave the group and disconnect."""
        _run(self._async.close())

    def __enter__(self) -> SimpleConsumer:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class AdminClient:
    """Administrative requests (blocking API); see
    :class:`~ferrymq.client.admin.AsyncAdminClient`."""

    def __init__(self, servers: str | list[str] = "127.0.0.1:9876", **options: Any) -> None:
        self._async = AsyncAdminClient(servers, **options)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._async, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return _run(attr(*args, **kwargs))

        return call

    # the cluster, groups, dead letters, messages by id or key: typed mirrors of the async client

    def cluster_describe(self) -> ClusterDescription:
        """See :meth:`ferrymq.client.admin.AsyncAdminClient.cluster_describe`."""
        return _run(self._async.cluster_describe())

    def elect_preferred_leaders(self, topics: list[str] | None = None) -> int:
        """See :meth:`ferrymq.client.admin.AsyncAdminClient.elect_preferred_leaders`."""
        return _run(self._async.elect_preferred_leaders(topics))

    def reassign_queue(self, topic: str, queue: int, replicas: Sequence[int]) -> Reassignment:
        """See :meth:`ferrymq.client.admin.AsyncAdminClient.reassign_queue`."""
        return _run(self._async.reassign_queue(topic, queue, replicas))

    def drain_broker(self, broker_id: int) -> DrainResult:
        """See :meth:`ferrymq.client.admin.AsyncAdminClient.drain_broker`."""
        return _run(self._async.drain_broker(broker_id))

    def delete_group(self, group: str, *, delete_dlq: bool = False) -> m.DeleteGroupResponse:
        """See :meth:`ferrymq.client.admin.AsyncAdminClient.delete_group`."""
        return _run(self._async.delete_group(group, delete_dlq=delete_dlq))

    def describe_delivery(self, group: str) -> DeliveryGroupDescription:
        """A delivery group's members, progress, lag, retry and DLQ sizes, retry policy."""
        return _run(self._async.describe_delivery(group))

    def skip_message(self, group: str, msg_id: str) -> None:
        """See :meth:`ferrymq.client.admin.AsyncAdminClient.skip_message`."""
        _run(self._async.skip_message(group, msg_id))

    def message_status(self, msg_id: str) -> MessageStatus:
        """A message's state in each delivery group that reads its topic."""
        return _run(self._async.message_status(msg_id))

    def cancel_scheduled(self, msg_id: str) -> None:
        """Cancel a scheduled message that is not yet due (raises NotScheduledError otherwise)."""
        _run(self._async.cancel_scheduled(msg_id))

    def get_message(self, msg_id: str) -> ReceivedMessage:
        """The message with this id (raises OffsetOutOfRangeError when it is gone)."""
        return _run(self._async.get_message(msg_id))

    def dlq_list(self, group: str, limit: int = 100) -> list[DeadLetter]:
        """The oldest ``limit`` dead letters of a delivery group."""
        return _run(self._async.dlq_list(group, limit))

    def dlq_get(self, group: str, msg_id: str) -> DeadLetter | None:
        """One dead letter by its original id (or its id in the DLQ); None if not dead."""
        return _run(self._async.dlq_get(group, msg_id))

    def dlq_redrive(self, group: str, max_messages: int = 0, dry_run: bool = False, *,
                    offset: int | None = None) -> m.DlqAdminResponse:
        """Send dead letters back to the group (0: all; ``offset``: only that one)."""
        return _run(self._async.dlq_redrive(group, max_messages, dry_run, offset=offset))

    def dlq_purge(self, group: str, max_messages: int = 0, dry_run: bool = False, *,
                  offset: int | None = None) -> m.DlqAdminResponse:
        """Drop dead letters (0: all; ``offset``: only that one)."""
        return _run(self._async.dlq_purge(group, max_messages, dry_run, offset=offset))

    def find_by_key(self, topic: str, key: str, limit: int = 32) -> KeySearch:
        """Messages of ``topic`` carrying ``key``, newest first."""
        return _run(self._async.find_by_key(topic, key, limit))

    def upsert_user(self, name: str, credential: ScramCredential, *, admin: bool = False,
                    produce: Sequence[str] = (), consume: Sequence[str] = (),
                    groups: Sequence[str] = (), produce_bytes_per_s: int = 0,
                    replace: bool = True,
                    scram_sha_512: ScramCredential | None = None) -> bool:
        """See :meth:`ferrymq.client.admin.AsyncAdminClient.upsert_user`."""
        return _run(self._async.upsert_user(
            name, credential, admin=admin, produce=produce, consume=consume, groups=groups,
            produce_bytes_per_s=produce_bytes_per_s, replace=replace,
            scram_sha_512=scram_sha_512))

    def add_user(self, name: str, secret: str, *, admin: bool = False,
                 produce: Sequence[str] = (), consume: Sequence[str] = (),
                 groups: Sequence[str] = (), produce_bytes_per_s: int = 0,
                 replace: bool = False, iterations: int = DEFAULT_ITERATIONS) -> bool:
        """See :meth:`ferrymq.client.admin.AsyncAdminClient.add_user` (True: created)."""
        return _run(self._async.add_user(
            name, secret, admin=admin, produce=produce, consume=consume, groups=groups,
            produce_bytes_per_s=produce_bytes_per_s, replace=replace, iterations=iterations))

    def remove_user(self, name: str) -> int:
        """See :meth:`ferrymq.client.admin.AsyncAdminClient.remove_user` (connections closed)."""
        return _run(self._async.remove_user(name))

    def list_users(self) -> list[UserInfo]:
        """Every user with its rights (never credentials)."""
        return _run(self._async.list_users())

    def close(self) -> None:
        """Close the connection."""
        _run(self._async.close())

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
