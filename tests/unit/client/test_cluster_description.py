"""ClusterDescription from CLUSTER_METADATA answers of a cluster (pure logic: the answers are
built by hand as a cluster sends them), and how the CLI prints it."""

from __future__ import annotations

import io
import json

from ferrymq.admin.output import Printer
from ferrymq.client.admin import BrokerDescription, ClusterDescription
from ferrymq.protocol import messages as m
from ferrymq.protocol.codes import ErrorCode

ANSWER = m.ClusterMetadataResponse("prod", 2, [(1, "h1", 9876), (2, "h2", 9876)], [
    ("orders", 0, 7, 2, [
        (0, 1, 3, [1, 2, 3], [1, 2, 3]),  # healthy (as far as the ISR says)
        (1, 2, 4, [2, 3, 1], [2, 1]),  # under-replicated
        (2, -1, 5, [3, 1, 2], [3]),  # offline: no leader
    ]),
    ("audit", 0, 8, 1, [(0, 3, 1, [3], [3])]),  # led by a broker that is not alive: offline
    ("gone", ErrorCode.UNKNOWN_TOPIC, -1, 1, []),
])


def test_offline_then_under_replicated_queues_come_first() -> None:
    d = ClusterDescription.from_wire(ANSWER)
    assert [(q.topic, q.queue) for q in d.queues] == [
        ("audit", 0), ("orders", 2), ("orders", 1), ("orders", 0)]
    assert [(q.topic, q.queue) for q in d.offline] == [("audit", 0), ("orders", 2)]
    # an offline queue may be under-replicated too; it is listed once, as offline
    assert [(q.topic, q.queue) for q in d.under_replicated] == [("orders", 2), ("orders", 1)]
    healthy = d.queues[-1]
    assert (healthy.leader, healthy.leader_epoch, healthy.replicas, healthy.isr,
            healthy.min_insync) == (1, 3, [1, 2, 3], [1, 2, 3], 2)
    assert not healthy.offline and not healthy.under_replicated


def test_brokers_named_as_replicas_but_not_alive_are_listed_as_down() -> None:
    d = ClusterDescription.from_wire(ANSWER)
    assert d.brokers == [BrokerDescription(1, "h1", 9876, True),
                         BrokerDescription(2, "h2", 9876, True),
                         BrokerDescription(3, "", 0, False)]
    assert [b.address for b in d.brokers] == ["h1:9876", "h2:9876", ""]
    assert (d.cluster, d.controller) == ("prod", 2)


def test_the_table_and_the_json() -> None:
    d = ClusterDescription.from_wire(ANSWER)
    out = io.StringIO()
    Printer(False, out).cluster(d)
    lines = out.getvalue().splitlines()
    assert lines[0] == ("cluster prod, controller: broker 2; 4 queues, 2 offline, "
                        "2 under-replicated")
    rows = [ln.split() for ln in lines if ln.startswith(("orders", "audit"))]
    assert rows == [
        ["audit", "0", "-", "1", "3", "3", "1", "offline"],
        ["orders", "2", "-", "5", "3,1,2", "3", "2", "offline"],
        ["orders", "1", "2", "4", "2,3,1", "2,1", "2", "under-replicated"],
        ["orders", "0", "1", "3", "1,2,3", "1,2,3", "2", "ok"],
    ]
    assert ["3", "-", "no"] in [ln.split() for ln in lines]
    out = io.StringIO()
    Printer(True, out).cluster(d)
    doc = json.loads(out.getvalue())
    assert (doc["offline"], doc["under_replicated"], doc["controller"]) == (2, 2, 2)
    assert doc["queues"][0] == {"topic": "audit", "queue": 0, "leader": None, "leader_epoch": 1,
                                "replicas": [3], "isr": [3], "min_insync": 1, "offline": True,
                                "under_replicated": False}
    assert doc["brokers"][2] == {"broker_id": 3, "address": None, "alive": False}
