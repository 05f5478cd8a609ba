"""The FerryMQ broker: asyncio server, topics, groups, flusher (see ``server.py``).

The names below are imported on first use (PEP 562): a module that needs one piece of the
broker (the CLI's offline users file, :mod:`ferrymq.broker.config`) does not load the server.
"""

from typing import TYPE_CHECKING

__all__ = ["Broker", "BrokerConfig", "BrokerServer", "load"]

if TYPE_CHECKING:
    from ferrymq.broker.config import BrokerConfig, load
    from ferrymq.broker.embedded import Broker
    from ferrymq.broker.server import BrokerServer
else:
    _HOMES = {"Broker": "ferrymq.broker.embedded", "BrokerConfig": "ferrymq.broker.config",
              "BrokerServer": "ferrymq.broker.server", "load": "ferrymq.broker.config"}

    def __getattr__(name: str) -> object:
        """The export ``name``, imported from its module on first use."""
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(home), name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *_HOMES})
