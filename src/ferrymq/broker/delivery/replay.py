"""A delivery group's durable form, its snapshot map and journal records, and rebuilding its
state from them. Pure: no I/O, no clock (times are converted by a function passed in).

Journal records (msgpack lists; :mod:`.store` writes and reads them)::

    L topic queue lease_id member deadline_wall reconsume runs   offsets leased
    C topic queue lease_id member deadline_wall reconsume runs   offsets moved to a new lease
    A topic queue runs [wall_ms [origins]]    offsets finished (acked: with the ack's wall time;
                                              a retry letter's ack: with its originals)
    N topic queue next                        the cursor moved (filtered out, retention; an
                                              orderly group's every scan step)
    F topic queue offset reconsume until_wall since_wall reason    an orderly head failed
    P delays max_reconsume start_from [orderly [ephemeral]]         the group's policy
    D floor                                   dead letters below ``floor`` redriven or purged
    DX offset                                 the dead letter at ``offset`` (above the floor)
                                              redriven or purged on its own
    T topic expression [[queue, since], ...]  the tag expression receives now use on ``topic``

The dead letters done one by one above the floor (``g.dlq_done``) are folded into it as it
reaches them (:func:`move_dlq_floor`, :func:`mark_dlq_done`), in service and in replay alike.

``runs`` are sorted offsets as ``[first, count]`` pairs (:func:`runs`). Leases carry their
wall-clock deadline, so a restart keeps a leased message invisible until its lease ends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from ferrymq.broker.delivery.group import AckRun, DeliveryGroup, TagFilter
from ferrymq.broker.delivery.orderly import Failure, OrderlyCursor
from ferrymq.broker.delivery.state import Lease, RetryCursor
from ferrymq.errors import CorruptRecordError, InvalidRequestError
from ferrymq.protocol import messages as m
from ferrymq.protocol.tags import parse_tag_expression


def runs(offsets: Iterable[int]) -> list[list[int]]:
    """Sorted offsets as ``[start, count]`` runs (journal form)."""
    out: list[list[int]] = []
    for o in sorted(offsets):
        if out and out[-1][0] + out[-1][1] == o:
            out[-1][1] += 1
        else:
            out.append([o, 1])
    return out


def expand(pairs: list[list[int]]) -> list[int]:
    """The offsets of ``[start, count]`` runs."""
    return [o for start, n in pairs for o in range(start, start + n)]


def move_dlq_floor(g: DeliveryGroup, floor: int) -> None:
    """Dead letters below ``floor`` are done: the floor moves there (never back), forgets the
    letters done one by one below it, and passes those done right above it."""
    g.dlq_floor = max(g.dlq_floor, floor)
    done = g.dlq_done
    if done:
        done.difference_update([o for o in done if o < g.dlq_floor])
        while g.dlq_floor in done:
            done.discard(g.dlq_floor)
            g.dlq_floor += 1


def mark_dlq_done(g: DeliveryGroup, offset: int) -> None:
    """The dead letter at ``offset`` was redriven or purged on its own."""
    if offset >= g.dlq_floor:
        g.dlq_done.add(offset)
        move_dlq_floor(g, g.dlq_floor)


def set_tag_filter(g: DeliveryGroup, topic: str, expression: str, since: dict[int, int]) -> None:
    """The group's receives filter ``topic`` with ``expression`` from ``since`` (per queue)."""
    try:
        tags = parse_tag_expression(expression)
    except InvalidRequestError:  # checked when it was used: not from this broker
        g.tag_filters.pop(topic, None)
        return
    g.tag_filters[topic] = TagFilter(expression, tags, since)


def remember_acks(g: DeliveryGroup, rec: list[Any], limit: int) -> None:
    """Keep when messages were acknowledged (an "A" record of an ack carries the time; a retry
    letter's carries the original positions)."""
    if len(rec) == 6:
        for topic, queue, offset in rec[5]:
            g.record_acks(topic, queue, [[offset, 1]], rec[4], limit)
    else:
        g.record_acks(rec[1], rec[2], rec[3], rec[4], limit)


def snapshot(g: DeliveryGroup, to_wall: Callable[[int], int], lease_seq: int) -> dict[str, Any]:
    """The group's state as a snapshot map (read back by :meth:`Replay.apply_snapshot`).

    Args:
        g: the group.
        to_wall: converts a monotonic time (deadlines, backoffs) to wall-clock ms.
        lease_seq: the next lease id of the broker.
    """

    def leases(leased: dict[int, Lease]) -> list[list[Any]]:
        by_lease: dict[int, Lease] = {}
        for lease in leased.values():
            by_lease[lease.lease_id] = lease
        return [
            [ls.lease_id, ls.member, to_wall(ls.deadline), ls.reconsume, runs(ls.offsets)]
            for ls in by_lease.values()
        ]

    rc = g.retry
    return {
        "delays": g.retry_delays_ms,
        "max": g.max_reconsume,
        "start": g.start_from,
        "dlq_floor": g.dlq_floor,
        "dlq_done": runs(g.dlq_done),
        "lease_seq": lease_seq,
        "orderly": g.orderly,
        "ephemeral": g.ephemeral,
        "sources": [
            [c.topic, c.queue, c.floor, c.next, leases(c.leased)]
            + ([runs(c.pending), [
                [off, f.reconsume, to_wall(f.until), f.since_wall, f.reason]
                for off, f in c.failures.items()]] if isinstance(c, OrderlyCursor) else [])
            for c in g.sources.values()
        ],
        "retry": [rc.floor, rc.next, runs(rc.ready), runs(rc.done), leases(rc.leased)],
        "acks": [list(r) for r in g.acked],
        "filters": [[topic, tf.expression, [[q, o] for q, o in tf.since.items()]]
                    for topic, tf in g.tag_filters.items()],
    }


class Replay:
    """Applies a snapshot and journal records to groups.

    What it leaves for the caller, who has the logs: orderly cursors' pending offsets are
    placed behind their keys by :meth:`OrderlyCursor.rebuild`, and the retry cursor's ready and
    leased letters (``reload`` and ``leased``) are read again.

    Args:
        to_mono: converts a wall-clock time read back (deadlines, backoffs) to monotonic ms.
        ack_history: how many acknowledged runs a group remembers.
        next_lease: the broker's next lease id so far; :attr:`next_lease` ends past every
            lease id read.
    """

    def __init__(self, to_mono: Callable[[int], int], ack_history: int, next_lease: int) -> None:
        self.to_mono = to_mono
        self.ack_history = ack_history
        self.next_lease = next_lease

    def restore_lease(
        self, g: DeliveryGroup, key: tuple[str, int], lease_id: int, member: str,
        deadline_wall: int, reconsume: int, offsets: list[int],
    ) -> None:
        """A lease read back: its offsets are leased again until its deadline."""
        lease = Lease(lease_id, member, key, self.to_mono(deadline_wall), reconsume)
        if key[0] == g.retry_topic:
            for o in offsets:
                g.retry.leased[o] = lease
                g.retry.reload.discard(o)
                lease.offsets.add(o)
        else:
            cur = g.sources.get(key)
            if cur is None:
                cur = g.sources[key] = g.new_cursor(key[0], key[1], min(offsets, default=0))
            cur.restore(offsets, lease)
            if offsets and offsets[-1] >= cur.next and not isinstance(cur, OrderlyCursor):
                cur.next = max(offsets) + 1
        if lease.offsets:
            g.add_lease(lease, len(lease.offsets))
        self.next_lease = max(self.next_lease, lease_id + 1)

    def apply_snapshot(self, g: DeliveryGroup, snap: dict[str, Any]) -> None:
        """Set a new group's state from its snapshot (see :func:`snapshot`)."""
        g.retry_delays_ms = list(snap["delays"])
        g.max_reconsume = int(snap["max"])
        g.start_from = int(snap.get("start", m.OffsetSpec.EARLIEST))
        g.orderly = bool(snap.get("orderly", False))
        g.ephemeral = bool(snap.get("ephemeral", False))
        g.dlq_floor = int(snap["dlq_floor"])
        g.dlq_done = set(expand(snap.get("dlq_done", ())))
        self.next_lease = max(self.next_lease, int(snap["lease_seq"]))
        for topic, queue, floor, nxt, leases, *orderly in snap["sources"]:
            cur = g.sources[(topic, queue)] = g.new_cursor(topic, queue, floor)
            cur.next = nxt
            if isinstance(cur, OrderlyCursor) and orderly:
                pending, failures = orderly
                cur.pending.update(expand(pending))
                for off, reconsume, until_wall, since, reason in failures:
                    cur.failures[off] = Failure(reconsume, self.to_mono(until_wall), since,
                                                reason)
            for lease_id, member, deadline, reconsume, rs in leases:
                self.restore_lease(g, (topic, queue), lease_id, member, deadline, reconsume,
                                   expand(rs))
        g.acked = deque(AckRun(*r) for r in snap.get("acks", ()))
        for topic, expression, since in snap.get("filters", ()):
            set_tag_filter(g, topic, expression, {int(q): int(o) for q, o in since})
        retry = snap["retry"]
        if len(retry) == 4:  # format 1: every letter was in memory; read them again from floor
            floor, _nxt, done, leases = retry
            g.retry = RetryCursor(floor)
        else:
            floor, nxt, ready, done, leases = retry
            g.retry = RetryCursor(floor)
            g.retry.next = g.retry.counted = nxt
            g.retry.reload = set(expand(ready))
        g.retry.done = set(expand(done))
        for lease_id, member, deadline, reconsume, rs in leases:
            self.restore_lease(g, (g.retry_topic, 0), lease_id, member, deadline, reconsume,
                               expand(rs))

    def apply(self, g: DeliveryGroup, rec: list[Any]) -> None:
        """Apply one journal record: the transition of its kind (see the module docstring).

        Raises:
            CorruptRecordError: not a record kind of this broker.
        """
        transition = self.TRANSITIONS.get(rec[0])
        if transition is None:
            raise CorruptRecordError(f"delivery journal of {g.name}: unknown record {rec[0]!r}")
        transition(self, g, rec)

    def _leased(self, g: DeliveryGroup, rec: list[Any]) -> None:
        _, topic, queue, lease_id, member, deadline, reconsume, rs = rec
        self.restore_lease(g, (topic, queue), lease_id, member, deadline, reconsume, expand(rs))

    def _lease_changed(self, g: DeliveryGroup, rec: list[Any]) -> None:
        _, topic, queue, lease_id, member, deadline, reconsume, rs = rec
        key = (topic, queue)
        offsets = expand(rs)
        self.forget(g, key, offsets)  # the offsets left their old lease
        self.restore_lease(g, key, lease_id, member, deadline, reconsume, offsets)

    def _finished(self, g: DeliveryGroup, rec: list[Any]) -> None:
        _, topic, queue, rs = rec[:4]
        self.forget(g, (topic, queue), expand(rs), finished=True)
        if len(rec) > 4:  # an acknowledgement (not a move): remember when
            remember_acks(g, rec, self.ack_history)

    def _cursor_moved(self, g: DeliveryGroup, rec: list[Any]) -> None:
        _, topic, queue, nxt = rec
        cur = g.sources.get((topic, queue))
        if cur is None:
            cur = g.sources[(topic, queue)] = g.new_cursor(topic, queue, nxt)
        if isinstance(cur, OrderlyCursor):
            cur.advance_to(nxt)
        else:
            cur.next = max(cur.next, nxt)

    def _failed_in_place(self, g: DeliveryGroup, rec: list[Any]) -> None:
        _, topic, queue, offset, reconsume, until_wall, since, reason = rec
        cur = g.sources.get((topic, queue))
        if isinstance(cur, OrderlyCursor) and offset in cur.pending:
            lease = cur.leased.pop(offset, None)
            if lease is not None:
                lease.offsets.discard(offset)
                g.drop_from_lease(lease)
            cur.failures[offset] = Failure(reconsume, self.to_mono(until_wall), since, reason)

    def _policy(self, g: DeliveryGroup, rec: list[Any]) -> None:
        g.set_policy(rec[1], int(rec[2]), int(rec[3]),
                     bool(rec[4]) if len(rec) > 4 else None,
                     bool(rec[5]) if len(rec) > 5 else None)

    def _dlq_floor(self, g: DeliveryGroup, rec: list[Any]) -> None:
        move_dlq_floor(g, int(rec[1]))

    def _dlq_letter_done(self, g: DeliveryGroup, rec: list[Any]) -> None:
        mark_dlq_done(g, int(rec[1]))

    def _tag_filter(self, g: DeliveryGroup, rec: list[Any]) -> None:
        _, topic, expression, since = rec
        set_tag_filter(g, topic, expression, {int(q): int(o) for q, o in since})

    TRANSITIONS: ClassVar[dict[str, Callable[[Replay, DeliveryGroup, list[Any]], None]]] = {
        "L": _leased,
        "C": _lease_changed,
        "A": _finished,
        "N": _cursor_moved,
        "F": _failed_in_place,
        "P": _policy,
        "D": _dlq_floor,
        "DX": _dlq_letter_done,
        "T": _tag_filter,
    }
    """Journal record kind -> its transition (the kinds of the module docstring)."""

    def forget(
        self, g: DeliveryGroup, key: tuple[str, int], offsets: list[int], *,
        finished: bool = False,
    ) -> None:
        """``offsets`` leave their leases (and are done when ``finished``)."""
        if key[0] == g.retry_topic:
            rc = g.retry
            for o in offsets:
                lease = rc.leased.pop(o, None)
                if lease is not None:
                    lease.offsets.discard(o)
                    g.drop_from_lease(lease)
                if finished:
                    rc.reload.discard(o)
                    if o >= rc.next:
                        rc.done.add(o)
            return
        cur = g.sources.get(key)
        if cur is None:
            if not finished or not offsets:
                return
            cur = g.sources[key] = g.new_cursor(key[0], key[1], min(offsets))
        if isinstance(cur, OrderlyCursor):
            for o in offsets:
                if finished:
                    lease = cur.finish(o)
                else:  # a changed lease: still pending, still failed if it was
                    lease = cur.leased.pop(o, None)
                    if lease is not None:
                        lease.offsets.discard(o)
                if lease is not None:
                    g.drop_from_lease(lease)
            return
        for o in offsets:
            lease = cur.finish(o)
            if lease is not None:
                g.drop_from_lease(lease)
            if o >= cur.next:
                cur.next = o + 1
