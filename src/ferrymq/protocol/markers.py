"""Transaction control batches (commit/abort markers) and the read_committed filter. Sans-IO.

Theory of operation (KIP-98, cut down; plan: docs/design-read-process-write.md §4, §6). A
transactional producer's data batches carry attribute bit 4
(:data:`~ferrymq.protocol.records.ATTR_TRANSACTIONAL`). When the transaction ends, the broker's
coordinator appends one *control batch* to every queue the transaction touched: bits 4 and 5
(:data:`~ferrymq.protocol.records.ATTR_CONTROL`) set, the transaction's producer id and (current)
epoch, ``base_sequence`` -1, and exactly one record::

    tag         empty
    properties  {"%TXN_MARKER": "COMMIT" | "ABORT",
                 "%TXN_ID": <transactional id>,
                 "%TXN_COORD": <offset of the coordinator's decision record, decimal>}
    body        empty

Only the broker writes control batches (the produce path refuses bit 5 from clients). Readers
never hand a control batch to an application.

*read_committed.* A fetch answer carries the batches up to the queue's last stable offset and
the aborted transactions overlapping them, as ``(producer_id, first_offset)`` pairs (from the
queue's ``.txnindex`` files). :class:`ReadCommittedFilter` walks the batches of one answer in
offset order and drops control batches and the bit-4 batches of each aborted transaction: from
its ``first_offset`` up to and including the producer's next control batch (its ABORT marker).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from ferrymq.errors import CorruptRecordError
from ferrymq.protocol.records import (
    ATTR_CONTROL,
    ATTR_TRANSACTIONAL,
    NO_SEQUENCE,
    BatchHeader,
    RecordInput,
    decode_properties,
    encode_batch,
    encode_properties,
    iter_raw_records,
)

__all__ = [
    "CONTROL_ATTRIBUTES",
    "MARKER_ABORT",
    "MARKER_COMMIT",
    "TXN_COORD_PROPERTY",
    "TXN_ID_PROPERTY",
    "TXN_MARKER_PROPERTY",
    "Marker",
    "ReadCommittedFilter",
    "encode_marker",
    "is_control",
    "marker_of",
]

MARKER_ABORT = 0
MARKER_COMMIT = 1

CONTROL_ATTRIBUTES = ATTR_TRANSACTIONAL | ATTR_CONTROL
"""The attributes of every control batch."""

TXN_MARKER_PROPERTY = "%TXN_MARKER"
TXN_ID_PROPERTY = "%TXN_ID"
TXN_COORD_PROPERTY = "%TXN_COORD"
_COMMIT = "COMMIT"
_ABORT = "ABORT"
_TXN_BITS = ATTR_TRANSACTIONAL | ATTR_CONTROL


class Marker(NamedTuple):
    """What a control batch says."""

    commit: bool
    transactional_id: str
    coordinator_offset: int


def encode_marker(
    *,
    producer_id: int,
    producer_epoch: int,
    commit: bool,
    transactional_id: str,
    coordinator_offset: int,
    timestamp_ms: int,
) -> bytes:
    """A complete one-record control batch (base offset 0: ``Log.append`` stamps it).

    Args:
        producer_id: the transaction's producer id.
        producer_epoch: the transactional id's current epoch (the bumped one after fencing).
        commit: True for a COMMIT marker, False for ABORT.
        transactional_id: the transactional id (informational: who wrote it).
        coordinator_offset: offset of the decision record in ``%TXN%state``.
        timestamp_ms: the record's born time.

    Raises:
        ValueError: a negative producer id or epoch (a marker belongs to a producer).
    """
    if producer_id < 0 or producer_epoch < 0:
        raise ValueError(f"a marker needs a producer id and epoch, got {producer_id}/{producer_epoch}")
    props = encode_properties(
        {
            TXN_MARKER_PROPERTY: _COMMIT if commit else _ABORT,
            TXN_ID_PROPERTY: transactional_id,
            TXN_COORD_PROPERTY: str(coordinator_offset),
        }
    )
    return bytes(
        encode_batch(
            [RecordInput(b"", timestamp_ms, properties=props)],
            producer_id=producer_id,
            producer_epoch=producer_epoch,
            base_sequence=NO_SEQUENCE,
            attributes=CONTROL_ATTRIBUTES,
        )
    )


def is_control(attributes: int) -> bool:
    """Whether a batch with these attributes is a control batch (bit 5)."""
    return bool(attributes & ATTR_CONTROL)


def marker_of(buf: bytes | bytearray | memoryview, pos: int, header: BatchHeader) -> Marker:
    """Decode the marker of the control batch at ``pos`` of ``buf``.

    ``header`` is that batch's :class:`~ferrymq.protocol.records.BatchHeader`, as yielded by
    :func:`~ferrymq.protocol.records.iter_batches` or returned by
    :func:`~ferrymq.protocol.records.decode_header`. No CRC is checked here.

    Raises:
        CorruptRecordError: not a control batch, or its record is not a well-formed marker.
    """
    if not header.attributes & ATTR_CONTROL:
        raise CorruptRecordError(f"batch at offset {header.base_offset} is not a control batch")
    if header.record_count != 1:
        raise CorruptRecordError(
            f"control batch at offset {header.base_offset} has {header.record_count} records"
        )
    for _off, _ts, _t0, _t1, _s1, k1, p1, _rend in iter_raw_records(buf, pos, header):
        props = decode_properties(bytes(memoryview(buf)[k1:p1]))
        kind = props.get(TXN_MARKER_PROPERTY)
        coord = props.get(TXN_COORD_PROPERTY, "")
        tid = props.get(TXN_ID_PROPERTY)
        if kind not in (_COMMIT, _ABORT) or tid is None or not _is_int(coord):
            raise CorruptRecordError(
                f"control batch at offset {header.base_offset}: not a transaction marker"
            )
        return Marker(kind == _COMMIT, tid, int(coord))
    raise CorruptRecordError(f"control batch at offset {header.base_offset} has no record")


def _is_int(text: str) -> bool:
    return text.isascii() and (text.isdigit() or (text[:1] == "-" and text[1:].isdigit()))


class ReadCommittedFilter:
    """Which batches of one fetch answer a read_committed reader keeps.

    Built from the answer's aborted transactions, ``(producer_id, first_offset)`` pairs in any
    order. :meth:`keep` is called once per batch, in offset order. A producer's aborted range
    *starts* at the first of its batches (data or control) whose base offset is at or above a
    listed ``first_offset``, and *ends* with its next control batch, which is dropped too.
    Because a producer has at most one transaction open per queue, the first control batch of
    the producer at or after ``first_offset`` is that transaction's ABORT marker, so the
    attributes alone tell where a range ends: a COMMIT marker can never be met inside an
    aborted range, and control batches are never kept, so a COMMIT marker never starts one.
    When a control batch starts a range (the answer begins at the marker, or the transaction's
    data were all before it) the range ends at once.

    Cost: one attribute test for a non-transactional batch; a set and a dict lookup otherwise.
    """

    __slots__ = ("_active", "_pending")

    def __init__(self, aborted: Iterable[tuple[int, int]]) -> None:
        """Take the answer's aborted ``(producer_id, first_offset)`` pairs."""
        pending: dict[int, list[int]] = {}
        for pid, first in aborted:
            pending.setdefault(pid, []).append(first)
        for firsts in pending.values():
            firsts.sort(reverse=True)  # smallest last: popped first
        self._pending = pending
        self._active: set[int] = set()

    def keep(self, producer_id: int, base_offset: int, attributes: int) -> bool:
        """Whether to keep the batch (call for each batch of the answer, in offset order)."""
        if not attributes & _TXN_BITS:
            return True
        active = self._active
        if producer_id in active:
            if attributes & ATTR_CONTROL:
                active.discard(producer_id)  # the ABORT marker ends the range
            return False
        firsts = self._pending.get(producer_id)
        if firsts is not None and firsts[-1] <= base_offset:
            while firsts and firsts[-1] <= base_offset:
                firsts.pop()
            if not firsts:
                del self._pending[producer_id]
            if not attributes & ATTR_CONTROL:
                active.add(producer_id)
            return False
        return not attributes & ATTR_CONTROL

    @property
    def aborting(self) -> frozenset[int]:
        """Producer ids inside an aborted range at this point of the walk."""
        return frozenset(self._active)
