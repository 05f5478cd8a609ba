"""A Kafka handler's answer, built once FerryMQ's handler has answered: the Kafka response is
a function of FerryMQ's, chained onto an awaitable (in a task) or a future (by a callback, with
no task: Produce's hot path)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


async def later(answer: Awaitable[Any], respond: Callable[[Any], Any]) -> Any:
    """``respond`` applied to ``answer`` once it is ready (awaited: run it as a task)."""
    return respond(await answer)


def then(answer: asyncio.Future[Any], respond: Callable[[Any], Any]) -> asyncio.Future[Any]:
    """:func:`later` for a future, without a task (a task's creation and its steps cost more
    than the callback): a future of ``respond(answer's result)``; an error or a cancel of
    ``answer``, or an error of ``respond``, is passed on."""
    out: asyncio.Future[Any] = answer.get_loop().create_future()

    def done(f: asyncio.Future[Any]) -> None:
        if out.done():
            return
        if f.cancelled():
            out.cancel()
            return
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
            return
        try:
            out.set_result(respond(f.result()))
        except Exception as err:  # noqa: BLE001 - the listener answers the failure
            out.set_exception(err)

    answer.add_done_callback(done)
    return out
