"""The pull consumer's buffer: fetched record batches become messages, held until poll().

Theory of operation
-------------------
Each assigned queue has a :class:`QueueState`: its *fetch position* (the next offset to ask the
broker for), its *position* (the next offset to hand to the application), its *finished
position* (what auto-commit stores, see :mod:`ferrymq.client.consumer`), an epoch that a seek
or a new assignment bumps (a fetch started under an older epoch is ignored for the queue), and
how many of its messages are buffered.

:meth:`FetchBuffer.add_fetched` turns the bytes a FETCH brought for one queue into a *chunk*:
the queue's messages in offset order, one object per record (every other field is decoded when
the application reads it). Transaction markers, the batches of aborted transactions (with
read_committed) and scheduled originals (their copies come when due) are skipped, and the
queue's fetch position moves past them. A batch whose CRC holds but whose records do not parse
(a faulty producer) is reported once in :attr:`FetchBuffer.corrupt` and skipped, so the queue
is not blocked.

:meth:`FetchBuffer.take` hands out up to ``n`` messages, chunk by chunk, and moves each queue's
position past what it handed out; a queue whose buffered messages are all handed out moves to
its fetch position (offsets in between were filtered out by tag on the broker: consumed).
:meth:`FetchBuffer.drop` forgets the buffered messages of queues sought or no longer assigned.

No I/O here: the consumer sends the FETCH and passes the answer's bytes in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ferrymq.client.message import BatchContext, ReceivedMessage, received_messages
from ferrymq.errors import CorruptRecordError
from ferrymq.protocol.markers import ReadCommittedFilter
from ferrymq.protocol.records import (
    ATTR_CONTROL,
    ATTR_SCHEDULED,
    ATTR_TRANSACTIONAL,
    check_stored_batch,
    iter_batches,
)

TopicQueue = tuple[str, int]

_TXN_BITS = ATTR_TRANSACTIONAL | ATTR_CONTROL


@dataclass(eq=False)
class QueueState:
    """One assigned queue's offsets (see the module docstring)."""

    position: int | None = None  # next offset to hand out (None: not resolved yet)
    finished: int | None = None  # position when poll() was last entered: what auto-commit stores
    fetch_position: int | None = None
    epoch: int = 0
    topic_id: int = -1
    high_watermark: int = -1
    buffered: int = 0  # messages of this queue in the consumer's buffer


class FetchBuffer:
    """Fetched messages not handed out yet: chunks, each from one queue in offset order."""

    def __init__(self) -> None:
        # chunks of messages, each from one queue in offset order; [0] is read from index head
        self.chunks: deque[list[ReceivedMessage]] = deque()
        self.head = 0
        self.corrupt: list[CorruptRecordError] = []  # raised by poll once the buffer is empty

    def __bool__(self) -> bool:
        return bool(self.chunks)

    def pending(self) -> int:
        """How many messages are buffered."""
        return sum(len(c) for c in self.chunks) - self.head

    def clear(self) -> None:
        """Forget every buffered message (the queues' counts are the caller's)."""
        self.chunks.clear()
        self.head = 0

    def drop(self, queues: dict[TopicQueue, QueueState],
             drop: Callable[[TopicQueue], bool]) -> None:
        """Forget buffered messages of the queues ``drop`` selects; recount the rest."""
        if self.chunks and self.head:
            self.chunks[0] = self.chunks[0][self.head :]
        self.head = 0
        self.chunks = deque(
            c for c in self.chunks if c and not drop((c[0].topic, c[0].queue))
        )
        for st in queues.values():
            st.buffered = 0
        for c in self.chunks:
            queues[(c[0].topic, c[0].queue)].buffered += len(c)

    def take(self, n: int, queues: dict[TopicQueue, QueueState]) -> list[ReceivedMessage]:
        """Up to ``n`` buffered messages, in the order they were fetched; moves the positions
        of their queues past them."""
        buf = self.chunks
        out: list[ReceivedMessage] = []
        need = n
        while need > 0 and buf:
            chunk = buf[0]
            head = self.head
            k = min(need, len(chunk) - head)
            part = chunk[head : head + k]
            out += part
            need -= k
            if head + k >= len(chunk):
                buf.popleft()
                self.head = 0
            else:
                self.head = head + k
            last = part[-1]
            st = queues.get((last.topic, last.queue))
            if st is not None:
                st.position = last.offset + 1
                st.buffered -= k
                if st.buffered == 0 and st.fetch_position is not None:
                    # offsets between the last message and the fetch position were filtered
                    # out by tag on the broker: they count as consumed
                    st.position = max(st.position, st.fetch_position)
        return out

    def add_fetched(self, topic: str, queue: int, st: QueueState, data: bytes,
                    aborted: Sequence[tuple[int, int]] = ()) -> None:
        """Turn fetched batches into messages: per record one ``unpack_from`` and one object;
        every other field is decoded when the application reads it. Transaction markers, and
        with read_committed the batches of ``aborted`` transactions, are skipped."""
        rc = ReadCommittedFilter(aborted) if aborted else None  # none: skip markers only
        mv = memoryview(data)  # for CRC checks; messages slice the bytes object itself
        start = st.fetch_position or 0
        topic_id = st.topic_id
        nxt = start
        n = 0
        for pos, h in iter_batches(mv):
            check_stored_batch(mv, pos)
            last = h.last_offset
            if last < start:
                continue
            attrs = h.attributes
            if attrs & ATTR_SCHEDULED:  # a scheduled original: its copy comes when due
                nxt = last + 1
                continue
            if attrs & _TXN_BITS and (
                    not rc.keep(h.producer_id, h.base_offset, attrs) if rc is not None
                    else attrs & ATTR_CONTROL):
                nxt = last + 1  # a transaction marker, or aborted data
                continue
            ctx = BatchContext(topic, queue, topic_id, h.append_time_ms, h.first_timestamp)
            chunk = received_messages(data, pos, h, start, ctx)
            if chunk is None:
                # CRC-valid but malformed inside: a producer bug. Hand out what came before,
                # raise once (poll), and continue after it so the queue is not blocked.
                self.corrupt.append(CorruptRecordError(
                    f"{topic}/{queue}: the batch at offsets {h.base_offset}..{last} is "
                    "malformed inside (written by a faulty producer); skipped"
                ))
                nxt = last + 1
                break
            if chunk:
                self.chunks.append(chunk)
                n += len(chunk)
            nxt = last + 1
        st.fetch_position = nxt
        st.buffered += n
        if st.buffered == 0 and st.position is not None:
            st.position = max(st.position, nxt)
