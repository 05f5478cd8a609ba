"""Request handlers, one module per concern, and the api-key -> handler table.

A handler takes ``(connection, request)`` and returns a response body, or an awaitable of one when
it must wait (fsync, long polling). It sees the broker and the connection through the protocols
of :mod:`ferrymq.broker.context`, never the server class. It raises
:class:`~ferrymq.errors.BrokerError` subclasses for errors; :mod:`ferrymq.broker.connection`
turns them into wire codes in one place.
"""

from __future__ import annotations

from ferrymq.broker.context import Handler
from ferrymq.broker.handlers import (
    admin,
    auth,
    cluster,
    consumer_groups,
    delivery,
    fetch,
    half_messages,
    keys,
    offsets,
    produce,
    schedule,
    txn,
    users,
)
from ferrymq.protocol.messages import ApiKey

__all__ = ["HANDLERS", "Handler"]

HANDLERS: dict[int, Handler] = {
    ApiKey.HELLO: admin.hello,
    ApiKey.PING: admin.ping,
    ApiKey.METADATA: admin.metadata,
    ApiKey.CREATE_TOPIC: admin.create_topic,
    ApiKey.DELETE_TOPIC: admin.delete_topic,
    ApiKey.DESCRIBE_TOPIC: admin.describe_topic,
    ApiKey.INIT_PRODUCER: admin.init_producer,
    ApiKey.PRODUCE: produce.produce,
    ApiKey.FETCH: fetch.fetch,
    ApiKey.LIST_OFFSETS: offsets.list_offsets,
    ApiKey.COMMIT_OFFSETS: offsets.commit_offsets,
    ApiKey.FETCH_OFFSETS: offsets.fetch_offsets,
    ApiKey.RESET_OFFSETS: offsets.reset_offsets,
    ApiKey.JOIN_GROUP: consumer_groups.join_group,
    ApiKey.HEARTBEAT: consumer_groups.heartbeat,
    ApiKey.LEAVE_GROUP: consumer_groups.leave_group,
    ApiKey.LIST_GROUPS: consumer_groups.list_groups,
    ApiKey.DESCRIBE_GROUP: consumer_groups.describe_group,
    ApiKey.DELETE_GROUP: consumer_groups.delete_group,
    ApiKey.DELIVERY_HEARTBEAT: delivery.delivery_heartbeat,
    ApiKey.RECEIVE: delivery.receive,
    ApiKey.ACK: delivery.ack,
    ApiKey.NACK: delivery.nack,
    ApiKey.CHANGE_INVISIBLE: delivery.change_invisible,
    ApiKey.DELIVERY_LEAVE: delivery.delivery_leave,
    ApiKey.DESCRIBE_DELIVERY: delivery.describe_delivery,
    ApiKey.MESSAGE_STATUS: half_messages.message_status,  # half messages, else delivery's
    ApiKey.DLQ_ADMIN: delivery.dlq_admin,
    ApiKey.SKIP_MESSAGE: delivery.skip_message,
    ApiKey.FIND_BY_KEY: keys.find_by_key,
    ApiKey.CANCEL_SCHEDULED: schedule.cancel_scheduled,
    ApiKey.PREPARE_HALF: half_messages.prepare_half,
    ApiKey.END_HALF: half_messages.end_half,
    ApiKey.HALF_CHECK_POLL: half_messages.half_check_poll,
    ApiKey.INIT_TXN: txn.init_txn,
    ApiKey.END_TXN: txn.end_txn,
    ApiKey.TXN_OFFSET_COMMIT: txn.txn_offset_commit,
    ApiKey.COMMIT_STAGED: txn.commit_staged,
    ApiKey.ABORT_STAGED: txn.abort_staged,
    ApiKey.DESCRIBE_TXNS: txn.describe_txns,
    ApiKey.TXN_ADD_QUEUE: txn.txn_add_queue,
    ApiKey.TXN_MARKERS: txn.txn_markers,
    ApiKey.AUTH_START: auth.auth_start,
    ApiKey.AUTH_FINISH: auth.auth_finish,
    ApiKey.WHOAMI: auth.whoami,
    ApiKey.UPSERT_USER: users.upsert_user,
    ApiKey.DELETE_USER: users.delete_user,
    ApiKey.LIST_USERS: users.list_users,
    ApiKey.CLUSTER_METADATA: cluster.cluster_metadata,
    ApiKey.REPLICA_FETCH: cluster.replica_fetch,
    ApiKey.OFFSET_FOR_EPOCH: cluster.offset_for_epoch,
    ApiKey.ELECT_PREFERRED_LEADERS: cluster.elect_preferred_leaders,
    ApiKey.DRAIN_BROKER: cluster.drain_broker,
    ApiKey.REASSIGN_QUEUE: cluster.reassign_queue,
}
assert set(HANDLERS) == set(ApiKey)
