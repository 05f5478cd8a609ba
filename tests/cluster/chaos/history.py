"""A chaos run's history and its checker (Jepsen's total-queue idea, per queue and key).

Theory of operation
-------------------
The workload records into one :class:`History`, in the test's process (one event loop, so no
locks): each send as ``invoke`` and then exactly one completion, ``ok`` with the
``(queue, offset)`` the broker acknowledged, or ``fail`` / ``timeout`` (indeterminate: the
message may or may not be stored, as for any send whose answer was lost); each message a
consumer read, as ``(queue, offset, id)`` (``final`` for the drain after the faults healed,
which reads every queue from its start to its end); and each high watermark a consumer saw in
a fetch answer, in the order it saw them.

:func:`check` reads the history after the run and reports, as a :class:`Report`:

- ``lost``: acknowledged, but absent from the final drain;
- ``misplaced``: acknowledged at ``(queue, offset)``, but the final log holds it elsewhere;
- ``unexpected``: read, but never sent;
- ``duplicates``: one id read at two different ``(queue, offset)``;
- ``divergent``: one ``(queue, offset)`` read with two different ids (a read of data that a
  failover took back, or replicas that disagree);
- ``reordered``: two acknowledged messages of one sharding key (sent one after the other by
  one worker) that the final log holds in the other order;
- ``hw_back``: a consumer saw a queue's high watermark go down.

A send that failed or timed out may be present or not: neither is an anomaly. Message ids
are unique per run; a body is the id's bytes.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["History", "Report", "Send", "check"]

OK, FAIL, TIMEOUT = "ok", "fail", "timeout"
Place = tuple[int, int]
"""``(queue, offset)``."""


@dataclass
class Send:
    """One send: its id, sharding key, when invoked and completed, and its outcome."""

    id: str
    key: str
    invoked: float
    outcome: str = ""
    """"" while in flight, then ``ok``, ``fail`` or ``timeout``."""
    completed: float = 0.0
    place: Place | None = None
    """Where it was acknowledged (``ok`` only)."""
    error: str = ""


@dataclass
class History:
    """Everything a chaos run observed (see the module docstring)."""

    sends: dict[str, Send] = field(default_factory=dict)
    order: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    """Per sharding key, its ids in the order they were sent (one worker per key, one send
    at a time)."""
    reads: list[tuple[Place, str]] = field(default_factory=list)
    """What consumers read while the faults ran."""
    final: list[tuple[Place, str]] = field(default_factory=list)
    """What the drain after healing read: every queue from its start to its end."""
    hw: dict[tuple[str, int], list[int]] = field(default_factory=lambda: defaultdict(list))
    """Per ``(reader, queue)``, the high watermarks it saw, in order."""
    faults: list[tuple[float, str]] = field(default_factory=list)
    """``(time, description)`` of every fault injected and healed."""

    def invoke(self, msg_id: str, key: str) -> Send:
        """Record a send about to happen."""
        send = Send(msg_id, key, time.monotonic())
        self.sends[msg_id] = send
        self.order[key].append(msg_id)
        return send

    @staticmethod
    def ok(send: Send, queue: int, offset: int) -> None:
        """Record ``send`` acknowledged at ``(queue, offset)``."""
        send.outcome, send.completed, send.place = OK, time.monotonic(), (queue, offset)

    @staticmethod
    def failed(send: Send, error: BaseException, *, timed_out: bool) -> None:
        """Record ``send`` failed (``timed_out``: its fate is unknown)."""
        send.outcome, send.completed = (TIMEOUT if timed_out else FAIL), time.monotonic()
        send.error = f"{type(error).__name__}: {error}"

    def read(self, queue: int, offset: int, msg_id: str, *, final: bool = False) -> None:
        """Record a message read."""
        (self.final if final else self.reads).append(((queue, offset), msg_id))

    def high_watermark(self, reader: str, queue: int, hw: int) -> None:
        """Record a high watermark a reader saw (only changes are kept)."""
        seen = self.hw[(reader, queue)]
        if not seen or seen[-1] != hw:
            seen.append(hw)

    def fault(self, what: str) -> None:
        """Record a fault injected or healed, now."""
        self.faults.append((time.monotonic(), what))

    def acked(self) -> list[Send]:
        """The acknowledged sends."""
        return [s for s in self.sends.values() if s.outcome == OK]


@dataclass
class Report:
    """The anomalies :func:`check` found (every list empty: the history is clean)."""

    acked: int
    sent: int
    indeterminate: int
    lost: list[str]
    misplaced: list[tuple[str, Place, Place]]
    unexpected: list[str]
    duplicates: dict[str, list[Place]]
    divergent: dict[Place, list[str]]
    reordered: list[tuple[str, str, str]]
    """``(key, earlier id, later id)`` held in the other order."""
    hw_back: list[tuple[str, int, int, int]]
    """``(reader, queue, before, after)``."""

    @property
    def clean(self) -> bool:
        """Whether no anomaly was found."""
        return not (self.lost or self.misplaced or self.unexpected or self.duplicates
                    or self.divergent or self.reordered or self.hw_back)

    def summary(self) -> str:
        """One line per kind of anomaly (with a few examples), for an assertion message."""
        lines = [f"sent {self.sent}, acknowledged {self.acked}, indeterminate "
                 f"{self.indeterminate}"]
        for name in ("lost", "misplaced", "unexpected", "duplicates", "divergent",
                     "reordered", "hw_back"):
            found = getattr(self, name)
            if found:
                examples = list(found.items() if isinstance(found, dict) else found)[:5]
                lines.append(f"{name}: {len(found)}, e.g. {examples}")
        return "\n".join(lines)


def check(history: History) -> Report:
    """Every anomaly of ``history`` (see the module docstring)."""
    sends = history.sends
    at: dict[Place, set[str]] = defaultdict(set)
    where: dict[str, set[Place]] = defaultdict(set)
    for place, msg_id in (*history.reads, *history.final):
        at[place].add(msg_id)
        where[msg_id].add(place)
    final_place: dict[str, Place] = {}
    for place, msg_id in history.final:
        final_place.setdefault(msg_id, place)
    acked = history.acked()
    lost = [s.id for s in acked if s.id not in final_place]
    misplaced = [(s.id, s.place, final_place[s.id]) for s in acked
                 if s.id in final_place and s.place != final_place[s.id]]
    misplaced_typed = [(i, a, b) for i, a, b in misplaced if a is not None]
    unexpected = sorted(i for i in where if i not in sends)
    duplicates = {i: sorted(p) for i, p in where.items() if len(p) > 1}
    divergent = {p: sorted(ids) for p, ids in at.items() if len(ids) > 1}
    reordered: list[tuple[str, str, str]] = []
    for key, ids in history.order.items():
        placed = [(i, final_place[i]) for i in ids
                  if sends[i].outcome == OK and i in final_place]
        for (a, pa), (b, pb) in itertools.pairwise(placed):
            if pa[0] != pb[0] or pb[1] < pa[1]:  # one key, one queue, in order
                reordered.append((key, a, b))
    hw_back = [(reader, queue, before, after)
               for (reader, queue), seen in history.hw.items()
               for before, after in itertools.pairwise(seen) if after < before]
    return Report(acked=len(acked), sent=len(sends),
                  indeterminate=sum(1 for s in sends.values() if s.outcome != OK),
                  lost=lost, misplaced=misplaced_typed, unexpected=unexpected,
                  duplicates=duplicates, divergent=divergent, reordered=reordered,
                  hw_back=hw_back)
