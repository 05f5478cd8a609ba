"""FIND_BY_KEY: the messages of a topic that carry a key (RocketMQ's query by key).

The broker's :class:`~ferrymq.broker.keyindexer.KeyIndexer` keeps a per-queue key index in the
background; this handler asks it and checks every candidate against the records themselves.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ferrymq.errors import InvalidRequestError
from ferrymq.protocol import messages as m
from ferrymq.protocol.records import MAX_KEYS_BYTES

if TYPE_CHECKING:
    from ferrymq.broker.context import ClientConnection


def find_by_key(
    conn: ClientConnection, req: m.FindByKeyRequest
) -> asyncio.Future[m.FindByKeyResponse]:
    """Up to ``limit`` messages of ``topic`` whose keys include ``key``, newest first (the
    search yields to the event loop while it reads the log)."""
    srv = conn.server
    cap = srv.config.max_find_results
    if not 1 <= req.limit <= cap:
        raise InvalidRequestError(f"limit must be 1..{cap}, not {req.limit}")
    raw = req.key.encode()
    if not raw or b"\x00" in raw or len(raw) > MAX_KEYS_BYTES:
        raise InvalidRequestError(
            f"a key is 1..{MAX_KEYS_BYTES} bytes of UTF-8 without NUL"
        )
    t = srv.topics.get(req.topic)

    async def search() -> m.FindByKeyResponse:
        found, unindexed = await srv.key_index.find(t, req.key, req.limit)
        return m.FindByKeyResponse(t.name, t.topic_id, found, unindexed)

    return asyncio.ensure_future(search())
