"""DELIVERY_HEARTBEAT, RECEIVE, ACK, NACK, CHANGE_INVISIBLE, DELIVERY_LEAVE, DESCRIBE_DELIVERY,
MESSAGE_STATUS, DLQ_ADMIN, SKIP_MESSAGE: the wire side of :mod:`ferrymq.broker.delivery`.

In sync flush mode an answer that reports a state change (a lease, an ack, a policy) is sent
only after the delivery journal holding that change is fsynced (group commit with the logs).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, TypeVar

from ferrymq.broker.scheduler import CANCELLED_STATE, NOT_SCHEDULED, PENDING
from ferrymq.broker.topics import wait_for_wakeup
from ferrymq.errors import InvalidRequestError, UnknownMemberError
from ferrymq.protocol import messages as m
from ferrymq.protocol.records import decode_msg_id

if TYPE_CHECKING:
    from ferrymq.broker.context import BrokerContext, ClientConnection

B = TypeVar("B", bound=m.Body)

MAX_SUBSCRIPTIONS = 256
"""Most topics one delivery-group member may subscribe to."""
MISSING_TOPIC_CHECK_S = 1.0
"""A long-polling RECEIVE that subscribes to a topic that does not exist yet looks for it again
this often (nothing wakes it when a topic is created)."""


def _after(srv: BrokerContext, group: str, pos: int, resp: B) -> B | asyncio.Future[B]:
    """``resp`` now, or once journal position ``pos`` is durable (fsynced in sync flush mode;
    in a cluster, replicated)."""
    if pos < 0 or not srv.delivery.answers_wait:
        return resp
    fut: asyncio.Future[B] = asyncio.get_running_loop().create_future()

    def done(exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(resp)

    srv.delivery.when_durable(group, pos, done)
    return fut


def _coordinated(srv: BrokerContext, group: str, *, create: bool = False) -> None:
    """Raise NOT_COORDINATOR unless this broker serves ``group`` (always, on a single broker;
    in a cluster, the leader of its retry queue: :mod:`ferrymq.broker.cluster_delivery`, which
    creates that queue for a heartbeat, ``create``)."""
    if srv.cluster is not None:
        srv.cluster.delivery.check_coordinator(group, create=create)


def delivery_heartbeat(
    conn: ClientConnection, req: m.DeliveryHeartbeatRequest
) -> m.DeliveryHeartbeatResponse | asyncio.Future[m.DeliveryHeartbeatResponse]:
    """Register or keep alive a member; set the group's retry policy."""
    srv = conn.server
    _coordinated(srv, req.group, create=True)
    timeout = srv.config.session_timeout_ms(req.session_timeout_ms)
    if len(req.subscriptions) > MAX_SUBSCRIPTIONS:
        raise InvalidRequestError(f"at most {MAX_SUBSCRIPTIONS} subscriptions")
    g, mem, pos = srv.delivery.heartbeat(
        req.group, req.member_id, req.client_id or conn.client_id, conn.peer,
        req.subscriptions, timeout, req.retry_delays_ms, req.max_reconsume, req.start_from,
        req.orderly, exclusive=req.exclusive, ephemeral=req.ephemeral, link=conn,
    )
    return _after(srv, g.name, pos,
                  m.DeliveryHeartbeatResponse(mem.member_id, len(g.members), g.ephemeral))


def receive(
    conn: ClientConnection, req: m.ReceiveRequest
) -> m.ReceiveResponse | asyncio.Future[m.ReceiveResponse]:
    """Lease messages now, or long-poll until some arrive or ``max_wait_ms`` passes."""
    srv = conn.server
    _coordinated(srv, req.group)
    cfg = srv.config
    g, mem = srv.delivery.member(req.group, req.member_id)
    invisible = req.invisible_ms or cfg.default_invisible_ms
    srv.delivery.check_invisible(invisible)
    if req.max_messages <= 0 or req.max_bytes <= 0:
        raise InvalidRequestError("max_messages and max_bytes must be positive")
    subs = req.subscriptions or mem.subscriptions
    if not subs:
        raise InvalidRequestError("no subscriptions: subscribe to a topic first")
    if len(subs) > MAX_SUBSCRIPTIONS:
        raise InvalidRequestError(f"at most {MAX_SUBSCRIPTIONS} subscriptions")
    out, pos = srv.delivery.receive(g, req.member_id, subs, req.max_messages, req.max_bytes,
                                    invisible)
    wait_ms = min(max(req.max_wait_ms, 0), cfg.max_fetch_wait_ms)
    if out or wait_ms == 0:
        return _after(srv, g.name, pos, m.ReceiveResponse(invisible, out))
    return asyncio.ensure_future(_long_poll(conn, req, subs, invisible, wait_ms / 1000.0))


async def _long_poll(
    conn: ClientConnection, req: m.ReceiveRequest, subs: list[tuple[str, str]],
    invisible: int, wait_s: float,
) -> m.ReceiveResponse:
    srv = conn.server
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        # Receive, then register for wake-ups, in one step: what became visible after the
        # handler's first receive and before this task ran (a flush, a retry letter's copy)
        # woke nobody, so it is looked for here, not waited for.
        _coordinated(srv, req.group)
        g = srv.delivery.group(req.group)
        if req.member_id not in g.members:
            raise UnknownMemberError(f"member {req.member_id[:100]!r} was evicted; heartbeat")
        g, _ = srv.delivery.member(req.group, req.member_id)
        out, pos = srv.delivery.receive(g, req.member_id, subs, req.max_messages, req.max_bytes,
                                        invisible)
        if out:
            resp = _after(srv, g.name, pos, m.ReceiveResponse(invisible, out))
            return await resp if isinstance(resp, asyncio.Future) else resp
        remaining = deadline - loop.time()
        if remaining <= 0 or srv.shutting_down:
            return m.ReceiveResponse(invisible, [])
        if not all(t in srv.topics.topics for t, _ in subs):
            remaining = min(remaining, MISSING_TOPIC_CHECK_S)
        await wait_for_wakeup(srv.delivery.wakeups(g, subs), remaining)


def ack(
    conn: ClientConnection, req: m.AckRequest
) -> m.AckResponse | asyncio.Future[m.AckResponse]:
    """Finish leased messages (the refused ones come back with INVALID_RECEIPT)."""
    srv = conn.server
    _coordinated(srv, req.group)
    g = srv.delivery.group(req.group)
    failed, pos = srv.delivery.ack(g, req.entries)
    return _after(srv, g.name, pos, m.AckResponse(failed))


def nack(conn: ClientConnection, req: m.NackRequest
         ) -> m.ReceiptResponse | asyncio.Future[m.ReceiptResponse]:
    """Give leased messages back for a later attempt; in sync mode answered once their new
    state is durable."""
    _coordinated(conn.server, req.group)
    g = conn.server.delivery.group(req.group)
    results, waits = conn.server.delivery.nack(g, req.entries)
    resp = m.ReceiptResponse(results)
    if not waits:
        return resp

    async def durable() -> m.ReceiptResponse:
        await asyncio.gather(*waits)
        return resp

    return asyncio.ensure_future(durable())


def change_invisible(
    conn: ClientConnection, req: m.ChangeInvisibleRequest
) -> m.ReceiptResponse | asyncio.Future[m.ReceiptResponse]:
    """Renew or shorten leases; each answer carries the new lease id."""
    srv = conn.server
    _coordinated(srv, req.group)
    g = srv.delivery.group(req.group)
    results, pos = srv.delivery.change_invisible(g, req.member_id, req.entries)
    return _after(srv, g.name, pos, m.ReceiptResponse(results))


def delivery_leave(conn: ClientConnection, req: m.DeliveryLeaveRequest) -> m.Empty:
    """Leave; held leases go back to the group at once."""
    _coordinated(conn.server, req.group)
    conn.server.delivery.leave(req.group, req.member_id)
    return m.Empty()


def describe_delivery(
    conn: ClientConnection, req: m.DescribeDeliveryRequest
) -> m.DescribeDeliveryResponse:
    """Members, progress, lag, retry and DLQ sizes of one delivery group."""
    _coordinated(conn.server, req.group)
    return conn.server.delivery.describe(req.group)


def message_status(conn: ClientConnection, req: m.MessageStatusRequest) -> m.MessageStatusResponse:
    """The consume status of one message in each delivery group; for a scheduled (delayed)
    message, its scheduling state instead: groups never consume the original, only the copy the
    scheduler appends when it is due."""
    srv = conn.server
    resp = srv.delivery.message_status(req.msg_id)
    tid, queue, offset = decode_msg_id(req.msg_id)  # valid: message_status checked it
    state, due = srv.scheduler.lookup(tid, queue, offset)
    if state == NOT_SCHEDULED:
        return resp
    if state == PENDING:
        row = ("SCHEDULED", "", -1, 0, due, "not due yet (ferrymq message cancel MSG_ID cancels)",
               -1)
    elif state == CANCELLED_STATE:
        row = ("CANCELLED", "", -1, 0, -1, "cancelled before it was due", -1)
    else:  # FIRED or DONE
        row = ("FIRED", "", -1, 0, -1,
               "came due: consumers got a copy with its own id (its %SCHEDULED_ID property "
               "names this message)", due)
    groups = [st[0] for st in resp.statuses] or ["-"]
    return m.MessageStatusResponse(resp.topic, resp.queue, resp.offset,
                                   [(g, *row) for g in groups])


def skip_message(conn: ClientConnection, req: m.SkipMessageRequest) -> m.Empty:
    """Dead-letter a stuck message of an orderly group on purpose (its key moves on)."""
    _coordinated(conn.server, req.group)
    conn.server.delivery.skip(req.group, req.msg_id)
    return m.Empty()


def dlq_admin(
    conn: ClientConnection, req: m.DlqAdminRequest
) -> m.DlqAdminResponse | asyncio.Future[m.DlqAdminResponse]:
    """Redrive or purge dead letters."""
    srv = conn.server
    _coordinated(srv, req.group)
    if req.max_messages < 0:
        raise InvalidRequestError("max_messages must be >= 0")
    if req.offset < -1:
        raise InvalidRequestError(f"offset must be >= 0 (one dead letter) or -1 (the oldest), "
                                  f"not {req.offset}")
    resp, pos = srv.delivery.dlq_admin(req.group, req.action, req.max_messages, req.dry_run,
                                       req.offset)
    return _after(srv, req.group, pos, resp)
