"""The client's routing table (protocol/leaders.py) fed with CLUSTER_METADATA answers of
several brokers: leaders, leader moves, stale answers, missing leaders, recreated topics. Pure
logic: the answers are built by hand as a cluster would send them."""

from __future__ import annotations

from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.leaders import NO_LEADER, Leaders, split_by_route

BROKERS = [(1, "10.0.0.1", 9876), (2, "10.0.0.2", 9876), (3, "10.0.0.3", 9876)]


def answer(queues: list[m.QueueLeadership], *, topic: str = "orders", topic_id: int = 7,
           brokers: list[m.BrokerAddress] = BROKERS, code: int = 0) -> m.ClusterMetadataResponse:
    return m.ClusterMetadataResponse("prod", 1, brokers, [(topic, code, topic_id, 2, queues)])


def q(queue: int, leader: int, epoch: int) -> m.QueueLeadership:
    return (queue, leader, epoch, [1, 2, 3], [1, 2, 3])


def test_each_queue_routes_to_its_leader() -> None:
    lead = Leaders()
    assert lead.update(answer([q(0, 1, 4), q(1, 2, 0), q(2, 3, 9)])) == []
    assert [lead.leader("orders", i) for i in range(3)] == [1, 2, 3]
    assert lead.brokers[2] == ("10.0.0.2", 9876)
    assert (lead.cluster, lead.controller, lead.epoch("orders", 2)) == ("prod", 1, 9)
    assert lead.knows("orders") and not lead.knows("other")
    assert lead.leader("orders", 3) is None  # no such queue
    assert lead.leader("other", 0) is None


def test_a_leader_move_is_taken_and_reported() -> None:
    lead = Leaders()
    lead.update(answer([q(0, 1, 4), q(1, 2, 0)]))
    moved = lead.update(answer([q(0, 2, 5), q(1, 2, 0)]))
    assert moved == [("orders", 0)]
    assert (lead.leader("orders", 0), lead.epoch("orders", 0)) == (2, 5)


def test_a_lagging_brokers_older_epoch_does_not_undo_a_move() -> None:
    lead = Leaders()
    lead.update(answer([q(0, 2, 5)]))
    assert lead.update(answer([q(0, 1, 4)])) == []  # a broker that has not seen epoch 5 yet
    assert (lead.leader("orders", 0), lead.epoch("orders", 0)) == (2, 5)


def test_a_queue_without_a_leader_routes_nowhere_until_one_is_elected() -> None:
    lead = Leaders()
    lead.update(answer([q(0, 1, 4)]))
    lead.update(answer([q(0, NO_LEADER, 5)]))
    assert lead.leader("orders", 0) is None
    lead.update(answer([q(0, 3, 6)]))
    assert lead.leader("orders", 0) == 3


def test_a_leader_missing_from_the_live_brokers_routes_nowhere() -> None:
    lead = Leaders()
    lead.update(answer([q(0, 3, 4)], brokers=BROKERS[:2]))  # broker 3's lease just ended
    assert lead.leader("orders", 0) is None
    assert lead.epoch("orders", 0) == 4


def test_a_topic_created_again_starts_over_whatever_the_epochs() -> None:
    lead = Leaders()
    lead.update(answer([q(0, 2, 9), q(1, 2, 9)]))
    assert lead.update(answer([q(0, 1, 0)], topic_id=8)) == []  # new id: not a "move"
    assert (lead.leader("orders", 0), lead.epoch("orders", 0)) == (1, 0)
    assert lead.leader("orders", 1) is None  # the new topic has one queue


def test_an_unknown_topic_is_forgotten_and_other_errors_change_nothing() -> None:
    lead = Leaders()
    lead.update(answer([q(0, 1, 1)]))
    lead.update(answer([], code=ErrorCode.ACCESS_DENIED))
    assert lead.leader("orders", 0) == 1
    lead.update(answer([], topic_id=-1, code=ErrorCode.UNKNOWN_TOPIC))
    assert not lead.knows("orders") and lead.leader("orders", 0) is None


def test_topics_not_in_an_answer_are_kept() -> None:
    lead = Leaders()
    lead.update(answer([q(0, 1, 1)]))
    lead.update(answer([q(0, 2, 3)], topic="audit", topic_id=9))
    assert (lead.leader("orders", 0), lead.leader("audit", 0)) == (1, 2)


def test_a_single_broker_leads_everything_at_epoch_0() -> None:
    lead = Leaders()
    lead.update(m.ClusterMetadataResponse("", 0, [(0, "127.0.0.1", 9876)],
                                          [("t", 0, 3, 1, [(i, 0, 0, [0], [0]) for i in range(4)])]))
    assert {lead.leader("t", i) for i in range(4)} == {0}


def test_split_by_route_groups_items_by_leader_and_keeps_the_unrouted() -> None:
    lead = {("t", 0): "b1", ("t", 1): "b2", ("t", 2): "b1"}
    items = [("t", 0, "x"), ("t", 1, "y"), ("t", 2, "z"), ("t", 3, "w")]
    groups, unrouted = split_by_route(items, lambda t, q: lead.get((t, q)))
    assert groups == {"b1": [("t", 0, "x"), ("t", 2, "z")], "b2": [("t", 1, "y")]}
    assert unrouted == [("t", 3, "w")]


def test_describe_moves_names_the_new_leaders_and_counts_the_rest() -> None:
    leaders = Leaders()
    leaders.update(m.ClusterMetadataResponse("c", 1, BROKERS, [
        ("t", ErrorCode.NONE, 7, 2, [(q, 1 + q % 3, 0, [1, 2, 3], [1, 2, 3]) for q in range(12)])]))
    text = leaders.describe_moves([("t", q) for q in range(12)])
    assert text.startswith("t/0 -> broker 1, t/1 -> broker 2, t/2 -> broker 3")
    assert text.endswith("t/9 -> broker 1 and 2 more")
