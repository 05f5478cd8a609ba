"""The single FerryMQ exception tree.

::

    FerryMQError
    ├── ProtocolError                 bytes that do not follow the protocol
    │   ├── LocalProtocolError        we (or our caller) broke it
    │   └── RemoteProtocolError       the peer broke it
    │       └── FrameSizeError        a frame above max_frame_bytes
    ├── BrokerError                   reported by the broker with an ErrorCode
    │   └── one subclass per code     (code, retriable) as class attributes
    ├── MetadataError                 the cluster's metadata store (etcd)
    │   ├── MetadataUnavailableError  the store cannot be reached
    │   ├── MetadataLeaseExpiredError a lease ended (the holder lost what it held)
    │   ├── ClusterStartError         this broker may not join (id in use, other cluster)
    │   └── NotControllerError        this broker is not (any more) the cluster's controller
    ├── ClientError                   raised on the client side
    │   ├── ConnectionClosedError     (also a ConnectionError)
    │   ├── FerryMQTimeoutError       (also a TimeoutError)
    │   ├── ConfigError               (also a ValueError)
    │   └── TxnUsageError             a transactional producer call out of order
    └── StorageError                  raised by the log library
        ├── CorruptRecordError        (also BrokerError CORRUPT_MESSAGE)
        ├── LogClosedError
        ├── OffsetOutOfRangeError     (also BrokerError OFFSET_OUT_OF_RANGE)
        ├── UnexpectedAppendOffsetError  a replica batch not at the log's end offset
        └── LeaderEpochOrderError     a leader epoch out of order in the epoch cache

Broker errors travel as ``(code, message)``; :func:`error_for_code` turns them back into the
matching class on the client. The wire never carries a traceback.
"""

from __future__ import annotations

import re
import warnings
from typing import TYPE_CHECKING, Any, ClassVar

from ferrymq.protocol.codes import ErrorCode

__all__ = [
    "AccessDeniedError",
    "AuthenticationDisabledError",
    "AuthenticationFailedError",
    "AuthenticationRequiredError",
    "BatchAlreadyCommittedError",
    "BatchTooLargeError",
    "BrokerError",
    "BrokerShuttingDownError",
    "BusyError",
    "ClientError",
    "ClusterStartError",
    "ConcurrentTransactionsError",
    "ConfigError",
    "ConnectionClosedError",
    "CorruptRecordError",
    "DuplicateSequenceError",
    "ErrorCode",
    "FencedLeaderEpochError",
    "FerryMQError",
    "FerryMQTimeoutError",
    "FrameSizeError",
    "FrameTooLargeError",
    "HalfMessageResolvedError",
    "IllegalGenerationError",
    "InternalBrokerError",
    "InvalidConfigError",
    "InvalidOffsetError",
    "InvalidReceiptError",
    "InvalidReplicationFactorError",
    "InvalidRequestError",
    "InvalidTopicNameError",
    "InvalidTxnStateError",
    "InvalidTxnTimeoutError",
    "LeaderEpochOrderError",
    "LeaderNotAvailableError",
    "LocalProtocolError",
    "LogClosedError",
    "MemberConflictError",
    "MessageTooLargeError",
    "MetadataError",
    "MetadataLeaseExpiredError",
    "MetadataUnavailableError",
    "NotControllerError",
    "NonEmptyGroupError",
    "NotEnoughReplicasError",
    "NotCoordinatorError",
    "NotLeaderError",
    "NotScheduledError",
    "OffsetOutOfRangeError",
    "OutOfOrderSequenceError",
    "PolicyViolationError",
    "ProducerFencedError",
    "ProtocolError",
    "RebalanceInProgressError",
    "RemoteProtocolError",
    "RequestTimedOutError",
    "StagedTxnExpiredError",
    "StorageError",
    "StorageFailureError",
    "StorageFullError",
    "TopicAlreadyExistsError",
    "TransactionTimedOutError",
    "TxnUsageError",
    "UnexpectedAppendOffsetError",
    "UnknownApiError",
    "UnknownGroupError",
    "UnknownHalfMessageError",
    "UnknownMemberError",
    "UnknownProducerIdError",
    "UnknownQueueError",
    "UnknownTopicError",
    "UnknownUserError",
    "UnsupportedVersionError",
    "UserAlreadyExistsError",
    "error_for_code",
]


class FerryMQError(Exception):
    """Root of every exception FerryMQ raises on purpose."""


# --- protocol -------------------------------------------------------------------------------


class ProtocolError(FerryMQError):
    """Bytes that do not follow the FerryMQ protocol. The connection is dead afterwards."""


class LocalProtocolError(ProtocolError):
    """We, or the code calling us, tried to send something the protocol does not allow."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol does not allow."""


class FrameSizeError(RemoteProtocolError):
    """The peer announced a frame larger than ``max_frame_bytes``."""


# --- broker (one class per wire code) -------------------------------------------------------


class BrokerError(FerryMQError):
    """An error reported by the broker.

    A broker that refuses a request *before it had any effect* because it is overloaded
    (BUSY, STORAGE_FULL: memory or disk watermark, full disk) says when to come back: the
    message ends with ``(retry_after_ms=N)``, which the client reads back into
    :attr:`retry_after_ms`. Such a refusal is safe to repeat even for requests that are not
    idempotent.

    Attributes:
        code: the wire :class:`ErrorCode`.
        retriable: whether sending the same request again may succeed.
        retry_after_ms: the broker's advice: wait this long before retrying (0: no advice).
    """

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL_ERROR
    retriable: ClassVar[bool] = False
    _registry: ClassVar[dict[ErrorCode, type[BrokerError]]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "code" in cls.__dict__:
            BrokerError._registry[cls.code] = cls

    def __init__(self, message: str = "", *, retry_after_ms: int | None = None) -> None:
        if retry_after_ms is not None:
            message = f"{message} (retry_after_ms={max(0, retry_after_ms)})"
            self.retry_after_ms = max(0, retry_after_ms)
        else:
            found = _RETRY_AFTER.search(message)
            self.retry_after_ms = int(found.group(1)) if found else 0
        super().__init__(message or self.code.name.lower().replace("_", " "))
        self.message = message


_RETRY_AFTER = re.compile(r"\(retry_after_ms=(\d{1,9})\)$")
"""How a retry-after travels: at the end of the error message (no wire format change)."""


class InternalBrokerError(BrokerError):
    """The broker failed in a way it did not expect (see its log)."""

    code = ErrorCode.INTERNAL_ERROR


class MessageTooLargeError(BrokerError):
    """A message is larger than ``max_message_bytes``."""

    code = ErrorCode.MESSAGE_TOO_LARGE


class BatchTooLargeError(BrokerError):
    """A batch holds more records than ``max_batch_records`` or more bytes than allowed."""

    code = ErrorCode.BATCH_TOO_LARGE


class FrameTooLargeError(BrokerError):
    """A frame is larger than ``max_frame_bytes``; the connection is closed."""

    code = ErrorCode.FRAME_TOO_LARGE


class InvalidRequestError(BrokerError):
    """The request is well framed but its content is not valid."""

    code = ErrorCode.INVALID_REQUEST


class UnsupportedVersionError(BrokerError):
    """The broker does not support this version of the request."""

    code = ErrorCode.UNSUPPORTED_VERSION


class UnknownApiError(BrokerError):
    """The broker does not know this request type."""

    code = ErrorCode.UNKNOWN_API


class UnknownTopicError(BrokerError):
    """The topic does not exist (and auto-creation is off or not allowed)."""

    code = ErrorCode.UNKNOWN_TOPIC


class UnknownQueueError(BrokerError):
    """The topic has no queue with this number."""

    code = ErrorCode.UNKNOWN_QUEUE


class TopicAlreadyExistsError(BrokerError):
    """A topic with this name exists already."""

    code = ErrorCode.TOPIC_ALREADY_EXISTS


class InvalidTopicNameError(BrokerError):
    """Topic names are 1..249 characters of ``[A-Za-z0-9._-]``, not ``.`` or ``..``.

    ``%`` starts the names of the broker's internal topics (``%RETRY%<group>``, ...), which
    clients cannot create.
    """

    code = ErrorCode.INVALID_TOPIC_NAME


class OutOfOrderSequenceError(BrokerError):
    """A producer batch skipped sequence numbers: something before it was lost."""

    code = ErrorCode.OUT_OF_ORDER_SEQUENCE


class DuplicateSequenceError(BrokerError):
    """A batch was stored before (internal: the broker answers it with the first result)."""

    code = ErrorCode.DUPLICATE_SEQUENCE


class ProducerFencedError(BrokerError):
    """A newer producer with the same id (a higher epoch) exists: this one is a zombie."""

    code = ErrorCode.PRODUCER_FENCED


class UnknownProducerIdError(BrokerError):
    """The broker has no state for this producer id (it expired or was never issued)."""

    code = ErrorCode.UNKNOWN_PRODUCER_ID
    retriable = True


class BrokerShuttingDownError(BrokerError):
    """The broker is shutting down; try again (it or another broker will answer)."""

    code = ErrorCode.BROKER_SHUTTING_DOWN
    retriable = True


class StorageFailureError(BrokerError):
    """The broker could not write or read its disk (see its log)."""

    code = ErrorCode.STORAGE_ERROR
    retriable = True


class StorageFullError(BrokerError):
    """Disk full or below `disk_free_low_watermark_bytes`: produce refused, nothing stored.

    Raised for ENOSPC/EDQUOT on a write (the log is cut back to its last good batch) and while
    the free space of ``data_dir`` is below the watermark; produce resumes by itself once
    space is back.
    """

    code = ErrorCode.STORAGE_FULL
    retriable = True


class RequestTimedOutError(BrokerError):
    """The broker could not finish the request in time."""

    code = ErrorCode.REQUEST_TIMED_OUT
    retriable = True


class UnknownGroupError(BrokerError):
    """No consumer group with this name exists."""

    code = ErrorCode.UNKNOWN_GROUP


class NonEmptyGroupError(BrokerError):
    """The group has live members (or, for a delivery group, dead letters): not deleted.

    A group is deleted once its consumers have stopped (Kafka's NON_EMPTY_GROUP); a delivery
    group's dead letters are redriven or purged first, or deleted with it on purpose.
    """

    code = ErrorCode.NON_EMPTY_GROUP


class RebalanceInProgressError(BrokerError):
    """The group is rebalancing; rejoin and try again."""

    code = ErrorCode.REBALANCE_IN_PROGRESS
    retriable = True


class UnknownMemberError(BrokerError):
    """The group does not know this member (its session expired); rejoin."""

    code = ErrorCode.UNKNOWN_MEMBER
    retriable = True


class IllegalGenerationError(BrokerError):
    """The request carries an old group generation (fenced); rejoin."""

    code = ErrorCode.ILLEGAL_GENERATION
    retriable = True


class InvalidConfigError(BrokerError):
    """A configuration value sent to the broker is not valid."""

    code = ErrorCode.INVALID_CONFIG


class AuthenticationRequiredError(BrokerError):
    """The broker needs the client to authenticate first."""

    code = ErrorCode.AUTHENTICATION_REQUIRED


class AuthenticationFailedError(BrokerError):
    """Wrong user name or password."""

    code = ErrorCode.AUTHENTICATION_FAILED


class AccessDeniedError(BrokerError):
    """The authenticated principal may not do this."""

    code = ErrorCode.ACCESS_DENIED


class BusyError(BrokerError):
    """The broker is overloaded (back-pressure); retry after a short backoff (`retry_after_ms` if given).

    Connection caps, the memory watermark (``memory_high_watermark_bytes``), full in-memory
    tables (dedup keys, pending half messages, open transactions).
    """

    code = ErrorCode.BUSY
    retriable = True


class InvalidOffsetError(BrokerError):
    """An offset that makes no sense (negative, or past the end for a commit), or that names no
    live dead letter in a DLQ_ADMIN of one letter (redriven or purged already, below the oldest,
    beyond the end); nothing was changed."""

    code = ErrorCode.INVALID_OFFSET


class InvalidReceiptError(BrokerError):
    """An ack, nack or lease change for a receipt that is not current: unknown, already acked,
    or its lease expired and the message went back to the group."""

    code = ErrorCode.INVALID_RECEIPT


class NotScheduledError(BrokerError):
    """Not a pending scheduled message: already delivered, cancelled, or not scheduled."""

    code = ErrorCode.NOT_SCHEDULED


class UnknownUserError(BrokerError):
    """The broker's users file has no user with this name."""

    code = ErrorCode.UNKNOWN_USER


class UserAlreadyExistsError(BrokerError):
    """A user with this name exists already (replace it explicitly)."""

    code = ErrorCode.USER_ALREADY_EXISTS


class AuthenticationDisabledError(BrokerError):
    """The broker has authentication off (no ``users_file``): it has no users to manage."""

    code = ErrorCode.AUTHENTICATION_DISABLED


class UnknownHalfMessageError(BrokerError):
    """No half message has this id in this producer group (or retention removed it).

    Not a half message's id, a half message of another group, or one retention removed.
    """

    code = ErrorCode.UNKNOWN_HALF_MESSAGE


class HalfMessageResolvedError(BrokerError):
    """The half message was already resolved the other way: an outcome never changes."""

    code = ErrorCode.HALF_MESSAGE_RESOLVED


class InvalidTxnStateError(BrokerError):
    """The request does not fit the transactional id's state (no open transaction, already
    committing, a transactional batch from a producer without a transactional id)."""

    code = ErrorCode.INVALID_TXN_STATE


class ConcurrentTransactionsError(BrokerError):
    """The transactional id's previous transaction is still being completed; retry shortly."""

    code = ErrorCode.CONCURRENT_TRANSACTIONS
    retriable = True


class TransactionTimedOutError(BrokerError):
    """The broker aborted the transaction because it ran past its timeout; ``abort()`` it and
    begin again."""

    code = ErrorCode.TRANSACTION_TIMED_OUT


class InvalidTxnTimeoutError(BrokerError):
    """The transaction timeout asked for is above the broker's ``txn_max_timeout_ms``."""

    code = ErrorCode.INVALID_TXN_TIMEOUT


class BatchAlreadyCommittedError(BrokerError):
    """A staged commit for a batch id at or below the sink's last committed one: the staged
    transactions named were dropped (a replayed batch is written once)."""

    code = ErrorCode.BATCH_ALREADY_COMMITTED


class PolicyViolationError(BrokerError):
    """A broker limit refused it (`max_topics`, `max_total_queues`, ...); nothing was created.

    The message names the limit and its value (`max_topics`, `max_total_queues`,
    `auto_create_topics_per_minute`, `max_delivery_groups`, `max_consumer_groups`,
    `max_dlq_done_letters`). Not retriable as it is: the limit stays until the operator raises
    it or topics or groups are deleted, or the oldest dead letters are redriven or purged (a
    per-minute limit carries a retry-after: when the next creation would be allowed).
    """

    code = ErrorCode.POLICY_VIOLATION


class StagedTxnExpiredError(BrokerError):
    """A staged transaction named in a staged commit is unknown, expired or not staged:
    nothing was committed."""

    code = ErrorCode.STAGED_TXN_EXPIRED


class MemberConflictError(BrokerError):
    """Another live consumer already uses this broadcasting ``instance_name``: refused.

    A broadcasting consumer's delivery group ``<group>.<instance_name>`` allows one live member;
    a second member is refused until the first leaves, is evicted, or its connection closes."""

    code = ErrorCode.MEMBER_CONFLICT


class NotLeaderError(BrokerError):
    """This broker does not lead the queue (any more): refresh the cluster metadata and send
    to its leader. Clients do so by themselves within their timeouts."""

    code = ErrorCode.NOT_LEADER
    retriable = True


class FencedLeaderEpochError(BrokerError):
    """The request carried a leader epoch older (or newer) than the queue's: the sender's view
    of the cluster is stale; refresh the metadata and retry."""

    code = ErrorCode.FENCED_LEADER_EPOCH
    retriable = True


class NotEnoughReplicasError(BrokerError):
    """With ``acks="all"``: the queue's in-sync replica set is smaller than its
    ``min_insync``, or the in-sync replicas did not all store the batch in time. Retriable:
    an idempotent producer's retry is never stored twice."""

    code = ErrorCode.NOT_ENOUGH_REPLICAS
    retriable = True


class LeaderNotAvailableError(BrokerError):
    """The queue has no live leader now (an election is under way, or every in-sync replica
    is down): retry after a metadata refresh."""

    code = ErrorCode.LEADER_NOT_AVAILABLE
    retriable = True


class InvalidReplicationFactorError(BrokerError):
    """``replicas`` is below 1 or above the number of live brokers, or ``min_insync`` is not
    within ``1..replicas``."""

    code = ErrorCode.INVALID_REPLICATION_FACTOR


class NotCoordinatorError(BrokerError):
    """This broker does not coordinate the consumer group (any more), or the group's
    coordinator is being chosen: find the coordinator again (the leader of the group's queue of
    ``%GROUPS%offsets``) and retry. Clients do so by themselves within their timeouts."""

    code = ErrorCode.NOT_COORDINATOR
    retriable = True


# --- cluster metadata -----------------------------------------------------------------------


class MetadataError(FerryMQError):
    """Raised by the cluster's metadata store or by a broker's use of it."""


class MetadataUnavailableError(MetadataError):
    """The metadata store (etcd) cannot be reached, or answered with a server error."""


class MetadataLeaseExpiredError(MetadataError):
    """A lease of the metadata store has expired: whatever was held with it (a broker's
    registration, the controller's seat) is lost."""


class ClusterStartError(MetadataError):
    """This broker may not join the cluster: its broker id is held by a live broker, or its
    data directory belongs to another cluster."""


class NotControllerError(MetadataError):
    """This broker is not the cluster's controller, or no longer: another broker holds the
    controller's seat, or this one's lease ended. Its writes as controller fail (each is
    checked on the seat's revision); it stops acting as controller and campaigns again."""


# --- client ---------------------------------------------------------------------------------


class ClientError(FerryMQError):
    """Raised by the client library itself."""


class ConnectionClosedError(ClientError, ConnectionError):
    """The connection to the broker closed (or could not be opened)."""


class FerryMQTimeoutError(ClientError, TimeoutError):
    """A client-side deadline passed (request timeout, delivery timeout)."""


class ConfigError(ClientError, ValueError):
    """A client or broker configuration value is not valid."""


class TxnUsageError(ClientError):
    """A transactional producer call out of order: a send outside ``begin()``/``commit()``,
    ``commit()`` with no transaction begun, or ``commit()`` after a send of the transaction
    failed (``abort()`` it). Raised by the client before anything is sent; the broker's
    refusal of a request that does not fit the transaction's state is
    :class:`InvalidTxnStateError`."""


# --- storage --------------------------------------------------------------------------------


class StorageError(FerryMQError):
    """Raised by the log library (beside plain ``OSError``)."""


class CorruptRecordError(StorageError, BrokerError):
    """A record batch failed its CRC or structure check."""

    code = ErrorCode.CORRUPT_MESSAGE
    retriable = True


class LogClosedError(StorageError):
    """The log (or segment) is closed."""


class OffsetOutOfRangeError(StorageError, BrokerError):
    """The offset is before the log start or after the log end."""

    code = ErrorCode.OFFSET_OUT_OF_RANGE


class UnexpectedAppendOffsetError(StorageError):
    """A batch copied from the leader does not start at the log's end offset
    (``Log.append_replica``; Kafka's ``UnexpectedAppendOffsetException``): the follower is
    not where it thinks it is, and nothing was written.

    Attributes:
        base_offset: the batch's base offset.
        end_offset: the log's end offset, where the batch had to start.
    """

    def __init__(self, base_offset: int, end_offset: int, where: str = "") -> None:
        self.base_offset = base_offset
        self.end_offset = end_offset
        prefix = f"{where}: " if where else ""
        super().__init__(
            f"{prefix}replica batch starts at offset {base_offset}, the log ends at {end_offset}"
        )


class LeaderEpochOrderError(StorageError):
    """A leader epoch given to a queue's epoch cache would break its order: epochs and their
    start offsets only grow (``LeaderEpochCache.assign``); nothing was changed.

    Attributes:
        epoch: the epoch given.
        start_offset: the start offset given.
        latest: the cache's latest ``(epoch, start_offset)``, None when it is empty.
    """

    def __init__(self, epoch: int, start_offset: int, latest: tuple[int, int] | None,
                 reason: str) -> None:
        self.epoch = epoch
        self.start_offset = start_offset
        self.latest = latest
        known = "none" if latest is None else f"epoch {latest[0]} from offset {latest[1]}"
        super().__init__(
            f"leader epoch {epoch} at offset {start_offset} refused: {reason} (latest: {known})"
        )


def error_for_code(code: int, message: str = "") -> BrokerError:
    """Build the exception for a wire error code (unknown codes map to InternalBrokerError)."""
    try:
        cls = BrokerError._registry[ErrorCode(code)]
    except ValueError:
        return InternalBrokerError(f"unknown error code {code}: {message}")
    return cls(message)


def _render_table() -> str:
    lines = ["| code | name | retriable | meaning |", "|---:|---|---|---|"]
    for code in ErrorCode:
        cls = BrokerError._registry.get(code)
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls else "success"
        retriable = "yes" if cls and cls.retriable else "no"
        lines.append(f"| {int(code)} | `{code.name}` | {retriable} | {doc} |")
    return "\n".join(lines)


RENAMED = {
    "TransactionResolvedError": "HalfMessageResolvedError",
    "TransactionStateError": "TxnUsageError",
    "UnknownTransactionError": "UnknownHalfMessageError",
}
"""Names before issue 19 (one name per feature) -> the classes' names now (docs/design.md)."""

if not TYPE_CHECKING:  # the old names, deprecated (type checkers do not see them)

    def __getattr__(name: str) -> Any:
        new = RENAMED.get(name)
        if new is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        warnings.warn(f"the name {__name__}.{name} is deprecated; use {__name__}.{new} (same "
                      "meaning)", DeprecationWarning, stacklevel=2)
        return globals()[new]
