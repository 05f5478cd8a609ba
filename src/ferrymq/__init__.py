"""FerryMQ: a durable message broker in Python.

Start a broker with ``ferrymq broker`` (or ``make run``), then::

    from ferrymq import Message, Producer, PullConsumer

    with Producer("127.0.0.1:9876") as p:
        p.send(Message("orders", b"order #1", tags="created"))

    with PullConsumer("127.0.0.1:9876", group="billing", auto_offset_reset="earliest") as c:
        c.subscribe("orders", "created || paid")
        for msg in c.poll(timeout=1.0):
            print(msg.offset, msg.body)

``Broker`` (a broker in this process, for tests and scripts) is imported on first use: a client
never loads the broker's modules.
"""

from typing import TYPE_CHECKING

from ferrymq import _deprecated
from ferrymq._version import __version__
from ferrymq.client import (
    AdminClient,
    AsyncAdminClient,
    AsyncHalfMessageProducer,
    AsyncProducer,
    AsyncPullConsumer,
    AsyncPushConsumer,
    AsyncSimpleConsumer,
    ConsumeResult,
    Durability,
    HalfMessageProducer,
    HalfMessageResult,
    HalfState,
    LeasedMessage,
    Message,
    Producer,
    PullConsumer,
    PushConsumer,
    ReceivedMessage,
    SendResult,
    SimpleConsumer,
)
from ferrymq.errors import FerryMQError

if TYPE_CHECKING:
    from ferrymq.broker.embedded import Broker
else:
    _renamed = _deprecated.module_getattr(__name__, _deprecated.HALF_MESSAGE_CLIENT)

    def __getattr__(name: str) -> object:
        """``Broker`` on first use (PEP 562), so that ``import ferrymq`` leaves the broker out;
        the names before issue 19 (``TransactionProducer``, ...), deprecated."""
        if name == "Broker":
            from ferrymq.broker.embedded import Broker as broker_class

            globals()["Broker"] = broker_class
            return broker_class
        return _renamed(name)

    def __dir__() -> list[str]:
        return sorted({*globals(), "Broker"})

__all__ = [
    "AdminClient",
    "AsyncAdminClient",
    "AsyncHalfMessageProducer",
    "AsyncProducer",
    "AsyncPullConsumer",
    "AsyncPushConsumer",
    "AsyncSimpleConsumer",
    "Broker",
    "ConsumeResult",
    "Durability",
    "FerryMQError",
    "HalfMessageProducer",
    "HalfMessageResult",
    "HalfState",
    "LeasedMessage",
    "Message",
    "Producer",
    "PullConsumer",
    "PushConsumer",
    "ReceivedMessage",
    "SendResult",
    "SimpleConsumer",
    "__version__",
]
