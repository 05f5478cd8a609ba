"""What a push consumer's handler is and returns, and what becomes of it: an ack or a nack.

:class:`ConsumeResult` and :class:`Later` are the public vocabulary (re-exported by
:mod:`ferrymq.client.push`); :func:`decision` turns any handler outcome (a result, ``None``, a
raised exception recorded as :class:`Raised`) into the ack or the (delay, reason, counts) nack
that :mod:`ferrymq.client._push_leases` sends; :func:`is_async` tells the two kinds of handler
apart (``async def`` for :class:`~ferrymq.client.push.AsyncPushConsumer`, plain functions for
:class:`~ferrymq.client.push.PushConsumer`).
"""

from __future__ import annotations

import enum
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ferrymq.errors import ConfigError

log = logging.getLogger("ferrymq.client")


class ConsumeResult(enum.Enum):
    """What a handler returns.

    * ``SUCCESS`` (or returning ``None``): the message is acked and never delivered to the
      group again.
    * ``LATER``: redeliver after the group's retry ladder (``retry_delays``); counts as a
      failed attempt. ``ConsumeResult.later(seconds)`` asks for its own delay instead.
    * ``FAILURE``: the handler failed; same treatment as ``LATER`` (retried after the ladder,
      counted), with "handler returned FAILURE" as the recorded reason.

    A handler that raises counts as ``LATER``; the exception is logged and its text is the
    reason recorded with the retry (and shown in the dead-letter queue). A message that fails
    again after ``max_reconsume`` redeliveries goes to the group's dead-letter queue
    ``%DLQ%<group>`` (``max_reconsume=2``: three deliveries in all).

    Batch handlers (``batch_size > 1``) may also return an ``int`` ``n``: the first ``n``
    messages of the batch succeeded (are acked) and the rest are retried as ``LATER``
    (RocketMQ's ackIndex, as a count: ``return 0`` retries all, ``return len(msgs)`` acks all;
    values outside ``0..len(msgs)`` are clamped).
    """

    SUCCESS = "success"
    LATER = "later"
    FAILURE = "failure"

    @staticmethod
    def later(seconds: float, reason: str = "") -> Later:
        """A LATER with its own delay: redeliver ``seconds`` from now (counts as an attempt).

        Raises:
            ConfigError: ``seconds`` is negative.
        """
        return Later(seconds, reason)


@dataclass(frozen=True, slots=True)
class Later:
    """A handler's request to retry after ``delay`` seconds (see :meth:`ConsumeResult.later`).

    Attributes:
        delay: seconds until the message is delivered again (0: at once).
        reason: recorded with the retry (shown in the dead-letter queue).
    """

    delay: float
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.delay >= 0:
            raise ConfigError(f"retry delay must be >= 0 seconds, not {self.delay}")


HandlerResult = ConsumeResult | Later | int | None
"""What a handler may return (``int``: batch handlers only, see :class:`ConsumeResult`)."""


@dataclass(frozen=True, slots=True)
class Raised:
    """A handler raised: the reason recorded with its retry."""

    reason: str


@dataclass(frozen=True, slots=True)
class Caught:
    """A handler in a pool thread raised ``exc`` (logged and settled on the loop thread)."""

    exc: BaseException


def decision(res: object, n: int) -> tuple[float, str, bool] | None:
    """None (ack) or (delay, reason, counts) for a handler's result; delay -1: the ladder."""
    if res is None or res is ConsumeResult.SUCCESS:
        return None
    if res is ConsumeResult.LATER:
        return (-1.0, "handler returned LATER", True)
    if res is ConsumeResult.FAILURE:
        return (-1.0, "handler returned FAILURE", True)
    if isinstance(res, Later):
        return (res.delay, res.reason or f"handler asked to retry in {res.delay:g} s", True)
    if isinstance(res, Raised):
        return (-1.0, res.reason, True)
    log.error("push consumer handler returned %r; expected a ConsumeResult%s (retried later)",
              res, " or an int" if n > 1 else "")
    return (-1.0, f"handler returned {type(res).__name__}, not a ConsumeResult", True)


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is an ``async def`` function (or an object with an async ``__call__``)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    )
