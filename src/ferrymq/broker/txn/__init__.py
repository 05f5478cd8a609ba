"""Exactly-once read-process-write transactions: Kafka's KIP-98 on one broker.

Theory of operation
-------------------
A *transactional id* (tid) names one logical producer across restarts. INIT_TXN gives it a
producer id and a new epoch, which fences every older instance. Its transactional batches
(``ATTR_TRANSACTIONAL``) are ordinary idempotent batches; the first one sent to a queue
registers that queue with the coordinator. END_TXN commit (or abort) then:

1. appends a PrepareCommit record to the internal topic ``%TXN%state`` and waits until it is
   durable: that record *is* the decision;
2. appends a COMMIT (ABORT) control batch (:mod:`ferrymq.protocol.markers`) to every touched
   queue, in one event-loop callback, and waits until they are durable;
3. on commit, applies the offsets sent with TXN_OFFSET_COMMIT to their groups;
4. in one callback, removes the producer from every touched queue's ``open_txns``, which moves
   each queue's *last stable offset* (LSO), so read_committed readers see the whole
   transaction on every queue at once; then appends CompleteCommit (no wait) and answers.

Readers with ``read_committed`` isolation read up to the LSO and skip aborted batches with the
aborted-transaction list the fetch answer carries (:class:`~ferrymq.protocol.markers.ReadCommittedFilter`).

*Staged* transactions (the Spark sink): END_TXN stage moves Ongoing to Staged (durable, still
invisible); COMMIT_STAGED commits a set of them with one SinkCommit record fenced by
(sink id, batch id): a batch id at or below the sink's last is refused and its staged rows
aborted. Staged transactions that are never committed expire after their TTL.

A full disk (ENOSPC/EDQUOT on a write or an fsync of the state log, a marker or the group
offsets) never leaves a transaction half done. Before step 1 has written the decision nothing
changed. From the END_TXN that takes it on, the decision stands (in memory, then in the
state log): the request is answered STORAGE_FULL (retriable, with the watermarks'
retry-after), every queue keeps its LSO below the transaction, and :meth:`TxnCoordinator.tick`
drives it on from where it stopped once the flusher says space is back -- the decision record
if it was never written, then markers only where the producer's transaction is still open
(the path start-up recovery takes), offsets, CompleteX. A retry of the same END_TXN finishes it
too (or is answered STORAGE_FULL again); the opposite action is refused with
INVALID_TXN_STATE, also after the broker finished it alone, so a client whose commit failed
for lack of space never hears "aborted" for a transaction that was committed.

State: ``%TXN%state`` holds one record per transition, each the *full* state of its tid, so
replay needs only the newest record per tid. A snapshot (``meta/txn_coordinator``, about once a
second when something changed) covers a prefix of the topic; start-up loads it and replays the
rest, then finishes every PrepareX (writes missing markers, re-applies offsets), aborts orphan
open transactions found in the queues' producer state, and seeds every queue's ``open_txns``.

Modules: :mod:`.state` (transactional ids, the transition table, fencing, sink fences: pure),
:mod:`.statelog` (``%TXN%state``, its records and the snapshot), :mod:`.completion` (steps 1-4
of a decided transaction, resumed after a full disk or a restart), :mod:`.coordinator` (the
requests). Everything runs on the event-loop thread.
"""

from ferrymq.broker.txn.coordinator import TxnCoordinator
from ferrymq.protocol.coordinator import TXN_TOPIC

__all__ = ["TXN_TOPIC", "TxnCoordinator"]
