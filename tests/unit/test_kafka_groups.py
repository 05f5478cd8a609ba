"""The Kafka port's classic group membership, driven directly on an event loop with a fake
clock: joins collected into one generation, the leader's assignment handed out, fencing,
leaving and session expiry, static members (KIP-345)."""

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
          client: str = "c", instance: str | None = None) -> asyncio.Future[kg.JoinResult]:
    return c.join("g", member, client, "consumer",
                  protocols or [("range", b"meta-" + client.encode())], 10.0, 1.0,
                  instance_id=instance)


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
        assert c.leave("g", [(ra.member_id, None)]) == [E.none]
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


def test_a_restarted_static_member_takes_its_place_back_without_a_rebalance(
        monkeypatch: Any) -> None:
    monkeypatch.setattr(kg, "INITIAL_REBALANCE_DELAY_S", 0.05)
    clock = Clock()

    async def main() -> None:
        c = KafkaGroupCoordinator(clock)
        a, b = _join(c, client="a", instance="ia"), _join(c, client="b", instance="ib")
        ra, rb = await a, await b
        assert ra.instance_ids == {ra.member_id: "ia", rb.member_id: "ib"}  # to the leader
        leader = c.sync("g", ra.member_id, 1, {ra.member_id: b"A", rb.member_id: b"B"},
                        instance_id="ia")
        assert (await c.sync("g", rb.member_id, 1, {}, instance_id="ib"))[1] == b"B"
        assert (await leader)[1] == b"A"
        # b's process restarts: it joins with its instance id and no member id
        rb2 = await _join(c, client="b", instance="ib")
        assert (rb2.error, rb2.generation, rb2.leader) == (E.none, 1, ra.member_id)
        assert rb2.member_id != rb.member_id
        assert await c.sync("g", rb2.member_id, 1, {}, instance_id="ib") == (E.none, b"B")
        assert c.groups["g"].state == State.STABLE  # no rebalance: a keeps working
        assert c.heartbeat("g", ra.member_id, 1, "ia") == E.none
        # the old process is fenced, whatever it sends
        assert c.heartbeat("g", rb.member_id, 1, "ib") == E.fenced_instance_id
        assert c.check_commit("g", rb.member_id, 1, "ib") == E.fenced_instance_id
        assert (await _join(c, rb.member_id, client="b", instance="ib")).error \
            == E.fenced_instance_id
        assert c.heartbeat("g", rb2.member_id, 1, "ib") == E.none
        # the leader restarts: it gets the members again (and its assignment is kept)
        ra2 = await _join(c, client="a", instance="ia")
        assert (ra2.error, ra2.leader) == (E.none, ra2.member_id)
        assert dict(ra2.members) == {ra2.member_id: b"meta-a", rb2.member_id: b"meta-b"}
        assert await c.sync("g", ra2.member_id, 1, {ra2.member_id: b"X"}, "ia") == (
            E.none, b"A")  # a stable group keeps its assignment
        # a static member that stops heartbeating leaves at its session timeout
        clock.now += 11
        assert c.heartbeat("g", ra2.member_id, 1, "ia") == E.none
        c.expire()
        assert set(c.groups["g"].members) == {ra2.member_id}
        assert c.heartbeat("g", ra2.member_id, 1, "ia") == E.rebalance_in_progress
        assert "ib" not in c.groups["g"].static
        c.close()

    asyncio.run(main())


def test_a_static_member_rejoining_with_another_protocol_rebalances_and_leave_by_instance(
        monkeypatch: Any) -> None:
    monkeypatch.setattr(kg, "INITIAL_REBALANCE_DELAY_S", 0.05)

    async def main() -> None:
        c = KafkaGroupCoordinator(Clock())
        ra = await _join(c, client="a", instance="ia")
        await c.sync("g", ra.member_id, 1, {ra.member_id: b"A"})
        rejoin = _join(c, client="a", instance="ia", protocols=[("roundrobin", b"")])
        await asyncio.sleep(0)
        assert c.groups["g"].state == State.JOINING  # the protocol changes: a rebalance
        ra2 = await rejoin
        assert (ra2.error, ra2.generation, ra2.protocol) == (E.none, 2, "roundrobin")
        # LeaveGroup v3+: by instance id; a member id that does not match is fenced
        assert c.leave("g", [("someone-else", "ia"), ("", "nobody")]) == [
            E.fenced_instance_id, E.unknown_member_id]
        assert c.leave("g", [("", "ia")]) == [E.none]
        assert c.groups["g"].state == State.EMPTY and not c.groups["g"].static
        c.close()

    asyncio.run(main())


def test_a_static_member_dropped_for_not_rejoining_can_join_again(monkeypatch: Any) -> None:
    monkeypatch.setattr(kg, "INITIAL_REBALANCE_DELAY_S", 0.01)

    async def main() -> None:
        c = KafkaGroupCoordinator(Clock())
        ra = await _join(c, client="a", instance="ia")
        rb = await _join(c, client="b")  # a rebalance "a" does not rejoin (1 s timeout)
        assert rb.generation == 2
        assert set(c.groups["g"].members) == {rb.member_id}
        assert c.groups["g"].static == {}  # its instance id no longer names a member
        assert c.heartbeat("g", ra.member_id, 2, "ia") == E.unknown_member_id
        back = _join(c, client="a", instance="ia")  # a fresh member: b rejoins with it
        rb3 = await _join(c, rb.member_id, client="b")
        ra3 = await back
        assert (ra3.error, rb3.error, ra3.generation) == (E.none, E.none, 3)
        assert c.groups["g"].static == {"ia": ra3.member_id}
        c.close()

    asyncio.run(main())
