"""Exactly-once read-process-write transactions, Kafka's (INIT_TXN, END_TXN, TXN_OFFSET_COMMIT,
COMMIT_STAGED, ABORT_STAGED, DESCRIBE_TXNS; docs/exactly-once.md)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ferrymq.protocol.messages.consumer_groups import CommitOffsetsResponse
from ferrymq.protocol.messages.schema import (
    BOOL,
    INT,
    STR,
    ApiKey,
    Body,
    Request,
    lst,
    tup,
)


class EndTxnAction(enum.IntEnum):
    """END_TXN's ``action``."""

    COMMIT = 1
    ABORT = 2
    STAGE = 3


class TxnState(enum.IntEnum):
    """A transactional id's coordinator state (``docs/exactly-once.md``)."""

    EMPTY = 0
    ONGOING = 1
    PREPARE_COMMIT = 2
    PREPARE_ABORT = 3
    COMPLETE_COMMIT = 4
    COMPLETE_ABORT = 5
    STAGED = 6


@dataclass(frozen=True, slots=True)
class InitTxnResponse(Body):
    """The producer id and epoch to use from now on, and the timeout granted."""

    producer_id: int
    producer_epoch: int
    txn_timeout_ms: int
    SCHEMA = (INT, INT, INT)


@dataclass(frozen=True, slots=True)
class InitTxnRequest(Request):
    """Start (or restart) a transactional producer: aborts the id's open transaction, bumps the
    epoch (fencing older instances) and answers once that is durable. ``expected_*`` (-1: none)
    resume a producer whose transaction the broker timed out."""

    transactional_id: str
    txn_timeout_ms: int
    expected_producer_id: int
    expected_epoch: int
    API_KEY = ApiKey.INIT_TXN
    RESPONSE = InitTxnResponse
    SCHEMA = (STR, INT, INT, INT)


@dataclass(frozen=True, slots=True)
class EndTxnResponse(Body):
    """The transaction's state after the call (:class:`TxnState`) and how durable it is.
    After a commit or abort, the producer id and epoch the producer's next transaction uses
    (KIP-890: a new epoch per transaction; -1: unchanged, as from an older broker)."""

    state: int
    durability: int
    producer_id: int = -1
    producer_epoch: int = -1
    SCHEMA = (INT, INT, INT, INT)


@dataclass(frozen=True, slots=True)
class EndTxnRequest(Request):
    """Commit, abort or stage (:class:`EndTxnAction`) the open transaction. Stage needs a
    ``sink_id`` and ``batch_id``; ``staged_ttl_ms`` 0 takes the broker's default.
    ``new_epoch``: the producer takes the next epoch the answer names for its next transaction
    (KIP-890's transactions v2; FerryMQ's own producer asks for it; a client that does not,
    an older one or a Kafka client, keeps its epoch, and an older broker ignores the field and
    answers -1: unchanged)."""

    transactional_id: str
    producer_id: int
    producer_epoch: int
    action: int
    sink_id: str
    batch_id: int
    staged_ttl_ms: int
    new_epoch: bool = False
    API_KEY = ApiKey.END_TXN
    RESPONSE = EndTxnResponse
    SCHEMA = (STR, INT, INT, INT, STR, INT, INT, BOOL)


@dataclass(frozen=True, slots=True)
class TxnOffsetCommitRequest(Request):
    """Consumer offsets that become the group's committed offsets when the transaction
    commits (and are dropped if it aborts). ``generation`` -1: not fenced by membership."""

    transactional_id: str
    producer_id: int
    producer_epoch: int
    group: str
    member_id: str
    generation: int
    entries: list[tuple[str, int, int]]
    API_KEY = ApiKey.TXN_OFFSET_COMMIT
    RESPONSE = CommitOffsetsResponse
    SCHEMA = (STR, INT, INT, STR, STR, INT, lst(tup(STR, INT, INT)))


StagedMember = tuple[str, int, int]
"""(transactional id, producer id, producer epoch) of a staged transaction."""


@dataclass(frozen=True, slots=True)
class CommitStagedResponse(Body):
    """The batch's outcome (:class:`TxnState` COMPLETE_COMMIT) and the sink's last batch id."""

    state: int
    committed_batch_id: int
    SCHEMA = (INT, INT)


@dataclass(frozen=True, slots=True)
class CommitStagedRequest(Request):
    """Commit every staged transaction of one sink batch at once, fenced by
    (``sink_id``, ``batch_id``): a batch id at or below the sink's last is refused with
    BATCH_ALREADY_COMMITTED and the staged rows dropped."""

    sink_id: str
    batch_id: int
    members: list[StagedMember]
    API_KEY = ApiKey.COMMIT_STAGED
    RESPONSE = CommitStagedResponse
    SCHEMA = (STR, INT, lst(tup(STR, INT, INT)))


@dataclass(frozen=True, slots=True)
class AbortStagedResponse(Body):
    """How many staged transactions were aborted."""

    aborted: int
    SCHEMA = (INT,)


@dataclass(frozen=True, slots=True)
class AbortStagedRequest(Request):
    """Abort staged transactions of one sink batch (``members`` empty: all of them)."""

    sink_id: str
    batch_id: int
    members: list[StagedMember]
    API_KEY = ApiKey.ABORT_STAGED
    RESPONSE = AbortStagedResponse
    SCHEMA = (STR, INT, lst(tup(STR, INT, INT)))


TxnDescription = tuple[str, int, int, int, int, int, list[tuple[str, int]], list[str], str, int]
"""(transactional id, producer id, epoch, state (:class:`TxnState`), started ms (0: none),
timeout ms, queues, groups, sink id, batch id)."""


@dataclass(frozen=True, slots=True)
class DescribeTxnsResponse(Body):
    """Transactional ids and sink fences (sink id, last committed batch id, at ms)."""

    txns: list[TxnDescription]
    sinks: list[tuple[str, int, int]]
    SCHEMA = (lst(tup(STR, INT, INT, INT, INT, INT, lst(tup(STR, INT)), lst(STR), STR, INT)),
              lst(tup(STR, INT, INT)))


@dataclass(frozen=True, slots=True)
class DescribeTxnsRequest(Request):
    """Describe transactional ids (``transactional_id`` "": all) and sinks (``sink_id``)."""

    transactional_id: str
    sink_id: str
    API_KEY = ApiKey.DESCRIBE_TXNS
    RESPONSE = DescribeTxnsResponse
    SCHEMA = (STR, STR)


@dataclass(frozen=True, slots=True)
class TxnAddQueueResponse(Body):
    """Empty: the queue is registered with the open transaction (errors come as error codes)."""

    SCHEMA = ()


@dataclass(frozen=True, slots=True)
class TxnAddQueueRequest(Request):
    """Between brokers of a cluster (KIP-890's verification): a queue's leader asks the
    transaction coordinator to register ``topic``/``queue`` with the open transaction of
    producer ``producer_id`` at ``producer_epoch`` (beginning it if needed) before it appends
    that producer's first transactional batch there. Refused (PRODUCER_FENCED, ...) for a
    zombie; answered once the registration is replicated."""

    producer_id: int
    producer_epoch: int
    topic: str
    queue: int
    API_KEY = ApiKey.TXN_ADD_QUEUE
    RESPONSE = TxnAddQueueResponse
    SCHEMA = (INT, INT, STR, INT)


TxnMarkerResult = tuple[str, int, int, str]
"""(topic, queue, error code, error message)."""


@dataclass(frozen=True, slots=True)
class TxnMarkersResponse(Body):
    """Per queue: written (or nothing to write) and replicated, or an error."""

    results: list[TxnMarkerResult]
    SCHEMA = (lst(tup(STR, INT, INT, STR)),)


@dataclass(frozen=True, slots=True)
class TxnMarkersRequest(Request):
    """Between brokers of a cluster: the transaction coordinator asks a queue's leader to end
    producer ``producer_id``'s transaction on ``queues`` with a COMMIT (``commit``) or ABORT
    marker at ``producer_epoch`` (none where it is not open), answered once replicated."""

    producer_id: int
    producer_epoch: int
    commit: bool
    transactional_id: str
    coordinator_offset: int
    queues: list[tuple[str, int]]
    API_KEY = ApiKey.TXN_MARKERS
    RESPONSE = TxnMarkersResponse
    SCHEMA = (INT, INT, BOOL, STR, INT, lst(tup(STR, INT)))
