"""The Kafka port's answer chaining for Produce (:func:`ferrymq.kafka.answers.then`): the
answer future's outcome reaches the listener as the response, an error, or a cancel."""

from __future__ import annotations

import asyncio

import pytest

from ferrymq.kafka.answers import then


async def _chained(outcome: str) -> asyncio.Future[str]:
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[int] = loop.create_future()

    def respond(value: int) -> str:
        if value < 0:
            raise ValueError("cannot encode")
        return f"response {value}"

    out = then(answer, respond)
    assert not out.done()  # nothing before the answer
    if outcome == "result":
        answer.set_result(7)
    elif outcome == "bad result":
        answer.set_result(-1)
    elif outcome == "error":
        answer.set_exception(OSError("fsync failed"))
    else:
        answer.cancel()
    await asyncio.sleep(0)  # the callback runs on the next loop turn
    return out


def test_the_response_is_built_from_the_answer() -> None:
    out = asyncio.run(_chained("result"))
    assert out.result() == "response 7"


def test_a_failed_answer_fails_the_response() -> None:
    out = asyncio.run(_chained("error"))
    with pytest.raises(OSError, match="fsync failed"):
        out.result()


def test_a_response_that_cannot_be_built_fails_it() -> None:
    out = asyncio.run(_chained("bad result"))
    with pytest.raises(ValueError, match="cannot encode"):
        out.result()


def test_a_cancelled_answer_cancels_the_response() -> None:
    out = asyncio.run(_chained("cancelled"))
    assert out.cancelled()


def test_a_response_cancelled_first_ignores_the_answer() -> None:
    async def main() -> asyncio.Future[str]:
        answer: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        out = then(answer, str)
        out.cancel()  # the connection closed first
        answer.set_result(1)
        await asyncio.sleep(0)
        return out

    assert asyncio.run(main()).cancelled()
