"""A deposed leader, for client tests while the cluster brokers are being built: a TCP server
speaking FerryMQ's wire that answers HELLO as broker ``broker_id`` and every PRODUCE, FETCH and
LIST_OFFSETS entry with NOT_LEADER (what a broker that lost a queue's leadership answers), or
with ``whole=True`` the whole request (as a broker that refuses it before looking inside). It
is an injected fault standing in for a broker of a cluster, not a model of the client: the
client under test talks to it over a real socket, and to real brokers for everything else.
It records what it was sent, so a test can check that a retry carried the same bytes."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ferrymq._version import __version__
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.frames import FrameDecoder, encode_response

_REFUSED = "this broker does not lead the queue (deposed)"


@dataclass
class DeposedLeader:
    """Start with :meth:`start` (on the test's event loop); :attr:`address` is ``host:port``."""

    broker_id: int
    whole: bool = False
    produced: list[m.ProduceRequest] = field(default_factory=list)
    fetched: list[m.FetchRequest] = field(default_factory=list)
    listed: list[m.ListOffsetsRequest] = field(default_factory=list)
    _server: asyncio.Server | None = None

    @property
    def address(self) -> str:
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def start(self) -> DeposedLeader:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = FrameDecoder()
        try:
            while data := await reader.read(65536):
                for f in decoder.feed(data):
                    code, body = self._answer(f.api_key, bytes(f.payload))
                    writer.write(encode_response(f.api_key, f.api_version, f.correlation_id,
                                                 code, body))
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    def _answer(self, api_key: int, payload: bytes) -> tuple[int, bytes]:
        not_leader = ErrorCode.NOT_LEADER
        if api_key == m.ApiKey.HELLO:
            return 0, m.HelloResponse(__version__, self.broker_id, 8 << 20, 4 << 20, 16384,
                                      "sync").encode()
        if api_key == m.ApiKey.PING:
            return 0, b""
        if api_key in (m.ApiKey.PRODUCE, m.ApiKey.FETCH, m.ApiKey.LIST_OFFSETS) and self.whole:
            self._record(api_key, payload)
            return not_leader, _REFUSED.encode()
        if api_key == m.ApiKey.PRODUCE:
            req = m.ProduceRequest.decode(payload)
            self.produced.append(req)
            return 0, m.ProduceResponse([(t, q, not_leader, _REFUSED, -1, -1, -1, 0, -1, [])
                                         for t, q, _ in req.entries]).encode()
        if api_key == m.ApiKey.FETCH:
            freq = m.FetchRequest.decode(payload)
            self.fetched.append(freq)
            return 0, b"".join(m.FetchResponse(
                [(t, q, not_leader, _REFUSED, -1, -1, -1, b"") for t, q, *_ in freq.entries]
            ).encode_parts())
        if api_key == m.ApiKey.LIST_OFFSETS:
            lreq = m.ListOffsetsRequest.decode(payload)
            self.listed.append(lreq)
            return 0, m.ListOffsetsResponse([(t, q, not_leader, -1)
                                             for t, q, _ in lreq.entries]).encode()
        return ErrorCode.INVALID_REQUEST, b"not served by this stand-in"

    def _record(self, api_key: int, payload: bytes) -> None:
        if api_key == m.ApiKey.PRODUCE:
            self.produced.append(m.ProduceRequest.decode(payload))
        elif api_key == m.ApiKey.FETCH:
            self.fetched.append(m.FetchRequest.decode(payload))
        else:
            self.listed.append(m.ListOffsetsRequest.decode(payload))
