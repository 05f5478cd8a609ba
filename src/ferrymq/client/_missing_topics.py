"""Topics a consumer reads before they exist: wait for them instead of failing.

Theory of operation
-------------------
Consumer services often start before the producers (or the operator) that create their topics,
and Kafka consumers wait for a subscribed topic that does not exist yet. A consumer asked to read
a missing topic registers it here: :meth:`MissingTopics.check` logs one warning naming the topic
(or raises ``UnknownTopicError`` when the application asked for ``require_topic=True``, the old
fail-fast behaviour for catching typos), and :meth:`MissingTopics.appeared`, called from the
consumer's loop as often as it likes, asks the broker at most every ``recheck_s`` (one small
METADATA request without auto-creation: no busy loop, no request storm) and returns the topics
that exist now, logging one info line for each. :attr:`MissingTopics.waited` keeps every topic
waited for: the consumer reads such a topic from its first message, whatever its start position
says for other topics, since everything in a topic created after the subscription is newer than
the subscription (push and simple consumers do the same on the broker).

A name no topic can have is refused at once (``InvalidTopicNameError``): only a valid name is
worth waiting for.
"""

from __future__ import annotations

import asyncio
import logging

from ferrymq.client._session import Session
from ferrymq.errors import FerryMQError, UnknownTopicError

log = logging.getLogger("ferrymq.client")

MISSING_TOPIC_RECHECK_S = 1.0
"""How often a consumer asks whether a topic it waits for exists: one small request a second
per waiting consumer, and a new topic is noticed within about a second."""


class MissingTopics:
    """The topics one consumer waits for.

    Args:
        session: the consumer's session (metadata requests go through it).
        recheck_s: least time between two checks with the broker.
    """

    def __init__(self, session: Session, recheck_s: float = MISSING_TOPIC_RECHECK_S) -> None:
        self._session = session
        self._recheck_s = recheck_s
        self._topics: set[str] = set()
        self.waited: set[str] = set()
        """Every topic waited for, also those that exist by now."""
        self._next_check = 0.0

    def __contains__(self, topic: object) -> bool:
        return topic in self._topics

    def __bool__(self) -> bool:
        return bool(self._topics)

    @property
    def names(self) -> list[str]:
        """The topics waited for, sorted."""
        return sorted(self._topics)

    async def check(self, topic: str, *, require: bool) -> bool:
        """Whether ``topic`` exists; a missing one is waited for (one warning) unless
        ``require``.

        Raises:
            UnknownTopicError: it does not exist and ``require`` is true.
            InvalidTopicNameError: no topic can have this name.
        """
        if topic in self._topics:
            return False
        if topic in await self._session.existing_topics([topic]):
            return True
        if require:
            raise UnknownTopicError(
                f"topic {topic!r} does not exist (require_topic=True: create it first, or leave "
                "require_topic off to wait for it)")
        self._topics.add(topic)
        self.waited.add(topic)
        self._next_check = asyncio.get_running_loop().time() + self._recheck_s
        log.warning("topic %r does not exist yet: waiting for it to be created (checking every "
                    "%g s)", topic, self._recheck_s)
        return False

    async def appeared(self, timeout_s: float | None = None) -> list[str]:
        """The awaited topics that exist now (no longer awaited); asks the broker at most
        every ``recheck_s`` (waiting at most ``timeout_s`` for the answer; default: the
        session's request timeout), returns [] in between or when the broker cannot be asked."""
        if not self._topics:
            return []
        loop = asyncio.get_running_loop()
        if loop.time() < self._next_check:
            return []
        self._next_check = loop.time() + self._recheck_s
        try:
            found = sorted(self._topics.intersection(
                await self._session.existing_topics(self._topics, timeout_s=timeout_s)))
        except FerryMQError as exc:  # unreachable for now: the next check asks again
            log.debug("checking for topics %s failed: %s", self.names, exc)
            return []
        for topic in found:
            self._topics.discard(topic)
            log.info("topic %r exists now: reading it", topic)
        return found

    def discard(self, topic: str) -> None:
        """Forget ``topic`` (it was not subscribed to after all)."""
        self._topics.discard(topic)
        self.waited.discard(topic)
