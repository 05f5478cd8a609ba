"""Transactional (half) messages: the internal topic and the reserved ``%`` properties that carry
a transaction. Sans-IO; the broker writes them, clients read ``%TXN_ID``.

A half message is stored in the internal topic :data:`HALF_TOPIC` (one queue) with the message's
own fields and properties plus:

===================  ==========================================================================
``%TXN_TOPIC``       target topic
``%TXN_QUEUE``       target queue (chosen by the producer's selector when it sent the message)
``%TXN_GROUP``       producer group (check-backs go to a live producer of it)
``%TXN_CHECK``       ``check_after_ms,check_interval_ms,max_checks`` of that group
``%TXN_CLIENT``      the sending producer's client id (for ``message status``)
===================  ==========================================================================

Each outcome is an *op* record appended to the same queue (empty body):

===================  ==========================================================================
``%TXN_OP``          ``COMMIT`` or ``ROLLBACK``
``%TXN_HALF``        offset of the half message it resolves
``%TXN_MSGID``       COMMIT: the message id of the committed copy
``%TXN_SOURCE``      ``producer``, ``check`` (a checker's answer) or ``max_checks``
``%TXN_REASON``      why (free text; the producer's reason, or the broker's)
===================  ==========================================================================

A committed message is a normal copy appended to its target queue: same body, tag, keys,
sharding key, born time and user properties, plus ``%TXN_ID`` (the transaction id: the half
message's id). A copy with a delay is appended as a scheduled batch and becomes visible when due.
"""

from __future__ import annotations

from collections.abc import Mapping

from ferrymq.protocol.letters import RESERVED_PREFIX

HALF_TOPIC = "%HALF%transactions"
"""The internal topic holding half messages and their outcomes (one queue)."""

TXN_ID = "%TXN_ID"
TXN_TOPIC = "%TXN_TOPIC"
TXN_QUEUE = "%TXN_QUEUE"
TXN_GROUP = "%TXN_GROUP"
TXN_CHECK = "%TXN_CHECK"
TXN_CLIENT = "%TXN_CLIENT"
TXN_OP = "%TXN_OP"
TXN_HALF = "%TXN_HALF"
TXN_MSGID = "%TXN_MSGID"
TXN_SOURCE = "%TXN_SOURCE"
TXN_REASON = "%TXN_REASON"

HALF_PROPERTIES = (TXN_TOPIC, TXN_QUEUE, TXN_GROUP, TXN_CHECK, TXN_CLIENT)
assert all(p.startswith(RESERVED_PREFIX) for p in (*HALF_PROPERTIES, TXN_ID, TXN_OP, TXN_HALF,
                                                   TXN_MSGID, TXN_SOURCE, TXN_REASON))

OP_COMMIT = "COMMIT"
OP_ROLLBACK = "ROLLBACK"

PREPARED = "PREPARED"
COMMITTED = "COMMITTED"
ROLLED_BACK = "ROLLED_BACK"
"""Transaction states as ``END_TRANSACTION`` and ``message status`` name them."""

MAX_REASON_CHARS = 1024


def committed_properties(half: Mapping[str, str], txn_id: str) -> dict[str, str]:
    """The properties of the committed copy of a half message: the half's without the
    transaction's bookkeeping, plus ``%TXN_ID``."""
    out = {k: v for k, v in half.items() if k not in HALF_PROPERTIES and k != TXN_ID}
    out[TXN_ID] = txn_id
    return out
