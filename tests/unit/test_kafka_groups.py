"""The Kafka port's classic group membership, driven directly on an event loop with a fake
clock: joins collected into one generation, the leader's assignment handed out, fencing,
leaving and session expiry."""

from __future__ import annotations

import asyncio
from typing import Any

from kio.schema.errors import ErrorCode as E

from ferrymq.kafka import groups as kg
from ferrymq.kafka.groups import KafkaGroupCoordinator, State


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _join(c: KafkaGroupCoordinator, member: str = "", protocols: Any = None,
          client: str = "c") -> asyncio.Future[kg.JoinResult]:
    return c.join("g", member, client, "consumer",
                  protocols or [("range", b"meta-" + client.encode())], 10.0, 1.0)


def test_joins_become_one_generation_and_the_leader_assigns(monkeypatch: Any) -> None:
    monkeypatch.setattr(kg, "INITIAL_REBALANCE_DELAY_S", 0.05)

    async def main() -> None:
        c = KafkaGroupCoordinator(Clock())
        a, b = _join(c, client="a"), _join(c, client="b")
        ra, rb = await a, await b
        assert (ra.error, rb.error) == (E.none, E.none)
        assert ra.generation == rb.generation == 1
        assert ra.leader == rb.leader == ra.member_id  # the first to join leads
        assert dict(ra.members) == {ra.member_id: b"meta-a", rb.member_id: b"meta-b"}
        assert rb.members == ()
        follower = c.sync("g", rb.member_id, 1, {})
        assert not follower.done()  # waits for the leader
        leader = c.sync("g", ra.member_id, 1, {ra.member_id: b"A", rb.member_id: b"B"})
        assert (await leader, await follower) == ((E.none, b"A"), (E.none, b"B"))
        assert c.heartbeat("g", rb.member_id, 1) == E.none
        assert c.heartbeat("g", rb.member_id, 0) == E.illegal_generation
        assert c.heartbeat("g", "nobody", 1) == E.unknown_member_id
        assert c.check_commit("g", rb.member_id, 1) == E.none
        assert c.check_commit("g", rb.member_id, 7) == E.illegal_generation
        assert c.check_commit("g", "", -1) == E.none  # outside any generation
        # one leaves: the other is told to rejoin and gets a new generation alone
        assert c.leave("g", [ra.member_id]) == [E.none]
        assert c.heartbeat("g", rb.member_id, 1) == E.rebalance_in_progress
        assert c.check_commit("g", rb.member_id, 1) == E.rebalance_in_progress
        again = await _join(c, rb.member_id, client="b")
        assert (again.error, again.generation, again.leader) == (E.none, 2, rb.member_id)

    asyncio.run(main())


def test_members_that_do_not_rejoin_or_heartbeat_are_removed(monkeypatch: Any) -> None:
    monkeypatch.setattr(kg, "INITIAL_REBALANCE_DELAY_S", 0.01)
    clock = Clock()

    async def main() -> None:
        c = KafkaGroupCoordinator(clock)
        ra = await _join(c, client="a")
        rb = await _join(c, client="b")  # a new member: a rebalance, "a" must rejoin ...
        assert rb.generation == 2  # ... within its rebalance timeout (1 s), else it is out
        assert set(c.groups["g"].members) == {rb.member_id}
        assert c.heartbeat("g", ra.member_id, 2) == E.unknown_member_id
        clock.now += 11  # no heartbeat for longer than the 10 s session
        c.expire()
        assert "g" not in c.groups

    asyncio.run(main())


def test_bad_joins_are_refused() -> None:
    async def main() -> None:
        c = KafkaGroupCoordinator(Clock())
        assert (await c.join("g", "ghost", "c", "consumer", [("range", b"")], 10, 1)).error \
            == E.unknown_member_id
        assert (await c.join("g", "", "c", "consumer", [], 10, 1)).error \
            == E.inconsistent_group_protocol
        first = _join(c, protocols=[("range", b"")])
        await asyncio.sleep(0)
        other = await c.join("g", "", "c", "connect", [("range", b"")], 10, 1)
        assert other.error == E.inconsistent_group_protocol
        assert (await first).error == E.none
        assert c.groups["g"].state == State.SYNCING
        c.close()

    asyncio.run(main())
