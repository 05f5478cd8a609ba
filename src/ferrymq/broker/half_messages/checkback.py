"""HALF_CHECK_POLL long polls: the producers waiting for check-backs, per producer group.

The protocol has no server push, so a half-message producer keeps a HALF_CHECK_POLL open; a due
check goes to one live poller of its group, round robin (:meth:`Pollers.next`). A poll is
answered when it holds ``max_checks`` checks, at the end of the tick that gave it some, when
its wait is over (empty) or at shutdown.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from ferrymq.errors import InvalidRequestError
from ferrymq.protocol import messages as m

MAX_POLL_CHECKS = 1000
"""Most checks one HALF_CHECK_POLL answer carries."""


@dataclass(eq=False, slots=True)
class Poller:
    """One waiting HALF_CHECK_POLL."""

    group: str
    client_id: str
    max_checks: int
    future: asyncio.Future[m.HalfCheckPollResponse]
    checks: list[m.HalfCheck] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class Pollers:
    """The waiting polls of every producer group."""

    def __init__(self) -> None:
        self._by_group: dict[str, deque[Poller]] = {}
        self.closed = False

    def poll(self, req: m.HalfCheckPollRequest,
             max_wait_ms: int) -> asyncio.Future[m.HalfCheckPollResponse]:
        """Wait up to ``req.wait_ms`` (at most ``max_wait_ms``) for checks of ``req.group``.

        Raises:
            InvalidRequestError: an empty group, a negative wait or check count.
        """
        if not req.group:
            raise InvalidRequestError("group must not be empty")
        if req.wait_ms < 0 or req.max_checks < 0:
            raise InvalidRequestError("wait_ms and max_checks must be >= 0")
        loop = asyncio.get_running_loop()
        p = Poller(req.group, req.client_id, min(req.max_checks or MAX_POLL_CHECKS,
                                                 MAX_POLL_CHECKS), loop.create_future())
        if self.closed or req.wait_ms == 0:
            p.future.set_result(m.HalfCheckPollResponse([]))
            return p.future
        wait = min(req.wait_ms, max_wait_ms) / 1000
        p.timer = loop.call_later(wait, self._expire, p)
        self._by_group.setdefault(req.group, deque()).append(p)
        return p.future

    def _expire(self, p: Poller) -> None:
        """A poll's wait is over: answer it (empty) and forget it."""
        p.timer = None
        q = self._by_group.get(p.group)
        if q is not None:
            try:
                q.remove(p)
            except ValueError:
                pass
            if not q:
                del self._by_group[p.group]
        answer(p)

    def next(self, group: str) -> Poller | None:
        """The next live poller of ``group`` (round robin: it goes to the back)."""
        q = self._by_group.get(group)
        while q:
            p = q.popleft()
            if p.future.done():
                continue
            q.append(p)
            return p
        return None

    def full(self, p: Poller) -> None:
        """``p`` holds as many checks as it asked for: answer it now."""
        self._by_group[p.group].remove(p)
        answer(p)

    def answer(self, p: Poller) -> None:
        """Answer ``p`` with the checks it holds and forget it."""
        q = self._by_group.get(p.group)
        if q is not None and p in q:
            q.remove(p)
        answer(p)

    def stop(self) -> None:
        """Answer every waiting poll now, and every later one at once (shutdown)."""
        self.closed = True
        self.release()

    def release(self) -> None:
        """Answer every waiting poll now (a cluster's owner that stops owning)."""
        for pollers in self._by_group.values():
            for p in pollers:
                answer(p)
        self._by_group.clear()


def answer(p: Poller) -> None:
    """Answer ``p`` with the checks it holds (once)."""
    if p.timer is not None:
        p.timer.cancel()
        p.timer = None
    if not p.future.done():
        p.future.set_result(m.HalfCheckPollResponse(p.checks))
