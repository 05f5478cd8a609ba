"""Half messages (RocketMQ's transactional messages): the internal topic and the reserved ``%``
properties that carry one. Sans-IO; the broker writes them, clients read ``%TXN_ID``.

The property names keep their ``%TXN_`` prefix: they are on disk in every half topic, and
``%TXN_ID`` is also on every committed copy.

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
sharding key, born time and user properties, plus ``%TXN_ID`` (the half id: the half
message's id). A copy with a delay is appended as a scheduled batch and becomes visible when due.
"""

from __future__ import annotations

from collections.abc import Mapping

from ferrymq.protocol.letters import RESERVED_PREFIX

HALF_TOPIC = "%HALF%transactions"
"""The internal topic holding half messages and their outcomes (one queue)."""

HALF_ID = "%TXN_ID"
HALF_TARGET_TOPIC = "%TXN_TOPIC"
HALF_TARGET_QUEUE = "%TXN_QUEUE"
HALF_GROUP = "%TXN_GROUP"
HALF_CHECK = "%TXN_CHECK"
HALF_CLIENT = "%TXN_CLIENT"
HALF_OP = "%TXN_OP"
HALF_OFFSET = "%TXN_HALF"
HALF_MSGID = "%TXN_MSGID"
HALF_SOURCE = "%TXN_SOURCE"
HALF_REASON = "%TXN_REASON"

HALF_PROPERTIES = (HALF_TARGET_TOPIC, HALF_TARGET_QUEUE, HALF_GROUP, HALF_CHECK, HALF_CLIENT)
assert all(p.startswith(RESERVED_PREFIX) for p in (*HALF_PROPERTIES, HALF_ID, HALF_OP, HALF_OFFSET,
                                                   HALF_MSGID, HALF_SOURCE, HALF_REASON))

OP_COMMIT = "COMMIT"
OP_ROLLBACK = "ROLLBACK"

PREPARED = "PREPARED"
COMMITTED = "COMMITTED"
ROLLED_BACK = "ROLLED_BACK"
"""Half-message states as ``END_HALF`` and ``message status`` name them."""

MAX_REASON_CHARS = 1024


def committed_properties(half: Mapping[str, str], half_id: str) -> dict[str, str]:
    """The properties of the committed copy of a half message: the half's without the
    half message's bookkeeping, plus ``%TXN_ID``."""
    out = {k: v for k, v in half.items() if k not in HALF_PROPERTIES and k != HALF_ID}
    out[HALF_ID] = half_id
    return out
