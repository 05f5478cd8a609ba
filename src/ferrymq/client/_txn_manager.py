"""The producer's transaction manager: a ``transactional_id``'s state and its requests.

Theory of operation
-------------------
Read-process-write transactions (``transactional_id=``, docs/exactly-once.md), Kafka's design:
``start()`` sends INIT_TXN, which fences older producers of the same id and gives this one its
producer id and epoch. Between ``begin()`` and ``commit()``/``abort()`` every batch carries
``ATTR_TRANSACTIONAL`` (the sender stamps it); the broker keeps the messages invisible to
read_committed consumers until the commit. ``commit()`` first flushes: if any send of the
transaction failed (:meth:`TxnManager.send_failed`), it raises and the transaction must be
aborted. ``send_offsets()`` adds consumer offsets that commit with the messages. ``stage()``
ends a Spark sink task's transaction without committing it (see
:meth:`ferrymq.client.admin.AsyncAdminClient.commit_staged`).

States: *ready* (no transaction open), *in transaction*, *fatal* (fenced by a newer producer of
the same id: nothing more is possible). A transaction the broker aborted on timeout, or one
aborted after a failed send, makes the next ``begin()`` re-initialise (a new epoch: sequences
may be out of step), instead of a non-transactional producer's per-queue epoch bump.

Every request goes to the transaction coordinator (:class:`~ferrymq.client._coordinator.
CoordinatorRoute`: on a cluster the leader of ``%TXN%state``, followed on NOT_COORDINATOR or a
lost connection). A commit or abort answers the epoch of the next transaction (KIP-890: a new
epoch per transaction, so a zombie of this one is fenced everywhere); the sender restarts its
sequences there.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from ferrymq.client._coordinator import CoordinatorRoute
from ferrymq.client.message import Message
from ferrymq.errors import (
    FerryMQError,
    ProducerFencedError,
    TransactionTimedOutError,
    TxnUsageError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.coordinator import TXN_TOPIC

if TYPE_CHECKING:
    from ferrymq.client._accumulator import Accumulator
    from ferrymq.client._cluster import Cluster
    from ferrymq.client._sender import Sender

READY, IN_TXN, FATAL = "ready", "in transaction", "fatal"


class TxnManager:
    """The transaction state of a transactional producer, and its INIT_TXN, TXN_OFFSET_COMMIT
    and END_TXN requests.

    Args:
        cluster: the producer's cluster view (its bootstrap session first).
        acc: the producer's accumulator (an abort drops what it holds unsent).
        sender: the producer's sender (flushes; holds the producer id and epoch).
        transactional_id: the id (one live producer per id).
        timeout_ms: the broker aborts a transaction open longer than this (0: its default).
    """

    def __init__(self, cluster: Cluster, acc: Accumulator, sender: Sender,
                 transactional_id: str, timeout_ms: int) -> None:
        self._session = CoordinatorRoute(cluster, transactional_id, TXN_TOPIC)
        self._acc = acc
        self._sender = sender
        self.transactional_id = transactional_id
        self._timeout_ms = timeout_ms
        self.state = READY
        self._error: BaseException | None = None
        self._reinit = False  # the broker aborted on timeout, or a send failed: new epoch

    async def init(self, expected_pid: int, expected_epoch: int) -> None:
        """INIT_TXN: fence older producers of the id; send under the new id and epoch."""
        resp = await self._session.request(
            m.InitTxnRequest(self.transactional_id, self._timeout_ms, expected_pid,
                             expected_epoch),
            m.InitTxnResponse)
        # a new epoch starts every queue at sequence 0
        self._sender.restart_sequences(resp.producer_id, resp.producer_epoch)
        self._reinit = False

    def check_usable(self, what: str) -> None:
        """Raises TxnUsageError once the producer was fenced."""
        if self.state == FATAL:
            raise TxnUsageError(f"{what}: this producer was fenced; create a new one")

    def check_send(self, msg: Message) -> None:
        """Raises unless ``msg`` may be sent now."""
        if self.state != IN_TXN:
            if self.state == FATAL:
                raise TxnUsageError("this producer was fenced; create a new one")
            raise TxnUsageError("a transactional producer sends only between begin() "
                                "and commit()/abort()")
        if msg.dedup_key is not None:
            raise ValueError("dedup keys cannot be used inside a transaction (the transaction "
                             "itself makes the send exactly-once)")
        if msg._due is not None:
            raise ValueError("delayed messages cannot be sent inside a transaction yet")

    def send_failed(self, exc: BaseException) -> None:
        """A send of the transaction failed for good: it cannot commit (and if fenced, the
        producer is done)."""
        if self._error is None:
            self._error = exc
            if isinstance(exc, ProducerFencedError):
                self.state = FATAL

    async def begin(self) -> None:
        """Open a transaction (re-initialising first if the last one needs it)."""
        self.check_usable("begin()")
        if self.state == IN_TXN:
            raise TxnUsageError("a transaction is already open: commit() or abort()")
        if self._reinit:
            sender = self._sender
            await self._fenced_guard(self.init(sender.producer_id, sender.producer_epoch))
        self.state = IN_TXN
        self._error = None

    async def send_offsets(self, group: str, offsets: dict[tuple[str, int], int],
                           consumer: Any) -> None:
        """TXN_OFFSET_COMMIT of ``group``'s ``offsets`` (as a member, with ``consumer``)."""
        self.check_usable("send_offsets()")
        if self.state != IN_TXN:
            raise TxnUsageError("send_offsets() outside a transaction: begin() first")
        member, generation = "", -1
        if consumer is not None:
            inner = getattr(consumer, "_async", consumer)
            member, generation = inner._member_id, inner._generation
        sender = self._sender
        req = m.TxnOffsetCommitRequest(
            self.transactional_id, sender.producer_id, sender.producer_epoch, group, member,
            generation, sorted((t, q, o) for (t, q), o in offsets.items()))
        resp = await self._fenced_guard(self._session.request(req, m.CommitOffsetsResponse))
        for t, q, code in resp.results:
            if code:
                raise error_for_code(code, f"offset of {t}/{q} for group {group!r}")

    async def commit(self) -> None:
        """Flush, then END_TXN(commit)."""
        await self._flush_txn("commit()")
        await self._end(m.EndTxnAction.COMMIT)
        self.state = READY

    async def abort(self) -> None:
        """Drop what is not sent, wait for what is in flight, then END_TXN(abort)."""
        self.check_usable("abort()")
        if self.state != IN_TXN:
            raise TxnUsageError("abort() with no transaction open")
        self._acc.drop_unsent(TxnUsageError("the transaction was aborted"))
        with contextlib.suppress(FerryMQError):
            await self._sender.flush()
        if self._error is not None:
            self._reinit = True  # sequences may be out of step: start a new epoch
        try:
            await self._end(m.EndTxnAction.ABORT)
        except TransactionTimedOutError:
            self._reinit = True  # already aborted by the broker
        self.state = READY

    async def stage(self, sink_id: str, batch_id: int, ttl_ms: int) -> None:
        """Flush, then END_TXN(stage) for ``sink_id``'s ``batch_id``."""
        await self._flush_txn("stage()")
        await self._end(m.EndTxnAction.STAGE, sink_id, batch_id, ttl_ms)
        self.state = READY

    async def _flush_txn(self, what: str) -> None:
        """Before commit/stage: the transaction is open, every send of it is answered, and
        none failed (else that error is raised: the transaction must be aborted)."""
        self.check_usable(what)
        if self.state != IN_TXN:
            raise TxnUsageError(f"{what} with no transaction open: begin() first")
        await self._sender.flush()
        if self._error is not None:
            raise self._error

    async def _end(self, action: m.EndTxnAction, sink_id: str = "", batch_id: int = -1,
                   ttl_ms: int = 0) -> None:
        sender = self._sender
        req = m.EndTxnRequest(self.transactional_id, sender.producer_id, sender.producer_epoch,
                              int(action), sink_id, batch_id, ttl_ms, new_epoch=True)
        resp = await self._fenced_guard(self._session.request(req, m.EndTxnResponse))
        if resp.producer_id >= 0 and (resp.producer_id, resp.producer_epoch) != (
                sender.producer_id, sender.producer_epoch):
            sender.restart_sequences(resp.producer_id, resp.producer_epoch)

    async def _fenced_guard(self, coro: Any) -> Any:
        try:
            return await coro
        except ProducerFencedError:
            self.state = FATAL
            raise
        except TransactionTimedOutError:
            self._reinit = True
            raise
