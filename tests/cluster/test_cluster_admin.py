"""AdminClient.cluster_describe and elect_preferred_leaders, create_topic's replicas and
min_insync, and the CLI's ``cluster describe``, ``cluster preferred-leaders`` and ``topic create
--replicas --min-insync``, against a real single broker
(which describes itself as a cluster of one)."""

from __future__ import annotations

import json

import pytest

from ferrymq import AdminClient, Broker
from ferrymq.errors import ConfigError, UnknownTopicError
from tests.integration.test_cli import ferrymq, ok

pytestmark = pytest.mark.integration


def test_a_single_broker_describes_itself_leading_every_queue_at_epoch_0(broker: Broker) -> None:
    with AdminClient(broker.address) as admin:
        admin.create_topic("orders", 3, replicas=1, min_insync=1)
        admin.create_topic("audit", 1)
        d = admin.cluster_describe()
    host, port = broker.server.address
    assert (d.cluster, d.controller) == ("", 0)
    assert [(b.broker_id, b.address, b.alive) for b in d.brokers] == [(0, f"{host}:{port}", True)]
    assert [(q.topic, q.queue) for q in d.queues] == [("audit", 0)] + [
        ("orders", i) for i in range(3)]
    assert {(q.leader, q.leader_epoch, tuple(q.replicas), tuple(q.isr), q.min_insync)
            for q in d.queues} == {(0, 0, (0,), (0,), 1)}
    assert d.offline == [] and d.under_replicated == []


@pytest.mark.parametrize(("options", "complaint"), [
    ({"replicas": 0}, "replicas must be an integer >= 1, not 0"),
    ({"min_insync": -1}, "min_insync must be an integer >= 1, not -1"),
    ({"replicas": True}, "replicas must be an integer >= 1, not True"),
    ({"replicas": 2, "min_insync": 3}, r"min_insync \(3\) cannot exceed replicas \(2\)"),
])
def test_bad_replication_settings_are_refused_before_anything_is_created(
        broker: Broker, options: dict[str, object], complaint: str) -> None:
    with AdminClient(broker.address) as admin:
        with pytest.raises(ConfigError, match=complaint):
            admin.create_topic("t", 2, **options)
        assert "t" not in [t.name for t in admin.list_topics()]


def test_cli_cluster_describe_as_a_table_and_as_json(broker: Broker) -> None:
    ok(broker.address, "topic", "create", "cli-orders", "--queues", "2", "--replicas", "1",
       "--min-insync", "1")
    out = ok(broker.address, "cluster", "describe").splitlines()
    assert out[0] == "single broker (a cluster of one), controller: broker 0; 2 queues, " \
        "0 offline, 0 under-replicated"
    rows = [ln.split() for ln in out if ln.startswith("cli-orders")]
    assert rows == [["cli-orders", "0", "0", "0", "0", "0", "1", "ok"],
                    ["cli-orders", "1", "0", "0", "0", "0", "1", "ok"]]
    assert ["0", broker.address, "yes"] in [ln.split() for ln in out]
    for args in (("cluster", "describe", "--json"), ("--json", "cluster", "describe")):
        doc = json.loads(ok(broker.address, *args))
        assert doc["cluster"] == "" and doc["controller"] == 0
        assert doc["brokers"] == [{"broker_id": 0, "address": broker.address, "alive": True}]
        assert [(q["topic"], q["queue"], q["leader"], q["leader_epoch"], q["isr"])
                for q in doc["queues"]] == [("cli-orders", 0, 0, 0, [0]), ("cli-orders", 1, 0, 0, [0])]


def test_cli_topic_create_refuses_zero_replicas_as_a_usage_error(broker: Broker) -> None:
    for flag in ("--replicas", "--min-insync"):
        res = ferrymq(broker.address, "topic", "create", "zero", "--queues", "1", flag, "0")
        assert res.returncode == 2, res.stderr
        assert f"Invalid value for '{flag}'" in res.stderr and "0 is not in the range x>=1" \
            in res.stderr
    res = ferrymq(broker.address, "topic", "create", "zero", "--queues", "1", "--replicas", "1",
                  "--min-insync", "2")
    assert res.returncode == 1 and res.stderr.startswith(
        "error: min_insync (2) cannot exceed replicas (1)"), res.stderr
    assert "zero" not in ok(broker.address, "topic", "list")


def test_cli_produce_with_either_acks_and_a_bad_one(broker: Broker) -> None:
    for acks in ("all", "leader"):
        out = json.loads(ok(broker.address, "--json", "produce", "acked", "x", "--acks", acks))
        assert out["durability"] == "fsynced"  # one broker: its own flush either way
    res = ferrymq(broker.address, "produce", "acked", "x", "--acks", "none")
    assert res.returncode == 2 and "'none' is not one of 'all', 'leader'" in res.stderr


def test_a_single_broker_moves_no_leader_and_names_an_unknown_topic(broker: Broker) -> None:
    with AdminClient(broker.address) as admin:
        admin.create_topic("pref", 2)
        assert admin.elect_preferred_leaders() == 0
        assert admin.elect_preferred_leaders(["pref"]) == 0
        with pytest.raises(UnknownTopicError, match="unknown topic 'nope'"):
            admin.elect_preferred_leaders(["pref", "nope"])
    out = ok(broker.address, "cluster", "preferred-leaders", "--topic", "pref")
    assert out == "0 queues moved to the preferred leader\n"
    assert json.loads(ok(broker.address, "--json", "cluster", "preferred-leaders")) == {"moved": 0}
    res = ferrymq(broker.address, "cluster", "preferred-leaders", "--topic", "nope")
    assert res.returncode == 1 and "unknown topic 'nope'" in res.stderr, res.stderr
