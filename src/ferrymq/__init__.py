"""FerryMQ: a durable message broker in Python.

Start a broker with ``ferrymq broker`` (or ``make run``), then::

    from ferrymq import Message, Producer, PullConsumer

    with Producer("127.0.0.1:9876") as p:
        p.send(Message("orders", b"order #1", tags="created"))

    with PullConsumer("127.0.0.1:9876", group="billing", auto_offset_reset="earliest") as c:
        c.subscribe("orders", "created || paid")
        for msg in c.poll(timeout=1.0):
            print(msg.offset, msg.body)
"""

from ferrymq._version import __version__
from ferrymq.broker.embedded import Broker
from ferrymq.client import (
    AdminClient,
    AsyncAdminClient,
    AsyncProducer,
    AsyncPullConsumer,
    AsyncPushConsumer,
    AsyncSimpleConsumer,
    AsyncTransactionProducer,
    ConsumeResult,
    Durability,
    LeasedMessage,
    Message,
    Producer,
    PullConsumer,
    PushConsumer,
    ReceivedMessage,
    SendResult,
    SimpleConsumer,
    TransactionProducer,
    TransactionResult,
    TransactionState,
)
from ferrymq.errors import FerryMQError

__all__ = [
    "AdminClient",
    "AsyncAdminClient",
    "AsyncProducer",
    "AsyncPullConsumer",
    "AsyncPushConsumer",
    "AsyncSimpleConsumer",
    "AsyncTransactionProducer",
    "Broker",
    "ConsumeResult",
    "Durability",
    "FerryMQError",
    "LeasedMessage",
    "Message",
    "Producer",
    "PullConsumer",
    "PushConsumer",
    "ReceivedMessage",
    "SendResult",
    "SimpleConsumer",
    "TransactionProducer",
    "TransactionResult",
    "TransactionState",
    "__version__",
]
