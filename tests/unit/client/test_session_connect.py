"""A connection attempt whose caller went away (cancelled) and that then fails: its error is
not reported by asyncio as "Task exception was never retrieved" (seen in the failover bench,
where a request's timeout cancels the wait for a reconnect to a killed broker)."""

from __future__ import annotations

import asyncio
import gc
import socket
from typing import Any

from ferrymq.client._session import Session


def _refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: connecting there is refused


def test_a_failed_connect_nobody_waits_for_is_not_reported_unretrieved() -> None:
    reports: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: reports.append(ctx))
        s = Session(f"127.0.0.1:{_refused_port()}", give_up_when_refused=True)
        waiter = asyncio.ensure_future(s.connection())
        await asyncio.sleep(0)  # the attempt has started
        waiter.cancel()
        await asyncio.sleep(0.3)  # ... and failed: refused
        await s.close()
        del waiter, s
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    gc.collect()
    assert not [r for r in reports if "never retrieved" in str(r.get("message"))], reports
