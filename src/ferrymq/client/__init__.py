"""FerryMQ clients: asyncio classes and their synchronous facades."""

from ferrymq.client._delivery import LeasedMessage
from ferrymq.client.admin import AsyncAdminClient
from ferrymq.client.consumer import AsyncPullConsumer
from ferrymq.client.half_messages import (
    AsyncTransactionProducer,
    TransactionProducer,
    TransactionResult,
    TransactionState,
)
from ferrymq.client.message import Durability, Message, ReceivedMessage, SendResult
from ferrymq.client.producer import AsyncProducer
from ferrymq.client.push import AsyncPushConsumer, ConsumeResult, PushConsumer
from ferrymq.client.simple import AsyncSimpleConsumer
from ferrymq.client.sync import AdminClient, Producer, PullConsumer, SimpleConsumer

__all__ = [
    "AdminClient",
    "AsyncAdminClient",
    "AsyncProducer",
    "AsyncPullConsumer",
    "AsyncPushConsumer",
    "AsyncSimpleConsumer",
    "AsyncTransactionProducer",
    "ConsumeResult",
    "Durability",
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
]
