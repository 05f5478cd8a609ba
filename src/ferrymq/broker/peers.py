"""Requests from this broker to another broker of its cluster (not replication: that has its
own long-lived sessions in :mod:`ferrymq.cluster.replication`).

A service whose state lives on one broker sometimes needs another broker to act: the
transaction coordinator asks queues' leaders to write markers, a queue's leader asks the
coordinator to register a queue with a transaction (:mod:`ferrymq.broker.txn.cluster`). Each
such call goes through :class:`Peers`: one connection per broker, opened on first use with the
followers' login (``inter_broker_user``, the listeners' TLS), reused, and dropped when it
fails or the broker's address changes. A call gets the broker's error codes as exceptions,
and ConnectionClosedError / FerryMQTimeoutError when the broker cannot be reached: the caller
decides whether and where to retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TypeVar

from ferrymq.client._transport import Transport
from ferrymq.cluster.replication.follower import PeerLogin, connect_peer
from ferrymq.errors import ConnectionClosedError, FerryMQTimeoutError
from ferrymq.protocol import messages as m

log = logging.getLogger("ferrymq.broker")
B = TypeVar("B", bound=m.Body)


class Peers:
    """Connections to the other brokers of the cluster, by broker id.

    Args:
        broker_id: this broker's id (names its connections).
        address_of: a broker's address from the metadata view (None: unknown).
        login: how to log in (the followers' :class:`PeerLogin`).
        timeout_s: connect and request timeout.
    """

    def __init__(self, broker_id: int, address_of: Callable[[int], tuple[str, int] | None],
                 login: PeerLogin, timeout_s: float) -> None:
        self.broker_id = broker_id
        self.address_of = address_of
        self.login = login
        self.timeout_s = timeout_s
        self._conns: dict[int, tuple[tuple[str, int], Transport]] = {}
        self._opening: dict[int, asyncio.Future[Transport]] = {}

    async def request(self, broker_id: int, req: m.Request, resp_type: type[B],
                      timeout_s: float | None = None) -> B:
        """Send ``req`` to broker ``broker_id`` and return its answer.

        Raises:
            BrokerError subclass: the broker answered with an error code.
            ConnectionClosedError: unknown broker, not reachable, or the connection dropped.
            FerryMQTimeoutError: no answer in time.
        """
        t = await self._connection(broker_id)
        try:
            return await t.request(req, resp_type, timeout_s or self.timeout_s)
        except (ConnectionClosedError, FerryMQTimeoutError):
            self._drop(broker_id, t)
            raise

    async def _connection(self, broker_id: int) -> Transport:
        addr = self.address_of(broker_id)
        if addr is None:
            raise ConnectionClosedError(f"broker {broker_id} is not in the cluster's view")
        have = self._conns.get(broker_id)
        if have is not None and have[0] == addr and have[1].is_open:
            return have[1]
        if have is not None:
            self._drop(broker_id, have[1])
        opening = self._opening.get(broker_id)
        if opening is not None:
            return await asyncio.shield(opening)
        fut: asyncio.Future[Transport] = asyncio.get_running_loop().create_future()
        self._opening[broker_id] = fut
        try:
            t = await connect_peer(addr, self.login, f"ferrymq-broker-{self.broker_id}",
                                   self.timeout_s)
        except (OSError, ConnectionClosedError, FerryMQTimeoutError) as exc:
            err = ConnectionClosedError(f"broker {broker_id} at {addr[0]}:{addr[1]} not "
                                        f"reachable: {exc}")
            fut.set_exception(err)
            fut.exception()  # retrieved: waiters get it from their own await
            raise err from None
        finally:
            del self._opening[broker_id]
        fut.set_result(t)
        self._conns[broker_id] = (addr, t)
        return t

    def _drop(self, broker_id: int, t: Transport) -> None:
        have = self._conns.get(broker_id)
        if have is not None and have[1] is t:
            del self._conns[broker_id]
        t.close("dropped after a failed request")

    def close(self) -> None:
        """Close every connection."""
        for _, t in self._conns.values():
            with contextlib.suppress(Exception):
                t.close("broker stopping")
        self._conns.clear()
