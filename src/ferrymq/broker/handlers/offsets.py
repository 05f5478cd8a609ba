"""LIST_OFFSETS, COMMIT_OFFSETS, FETCH_OFFSETS, RESET_OFFSETS (replay)."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from ferrymq.broker.consumer_groups import check_offsets
from ferrymq.broker.handlers.consumer_groups import check_coordinator
from ferrymq.errors import BrokerError, InvalidOffsetError, InvalidRequestError
from ferrymq.protocol import messages as m
from ferrymq.protocol.messages import Isolation, OffsetSpec

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ferrymq.broker.context import ClientConnection
    from ferrymq.broker.topics import QueueState

R = TypeVar("R")


def resolve_spec(qs: QueueState, spec: int, *, committed: bool = False) -> int:
    """Offset for LATEST (-1), EARLIEST (-2) or a timestamp (ms, >= 0); ``committed``: capped
    at the last stable offset (read_committed)."""
    end = qs.lso if committed else qs.visible_end
    if spec == OffsetSpec.LATEST:
        return end
    if spec == OffsetSpec.EARLIEST:
        return qs.log.start_offset
    if spec < 0:
        raise InvalidRequestError(f"bad offset spec {spec}")
    return min(qs.log.offset_for_time(spec), end)


def list_offsets(conn: ClientConnection, req: m.ListOffsetsRequest) -> m.ListOffsetsResponse:
    """Find offsets by position or time."""
    out: list[m.OffsetResult] = []
    committed = req.isolation == Isolation.READ_COMMITTED
    for topic, queue, spec in req.entries:
        try:
            qs = conn.server.topics.queue(topic, queue)
            if conn.server.cluster is not None:
                conn.server.cluster.check_serves(qs)
            out.append((topic, queue, 0, resolve_spec(qs, spec, committed=committed)))
        except BrokerError as exc:
            out.append((topic, queue, exc.code, -1))
    return m.ListOffsetsResponse(out)


def commit_offsets(
    conn: ClientConnection, req: m.CommitOffsetsRequest
) -> m.CommitOffsetsResponse | Awaitable[m.CommitOffsetsResponse]:
    """Store a group's offsets durably (fenced by generation for group members); a queue whose
    offsets are pending in an open transaction is refused (CONCURRENT_TRANSACTIONS). In a
    cluster: at the group's coordinator, answered once replicated (acks=all)."""
    txn = conn.server.txn
    cluster = conn.server.cluster
    check_coordinator(conn, req.group)
    valid, out = check_offsets(conn.server.topics, req.entries,
                               lambda t, q: txn.check_pending(req.group, t, q),
                               local_end=cluster is None)
    if valid and cluster is not None:
        return _answer_after(cluster.groups.commit(req.group, req.member_id, req.generation,
                                                   valid), m.CommitOffsetsResponse(out))
    if valid:
        _durably(conn, req.group, lambda: conn.server.consumer_groups.commit(
            req.group, req.member_id, req.generation, valid))
    return m.CommitOffsetsResponse(out)


async def _answer_after(write: Awaitable[None], answer: R) -> R:
    """``answer`` once ``write`` (a cluster's replicated write) is done."""
    await write
    return answer


def _durably(conn: ClientConnection, group: str, write: Callable[[], None]) -> None:
    """Run a write of ``group``'s offsets; a failed one (nothing changed) is STORAGE_FULL
    (retriable, with a retry-after) on a full disk, else STORAGE_ERROR."""
    try:
        write()
    except OSError as exc:
        raise conn.server.flusher.write_error(exc, f"the offsets of group {group!r}") from None


def fetch_offsets(conn: ClientConnection, req: m.FetchOffsetsRequest) -> m.FetchOffsetsResponse:
    """A group's committed offsets."""
    check_coordinator(conn, req.group)
    committed = conn.server.consumer_groups.committed(req.group)
    wanted = None if req.topics is None else set(req.topics)
    return m.FetchOffsetsResponse(
        sorted((t, q, o) for (t, q), o in committed.items() if wanted is None or t in wanted),
        [(t, q) for t, q in conn.server.txn.unstable(req.group) if wanted is None or t in wanted],
    )


def reset_offsets(conn: ClientConnection, req: m.ResetOffsetsRequest
                  ) -> m.ResetOffsetsResponse | Awaitable[m.ResetOffsetsResponse]:
    """Move a group's offsets on one topic (replay); live members rejoin and pick them up. In a
    cluster the positions are resolved on the coordinator's copy of the queues (see
    docs/cluster.md) and the new offsets replicated before the answer."""
    check_coordinator(conn, req.group)
    topic = conn.server.topics.get(req.topic)
    new: dict[tuple[str, int], int] = {}
    for qs in topic.queues:
        if req.exact:
            if req.spec < 0:
                raise InvalidOffsetError(f"offset {req.spec} is negative")
            off = min(max(req.spec, qs.log.start_offset), qs.visible_end)
        else:
            off = resolve_spec(qs, req.spec)
        new[(req.topic, qs.queue)] = off
    answer = m.ResetOffsetsResponse(sorted((t, q, o) for (t, q), o in new.items()))
    if conn.server.cluster is not None:
        return _answer_after(conn.server.cluster.groups.set_offsets(req.group, new), answer)
    _durably(conn, req.group, lambda: conn.server.consumer_groups.set_offsets(req.group, new))
    return answer
