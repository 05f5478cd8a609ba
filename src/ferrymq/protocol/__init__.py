"""The FerryMQ wire protocol, sans-IO: bytes in, events out.

Nothing in this package opens a socket, starts an event loop, touches a file or reads a clock
(a ruff rule in ``protocol/ruff.toml`` and ``tests/unit/test_layers.py`` enforce it). The broker,
the clients and the fuzzers share this one implementation.

Modules: :mod:`.codes` (error codes), :mod:`.records` (the record-batch format: the wire batch
is the disk batch), :mod:`.frames` (frame header, incremental decoder), :mod:`.messages`
(request and response types per API), :mod:`.auth` (SCRAM), :mod:`.client` (the client side of
a connection: correlation, answers, error codes as exceptions, the handshake; driven by the
asyncio clients and by the Spark connector).
"""

from ferrymq.protocol.codes import ErrorCode

__all__ = ["ErrorCode"]
