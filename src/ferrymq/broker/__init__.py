"""The FerryMQ broker: asyncio server, topics, groups, flusher (see ``server.py``)."""

from ferrymq.broker.config import BrokerConfig, load
from ferrymq.broker.embedded import Broker
from ferrymq.broker.server import BrokerServer

__all__ = ["Broker", "BrokerConfig", "BrokerServer", "load"]
