"""The broker that leads a one-queue internal cluster topic owns a service: transactions
(``%TXN%state``, :mod:`ferrymq.broker.txn.cluster`) and half messages
(``%HALF%transactions``, :mod:`ferrymq.broker.half_messages.cluster`). Who that is, the topic
created through the metadata store when a request first needs it, and the NOT_COORDINATOR
other brokers answer (retriable: clients look the leader up and go there)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, ClassVar

from ferrymq.cluster.model import NO_LEADER
from ferrymq.errors import NotCoordinatorError

if TYPE_CHECKING:
    from ferrymq.broker.cluster_link import ClusterLink


class InternalTopicOwner:
    """The part of a service's cluster role common to its owners (see the module docstring).

    Subclasses name :attr:`topic`, :attr:`service` (what the topic holds, in messages), and
    how they call the owner (:attr:`owner_noun`, :attr:`owner_verb`)."""

    topic: ClassVar[str]
    service: ClassVar[str]
    owner_noun: ClassVar[str] = "owner"
    owner_verb: ClassVar[str] = "own"

    def __init__(self, link: ClusterLink) -> None:
        self.link = link
        self.leads = False
        """This broker leads the topic's queue and rebuilt the service's state from it."""
        self._creating: asyncio.Task[None] | None = None

    def owner(self) -> int:
        """The broker leading the topic's queue (NO_LEADER: none now)."""
        rec = self.link.node.view.queues.get((self.topic, 0))
        return rec.leader if rec is not None else NO_LEADER

    def check_owner(self, what: str) -> None:
        """Raise unless this broker owns the service (asking the cluster to create the topic
        when it does not exist yet).

        Raises:
            NotCoordinatorError: another broker does, or none yet.
        """
        if self.leads:
            return
        if self.topic not in self.link.server.topics.topics:
            if self._creating is None or self._creating.done():
                self._creating = asyncio.get_running_loop().create_task(
                    self.link.groups.create_internal(self.topic, 1, self.service))
            raise NotCoordinatorError(f"{what} has no {self.owner_noun} yet: the cluster is "
                                      f"creating {self.topic}; retry")
        leader = self.owner()
        now = f"broker {leader} leads it" if leader != NO_LEADER else "it has no leader now"
        raise NotCoordinatorError(f"broker {self.link.node.broker_id} does not "
                                  f"{self.owner_verb} {what}: {self.service} are in "
                                  f"{self.topic} and {now}")
