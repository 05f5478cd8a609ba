"""Half messages in a cluster: the half log is replicated and its leader owns every half message.

Theory of operation
-------------------
CLUSTER.md's pattern for stateful services, as for transactions (:mod:`ferrymq.broker.txn.
cluster`): the half topic ``%HALF%transactions`` is a cluster topic of one queue, replicated
with the cluster's default replicas and ``min_insync``, created through the metadata store the
first time a broker is asked about a half message. Its leader owns every half message:
PREPARE_HALF, END_HALF and HALF_CHECK_POLL reaching another broker are answered
NOT_COORDINATOR, and the producer follows the owner (:mod:`ferrymq.client._coordinator`).

* **Writes.** A half message is answered once the half queue's high watermark covers it, and so
  is a decision: END_HALF's ROLLBACK answers once its op record is replicated, a COMMIT once
  its copy in the target queue is (``acks="all"``) and then its op record. A decision answered
  before the owner dies therefore stands: the next owner finds its op record.
* **The committed copy** goes to the target queue's leader: appended here when this broker
  leads it, else sent there as a PRODUCE with ``acks="all"`` (:meth:`HalfCluster.produce`).
* **Failover.** A broker that starts leading the half queue reads it from its start
  (:meth:`~ferrymq.broker.half_messages.manager.HalfMessageManager.rebuild`: the floor
  checkpoint is each broker's own, so it is not used on a cluster): half messages without an op
  record are pending again, each checked back ``check_after`` after it was stored (at once if
  that is past), with its check count starting over; polls of producers waiting at the old
  owner end with its connection, and they poll the new one. A broker that stops leading it
  forgets the pending set and answers its waiting polls (empty).
* As on one broker, an owner that dies after the copy was written but before the op record was
  replicated may commit twice (the check-back asks again: at-least-once, docs/half-messages.md).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ferrymq.broker.internal_owner import InternalTopicOwner
from ferrymq.broker.topics import replicated
from ferrymq.cluster.model import NO_LEADER
from ferrymq.errors import (
    BrokerError,
    ConnectionClosedError,
    FerryMQTimeoutError,
    NotLeaderError,
    error_for_code,
)
from ferrymq.protocol import messages as m
from ferrymq.protocol.half_messages import HALF_TOPIC
from ferrymq.protocol.messages import Acks

if TYPE_CHECKING:
    from ferrymq.broker.cluster_link import ClusterLink
    from ferrymq.broker.half_messages.manager import HalfMessageManager
    from ferrymq.broker.topics import QueueState

log = logging.getLogger("ferrymq.broker")

COPY_TIMEOUT_MS = 30_000
"""How long a committed copy sent to another broker may take (``acks="all"``)."""


class HalfCluster(InternalTopicOwner):
    """The half-message owner's part in a cluster (see the module docstring)."""

    topic = HALF_TOPIC
    service = "half messages"

    def __init__(self, link: ClusterLink) -> None:
        super().__init__(link)
        self.manager: HalfMessageManager = link.server.half_messages
        self.manager.attach(self)

    def on_role(self, leads: bool, new_epoch: bool) -> None:
        """This broker now leads the half queue (``new_epoch``: not at this epoch before:
        read it again) or not (forget the half messages)."""
        if leads and (new_epoch or not self.leads):
            self.manager.rebuild()
            self.leads = True
        elif not leads and self.leads:
            self.leads = False
            self.manager.forget()
            log.info("no longer owning half messages (%s moved)", HALF_TOPIC)

    def is_local(self, qs: QueueState) -> bool:
        """Whether this broker leads ``qs`` (writes a committed copy there itself)."""
        rec = self.link.node.view.queues.get((qs.topic, qs.queue))
        return rec is not None and rec.leader == self.link.node.broker_id

    async def replicated(self, qs: QueueState, end: int) -> None:
        """Wait until ``qs``'s high watermark covers ``end`` (acks="all").

        Raises:
            NotLeaderError, NotEnoughReplicasError: not replicated here.
        """
        rep = qs.replica
        if rep is None:
            raise NotLeaderError(f"{qs} has no replica role here")
        await replicated(rep, end)

    async def produce(self, qs: QueueState, batch: bytes | bytearray) -> int:
        """Send a committed copy to ``qs``'s leader (another broker), ``acks="all"``; its
        offset there.

        Raises:
            BrokerError: refused (NOT_LEADER when its leader is unknown or unreachable).
        """
        rec = self.link.node.view.queues.get((qs.topic, qs.queue))
        leader = rec.leader if rec is not None else NO_LEADER
        if leader == NO_LEADER:
            raise NotLeaderError(f"{qs} has no leader now")
        req = m.ProduceRequest(COPY_TIMEOUT_MS, [(qs.topic, qs.queue, bytes(batch))], Acks.ALL)
        try:
            resp = await self.link.txn.peers.request(leader, req, m.ProduceResponse,
                                                     COPY_TIMEOUT_MS / 1000 + 5)
        except (ConnectionClosedError, FerryMQTimeoutError) as exc:
            raise NotLeaderError(f"the leader of {qs} (broker {leader}) did not answer: "
                                 f"{exc}") from None
        for _t, _q, code, msg, base, *_ in resp.results:
            if code:
                raise error_for_code(code, msg)
            return int(base)
        raise BrokerError(f"no answer for {qs} in the produce to broker {leader}")
