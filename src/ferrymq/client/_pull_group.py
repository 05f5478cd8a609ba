"""A pull consumer's membership of its consumer group: JOIN_GROUP, heartbeats, LEAVE_GROUP.

Theory of operation
-------------------
A consumer that subscribes is a member of its group (``broker/consumer_groups.py`` assigns the queues).
:meth:`GroupMembership.join` sends JOIN_GROUP with the subscribed topics and keeps the member id
and generation the broker answers; the consumer then takes the assignment and resolves its
positions from the group's committed offsets. :meth:`GroupMembership.start_heartbeat` starts
the heartbeat task (one per consumer), which every ``heartbeat_interval_s`` tells the broker the
member is alive. When the broker answers that the group rebalances, or that the generation or
the member is unknown, the task sets :attr:`GroupMembership.need_join`: the consumer's next
:meth:`~ferrymq.client.consumer.AsyncPullConsumer.poll` commits what it finished and rejoins.
An outage is the session's to report (one warning); a failed heartbeat is not retried, the
next one comes after the interval. Requests go to the group's coordinator
(:mod:`ferrymq.client._coordinator`); when it moved (NOT_COORDINATOR: a cluster's failover),
the new one knows no member yet, so the member rejoins there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from ferrymq.client._coordinator import CoordinatorRoute
from ferrymq.client._pull_buffer import TopicQueue
from ferrymq.errors import (
    ConnectionClosedError,
    FerryMQError,
    FerryMQTimeoutError,
    IllegalGenerationError,
    NotCoordinatorError,
    RebalanceInProgressError,
    UnknownMemberError,
)
from ferrymq.protocol import messages as m

log = logging.getLogger("ferrymq.client")


class GroupMembership:
    """The member id, the generation and the heartbeat task of one pull consumer in ``group``."""

    def __init__(self, session: CoordinatorRoute, group: str, client_id: str, session_timeout_ms: int,
                 heartbeat_interval_s: float) -> None:
        self._session = session
        self.group = group
        self._client_id = client_id
        self._session_timeout_ms = session_timeout_ms
        self._heartbeat_interval_s = heartbeat_interval_s
        self.member_id = ""
        self.generation = -1  # -1: not joined (yet)
        self.need_join = False  # the group rebalanced (or the member was dropped): rejoin
        self.heartbeat: asyncio.Task[None] | None = None
        self.closed = False

    async def join(self, topics: list[str]) -> list[TopicQueue]:
        """JOIN_GROUP with ``topics``; returns the queues the broker assigned this member."""
        resp = await self._session.request(
            m.JoinGroupRequest(self.group, self.member_id, self._client_id, topics,
                               self._session_timeout_ms),
            m.JoinGroupResponse,
        )
        self.member_id = resp.member_id
        self.generation = resp.generation
        self.need_join = False
        log.info("group %s: member %s generation %d assigned %s", self.group, self.member_id,
                 self.generation, resp.assignment)
        return [(t, q) for t, q in resp.assignment]

    def start_heartbeat(self) -> None:
        """Start the heartbeat task unless it runs."""
        if self.heartbeat is None or self.heartbeat.done():
            self.heartbeat = asyncio.get_running_loop().create_task(self._heartbeat_loop())

    async def _heartbeat_loop(self) -> None:
        while not self.closed:
            await asyncio.sleep(self._heartbeat_interval_s)
            if not self.member_id:
                continue
            try:
                await self._session.request(
                    m.HeartbeatRequest(self.group, self.member_id, self.generation), m.Empty,
                    timeout_s=self._session_timeout_ms / 1000, retry=False,
                )
            except (RebalanceInProgressError, IllegalGenerationError):
                self.need_join = True
            except (UnknownMemberError, NotCoordinatorError):  # (a new coordinator: rejoin)
                self.member_id = ""
                self.need_join = True
            except (ConnectionClosedError, FerryMQTimeoutError) as exc:
                log.debug("heartbeat failed: %s", exc)  # an outage: the session warned once
            except FerryMQError as exc:
                log.warning("heartbeat failed: %s", exc)

    async def leave(self) -> None:
        """LEAVE_GROUP, best effort (the broker drops a silent member after its session
        timeout anyway)."""
        if self.member_id:
            with contextlib.suppress(FerryMQError):
                await self._session.request(m.LeaveGroupRequest(self.group, self.member_id),
                                            m.Empty, timeout_s=5.0, retry=False)
