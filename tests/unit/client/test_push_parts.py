"""The push consumer's parts without a broker: what a handler's result becomes, the lease
bookkeeping that settles messages, the names of broadcasting members."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

import pytest

from ferrymq.client._delivery import DeliveryCore, LeasedMessage
from ferrymq.client._push_leases import Leases
from ferrymq.client._push_results import ConsumeResult, Later, Raised, decision, is_async
from ferrymq.client._session import Session
from ferrymq.client.message import BatchContext, Message
from ferrymq.client.push import broadcast_group
from ferrymq.errors import ConfigError
from ferrymq.protocol.records import decode_header, encode_batch, walk_records


def test_results_become_acks_or_nacks() -> None:
    assert decision(None, 1) is None
    assert decision(ConsumeResult.SUCCESS, 1) is None
    assert decision(ConsumeResult.LATER, 1) == (-1.0, "handler returned LATER", True)
    assert decision(ConsumeResult.FAILURE, 1) == (-1.0, "handler returned FAILURE", True)
    assert decision(ConsumeResult.later(2.5), 1) == (2.5, "handler asked to retry in 2.5 s", True)
    assert decision(Later(0, "busy"), 1) == (0, "busy", True)
    assert decision(Raised("handler raised KeyError: 'x'"), 1) == (
        -1.0, "handler raised KeyError: 'x'", True)


def test_an_unexpected_result_is_logged_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, "ferrymq.client"):
        assert decision("ok", 3) == (-1.0, "handler returned str, not a ConsumeResult", True)
    assert "expected a ConsumeResult or an int" in caplog.text


def test_a_negative_delay_is_refused() -> None:
    with pytest.raises(ConfigError, match="retry delay must be >= 0 seconds, not -1"):
        ConsumeResult.later(-1)


def test_handler_kinds() -> None:
    async def coro(_m: Any) -> None:
        return None

    class Callable:
        async def __call__(self, _m: Any) -> None:
            return None

    assert is_async(coro) and is_async(Callable())
    assert not is_async(lambda _m: None) and not is_async(print)


def test_broadcast_group_names_are_sanitized_and_bounded() -> None:
    assert broadcast_group("billing", "host a/1") == "billing.host_a_1"
    assert len(broadcast_group("g", "x" * 500)) == 200


# -- leases --------------------------------------------------------------------------------------


def _leased(offset: int) -> LeasedMessage:
    """A message leased at ``offset`` of t/0 (a real record: the body is decoded)."""
    buf = bytes(encode_batch([Message("t", f"m{offset}").to_record(0)]))

    def lease(ctx: BatchContext, buf: bytes, pos: int, _first: int) -> LeasedMessage:
        return LeasedMessage(ctx, buf, pos, offset, ("t", 0), offset, 1, 0, None)

    [msg] = walk_records(buf, 0, decode_header(buf), 0, lease, BatchContext("t", 0, 1, 0, 0))
    assert msg.body == f"m{offset}".encode()
    return msg


def _leases() -> Leases:
    core = DeliveryCore(Session("127.0.0.1:1"), "g")
    return Leases(core, "g", collections.Counter(), invisible_duration=30.0,
                  consume_timeout=900.0)


def test_held_messages_leave_when_settled() -> None:
    async def main() -> None:
        leases = _leases()
        a, b = _leased(0), _leased(1)
        leases.hold([a, b], 100.0)
        assert leases.held == {a: 130.0, b: 130.0} and leases.held_since == {a: 100.0, b: 100.0}
        leases.settle_one(a, None)
        leases.settle_one(b, (-1.0, "handler returned LATER", True))
        assert not leases.held and not leases.held_since
        assert leases.acks == [a]
        assert leases._nacks == [(b, None, "handler returned LATER", True)]  # None: the ladder
        assert leases.flush_wake.is_set()

    asyncio.run(main())


def test_a_batch_handlers_count_acks_the_first_messages() -> None:
    async def main() -> None:
        leases = _leases()
        batch = [_leased(i) for i in range(4)]
        leases.hold(batch, 0.0)
        leases.settle_batch(batch, 3)
        assert leases.acks == batch[:3]
        assert leases._nacks == [(batch[3], None, "batch handler acknowledged 3 of 4 messages",
                                  True)]
        leases.settle_batch(batch, 99)  # clamped to the batch
        assert leases.acks == batch[:3] + batch

    asyncio.run(main())


def test_handing_back_does_not_count_an_attempt() -> None:
    async def main() -> None:
        leases = _leases()
        a = _leased(0)
        leases.hold([a], 0.0)
        leases.hand_back([a], "consumer closing: never handled")
        assert not leases.held
        assert leases._nacks == [(a, 0.0, "consumer closing: never handled", False)]

    asyncio.run(main())


def test_messages_held_past_consume_timeout_are_no_longer_renewed(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        leases = _leases()
        old, new = _leased(0), _leased(1)
        leases.hold([old], 0.0)
        leases.hold([new], 950.0)
        with caplog.at_level(logging.WARNING, "ferrymq.client"):
            assert leases._drop_timed_out([old, new], 1000.0) == [new]
        assert list(leases.held) == [new]
        assert "held longer than consume_timeout=900 s" in caplog.text

    asyncio.run(main())
