"""Wire error codes: the one table shared by broker, clients and docs.

Every response carries a ``u16`` error code. ``NONE`` (0) means success. The meaning of each code,
and whether a client may retry the request as it is, lives here and in :mod:`ferrymq.errors`
(one exception class per code). ``docs/errors.md`` is generated from this table
(``python -m ferrymq.docgen errors``).
"""

from __future__ import annotations

import enum
import warnings
from typing import Any

RENAMED_CODES = {
    "UNKNOWN_TRANSACTION": "UNKNOWN_HALF_MESSAGE",
    "TRANSACTION_RESOLVED": "HALF_MESSAGE_RESOLVED",
}
"""Names of codes before issue 19 (one name per feature) -> their names now; same values."""


class _ErrorCodeType(enum.EnumType):
    """Serves each old name of :data:`RENAMED_CODES` as its code, with a DeprecationWarning."""

    def __getattr__(cls, name: str) -> Any:
        new = RENAMED_CODES.get(name)
        if new is None:
            raise AttributeError(name)
        warnings.warn(f"ErrorCode.{name} is deprecated; use ErrorCode.{new} (same code)",
                      DeprecationWarning, stacklevel=2)
        return cls[new]


class ErrorCode(enum.IntEnum, metaclass=_ErrorCodeType):
    """Error codes carried on the wire (``u16``). Values never change once released."""

    NONE = 0
    INTERNAL_ERROR = 1
    CORRUPT_MESSAGE = 2
    MESSAGE_TOO_LARGE = 3
    INVALID_REQUEST = 4
    UNSUPPORTED_VERSION = 5
    UNKNOWN_API = 6
    UNKNOWN_TOPIC = 7
    UNKNOWN_QUEUE = 8
    TOPIC_ALREADY_EXISTS = 9
    INVALID_TOPIC_NAME = 10
    OFFSET_OUT_OF_RANGE = 11
    OUT_OF_ORDER_SEQUENCE = 12
    DUPLICATE_SEQUENCE = 13
    PRODUCER_FENCED = 14
    UNKNOWN_PRODUCER_ID = 15
    BROKER_SHUTTING_DOWN = 16
    STORAGE_ERROR = 17
    REQUEST_TIMED_OUT = 18
    UNKNOWN_GROUP = 19
    REBALANCE_IN_PROGRESS = 20
    UNKNOWN_MEMBER = 21
    ILLEGAL_GENERATION = 22
    INVALID_CONFIG = 23
    BATCH_TOO_LARGE = 24
    AUTHENTICATION_REQUIRED = 25
    AUTHENTICATION_FAILED = 26
    ACCESS_DENIED = 27
    BUSY = 28
    INVALID_OFFSET = 29
    STORAGE_FULL = 30
    FRAME_TOO_LARGE = 31
    INVALID_RECEIPT = 32
    NOT_SCHEDULED = 33
    UNKNOWN_USER = 34
    USER_ALREADY_EXISTS = 35
    AUTHENTICATION_DISABLED = 36
    NON_EMPTY_GROUP = 37
    UNKNOWN_HALF_MESSAGE = 40
    HALF_MESSAGE_RESOLVED = 41
    INVALID_TXN_STATE = 42
    CONCURRENT_TRANSACTIONS = 43
    TRANSACTION_TIMED_OUT = 44
    INVALID_TXN_TIMEOUT = 45
    BATCH_ALREADY_COMMITTED = 46
    STAGED_TXN_EXPIRED = 47
    MEMBER_CONFLICT = 48
    POLICY_VIOLATION = 49
    NOT_LEADER = 50
    FENCED_LEADER_EPOCH = 51
    NOT_ENOUGH_REPLICAS = 52
    LEADER_NOT_AVAILABLE = 53
    INVALID_REPLICATION_FACTOR = 54
    NOT_COORDINATOR = 55
