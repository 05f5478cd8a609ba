"""Half messages with check-back: RocketMQ's transactional messages.

Theory of operation
-------------------
PREPARE_HALF appends the message, with its target topic and queue, producer group and
the group's check settings in reserved properties (:mod:`ferrymq.protocol.half_messages`), to the
internal topic ``%HALF%transactions`` (one queue). Nobody consumes that topic, so the message is
stored and durable (sync flush mode: the answer waits for the fsync) but invisible. Its id in
that topic is the *half id* (RocketMQ's transaction id).

END_HALF resolves it. COMMIT appends a normal copy to the target queue (a scheduled batch
when the message asked for a delay, indexed by the scheduler like any scheduled send), and only
once that copy is durable (sync mode: fsynced; async mode: written) appends a COMMIT *op* record
to the half topic. ROLLBACK appends a ROLLBACK op. UNKNOWN changes nothing: the broker asks later.

Check-back: the protocol has no server push, so a half-message producer keeps a HALF_CHECK_POLL
long poll open. A pending half message is checked ``check_after`` after it was stored, then
every ``check_interval``; each check goes to one live poller of its group (round robin), which
runs its checker and answers with END_HALF (``from_check``). A check that finds no live
poller counts too (RocketMQ counts attempts, not answers). When ``max_checks`` checks passed
without a definite answer the broker rolls the message back and records why.

Memory: pending half messages are kept in a dict and a heap of check times, at most
``half_max_pending`` of them (a new half message beyond that is refused with BUSY); outcomes of
recently resolved ones in a bounded LRU (older outcomes are found by reading the half topic).

Crash safety (kill -9): the half message is in the log before PREPARE is answered. On start the
manager reads the half topic from a checkpointed *floor* (below it every half message is
resolved; rewritten about once a second): half records without an op are pending again (their
check count starts over), the others are resolved. A crash after the committed copy was written
but before its op can commit twice (the check-back asks again; at-least-once, like a producer
retry), never lose a committed message or expose a rolled-back one: the copy is the only way a
half message becomes visible and it is written only on COMMIT.

A full disk (ENOSPC/EDQUOT) never needs a restart: a half message or a committed copy that
cannot be written is refused with STORAGE_FULL (nothing stored; the producer retries). A
committed copy written whose fsync failed for lack of space stays the commit: the request is
answered STORAGE_FULL, a ROLLBACK is refused from then on, and once the flusher wrote the
queue's tail again the copy is durable and the COMMIT op is written (a retried COMMIT is
answered with it; no second copy). An op record that cannot be written is kept and written
once space is back; the floor checkpoint stays below its half message until then.

Modules: :mod:`.state` (half messages' states, transition table, check-back schedule and
outcomes: pure), :mod:`.halflog` (the half topic and the floor checkpoint), :mod:`.checkback`
(the producers' HALF_CHECK_POLL long polls), :mod:`.manager` (the requests, driving the others).
Everything runs on the event-loop thread.
"""

from ferrymq.broker.half_messages.manager import HalfMessageManager
from ferrymq.broker.half_messages.state import Outcome

__all__ = ["HalfMessageManager", "Outcome"]
