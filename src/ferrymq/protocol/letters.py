"""Letters: a message copied into a group's retry queue (``%RETRY%<group>``) or dead-letter queue
(``%DLQ%<group>``), and the reserved ``%`` properties that say where it came from.

The broker writes them, clients read them; this module is the one place that names them.

=============  ====================================================================
``%TOPIC``     original topic
``%QUEUE``     original queue
``%OFFSET``    original offset
``%MSGID``     original message id
``%RECONSUME`` deliveries that failed before this one (``reconsume_times``)
``%DUE``       wall-clock ms when the letter becomes deliverable (retry letters)
``%REASON``    why the last delivery failed
``%DEAD``      wall-clock ms when the message was dead-lettered (DLQ letters)
=============  ====================================================================
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

from ferrymq.errors import CorruptRecordError

RESERVED_PREFIX = "%"
"""Property names starting with this belong to the broker (hidden from applications)."""
RETRY_TOPIC_PREFIX = "%RETRY%"
DLQ_TOPIC_PREFIX = "%DLQ%"
MAX_REASON_CHARS = 1024
STATE_PRODUCER_ID = -2
"""The producer id of a batch that holds a delivery group's own state, not a letter: in a
cluster a group's journal and snapshots are records of its retry queue (one record per batch,
tag :data:`STATE_TAG`, written only by the group's coordinator). Readers of letters skip such
batches by their header."""
STATE_TAG = b"%STATE"
DELIVERY_GROUP_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
"""What may name a delivery group (the name is part of its retry and dead-letter topics')."""


def delivery_group_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a delivery group, or None if it can (broker and clients check
    with this one rule)."""
    if name in (".", "..") or not DELIVERY_GROUP_NAME.fullmatch(name):
        return f"invalid group name {name[:64]!r}: use 1-200 characters of [A-Za-z0-9._-]"
    return None


class Letter(NamedTuple):
    """Where a letter came from and how it has fared."""

    topic: str
    queue: int
    offset: int
    msg_id: str
    reconsume: int
    due_wall: int = 0
    reason: str = ""
    dead_wall: int = -1  # -1: not dead


def letter_properties(user: Mapping[str, str], letter: Letter) -> dict[str, str]:
    """The properties of a letter: the user's (reserved ones dropped) plus the letter's."""
    props = user_properties(user)
    props.update({
        "%TOPIC": letter.topic,
        "%QUEUE": str(letter.queue),
        "%OFFSET": str(letter.offset),
        "%MSGID": letter.msg_id,
        "%RECONSUME": str(letter.reconsume),
        "%DUE": str(letter.due_wall),
        "%REASON": letter.reason[:MAX_REASON_CHARS],
    })
    if letter.dead_wall >= 0:
        props["%DEAD"] = str(letter.dead_wall)
    return props


def parse_letter(props: Mapping[str, str]) -> Letter:
    """The letter named by a record's properties.

    Raises:
        CorruptRecordError: an origin field is missing or not a number.
    """
    try:
        return Letter(
            topic=props["%TOPIC"],
            queue=int(props["%QUEUE"]),
            offset=int(props["%OFFSET"]),
            msg_id=props["%MSGID"],
            reconsume=int(props["%RECONSUME"]),
            due_wall=int(props.get("%DUE", "0")),
            reason=props.get("%REASON", ""),
            dead_wall=int(props.get("%DEAD", "-1")),
        )
    except (KeyError, ValueError) as exc:
        raise CorruptRecordError(f"not a letter: {exc}") from None


def user_properties(props: Mapping[str, str]) -> dict[str, str]:
    """``props`` without the broker's reserved ones."""
    return {k: v for k, v in props.items() if not k.startswith(RESERVED_PREFIX)}
