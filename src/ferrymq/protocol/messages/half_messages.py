"""Half messages with check-back, RocketMQ's transactional messages (PREPARE_HALF, END_HALF,
HALF_CHECK_POLL; docs/half-messages.md)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ferrymq.protocol.messages.schema import (
    BOOL,
    BYTES,
    INT,
    STR,
    ApiKey,
    Body,
    Request,
    lst,
    tup,
)


class HalfState(enum.IntEnum):
    """A half message's outcome as its producer reports it (END_HALF ``state``): the answer of
    the application's local transaction or its checker."""

    UNKNOWN = 0  # not decided yet: the broker asks the group's checker later
    COMMIT = 1
    ROLLBACK = 2


@dataclass(frozen=True, slots=True)
class PrepareHalfResponse(Body):
    """The stored half message: ``half_id`` is its message id (in the internal ``%HALF%``
    topic), the half id that END_HALF and ``message status`` take."""

    half_id: str
    durability: int
    SCHEMA = (STR, INT)


@dataclass(frozen=True, slots=True)
class PrepareHalfRequest(Request):
    """Store a half message: durable, invisible to consumers, bound for ``topic``/``queue``
    once committed. ``batch`` holds exactly one record (a plain or scheduled batch); the check
    settings (ms, ms, count; 0: the broker's defaults) are the producer group's."""

    group: str
    client_id: str
    topic: str
    queue: int
    batch: bytes
    check_after_ms: int
    check_interval_ms: int
    max_checks: int
    API_KEY = ApiKey.PREPARE_HALF
    RESPONSE = PrepareHalfResponse
    SCHEMA = (STR, STR, STR, INT, BYTES, INT, INT, INT)


@dataclass(frozen=True, slots=True)
class EndHalfResponse(Body):
    """The half message's state after the request (PREPARED, COMMITTED, ROLLED_BACK) and, when
    committed, where the committed copy is (``msg_id`` "" and -1s otherwise)."""

    state: str
    msg_id: str
    topic: str
    queue: int
    offset: int
    durability: int
    SCHEMA = (STR, STR, STR, INT, INT, INT)


@dataclass(frozen=True, slots=True)
class EndHalfRequest(Request):
    """Commit, roll back, or report UNKNOWN (:class:`HalfState`) for a half message.
    Repeating the same outcome is harmless (the first result is answered again)."""

    group: str
    half_id: str
    state: int
    from_check: bool
    reason: str
    API_KEY = ApiKey.END_HALF
    RESPONSE = EndHalfResponse
    SCHEMA = (STR, STR, INT, BOOL, STR)


HalfCheck = tuple[str, str, int, bytes, int]
"""(half id, target topic, target queue, one-record batch (the message as it will be
committed, ``%TXN_ID`` among its properties), check number (1 = first))."""


@dataclass(frozen=True, slots=True)
class HalfCheckPollResponse(Body):
    """Half messages whose outcome the broker asks this producer to check."""

    checks: list[HalfCheck]
    SCHEMA = (lst(tup(STR, STR, INT, BYTES, INT)),)


@dataclass(frozen=True, slots=True)
class HalfCheckPollRequest(Request):
    """Long poll (up to ``wait_ms``) for check-backs of ``group``: the broker has no
    server push, so a half-message producer keeps one of these outstanding and answers each
    check with END_HALF (``from_check``)."""

    group: str
    client_id: str
    wait_ms: int
    max_checks: int
    API_KEY = ApiKey.HALF_CHECK_POLL
    RESPONSE = HalfCheckPollResponse
    SCHEMA = (STR, STR, INT, INT)
