"""FerryMQ clients: asyncio classes and their synchronous facades."""

from typing import TYPE_CHECKING

from ferrymq import _deprecated
from ferrymq.client._delivery import LeasedMessage
from ferrymq.client.admin import AsyncAdminClient
from ferrymq.client.consumer import AsyncPullConsumer
from ferrymq.client.half_messages import (
    AsyncHalfMessageProducer,
    HalfMessageProducer,
    HalfMessageResult,
    HalfState,
)
from ferrymq.client.message import Durability, Message, ReceivedMessage, SendResult
from ferrymq.client.producer import AsyncProducer
from ferrymq.client.push import AsyncPushConsumer, ConsumeResult, PushConsumer
from ferrymq.client.simple import AsyncSimpleConsumer
from ferrymq.client.sync import AdminClient, Producer, PullConsumer, SimpleConsumer

__all__ = [
    "AdminClient",
    "AsyncAdminClient",
    "AsyncHalfMessageProducer",
    "AsyncProducer",
    "AsyncPullConsumer",
    "AsyncPushConsumer",
    "AsyncSimpleConsumer",
    "ConsumeResult",
    "Durability",
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
]

if not TYPE_CHECKING:  # the names before issue 19, deprecated (type checkers do not see them)
    __getattr__ = _deprecated.module_getattr(__name__, _deprecated.HALF_MESSAGE_CLIENT)
