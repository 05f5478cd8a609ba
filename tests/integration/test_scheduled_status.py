"""`message status` of a scheduled (delayed) message shows its scheduling state."""

from __future__ import annotations

import time

import pytest

from ferrymq import AdminClient, Broker, Message, Producer, SimpleConsumer

pytestmark = pytest.mark.integration


def states(admin: AdminClient, msg_id: str) -> list[tuple[str, str, int]]:
    return [(s[0], s[1], s[5]) for s in admin.message_status(msg_id).statuses]


def test_message_status_of_scheduled_messages(broker: Broker) -> None:
    addr = broker.address
    with AdminClient(addr) as admin, Producer(addr) as p:
        admin.create_topic("sched", 1)
        later = p.send(Message("sched", b"later", delay=60))
        soon = p.send(Message("sched", b"soon", delay=0.2))
        gone = p.send(Message("sched", b"gone", delay=60))
        p.cancel(gone.msg_id)
        ((g, state, due),) = states(admin, later.msg_id)  # no group reads it yet
        assert (g, state) == ("-", "SCHEDULED")
        assert time.time() * 1000 + 50_000 < due < time.time() * 1000 + 70_000
        with SimpleConsumer(addr, "sg") as c:
            c.subscribe("sched")
            got = c.receive(10, wait=3)
            assert [m.body for m in got] == [b"soon"]
            assert got[0].msg_id != soon.msg_id  # the copy has its own id
            c.ack(got[0])
            assert states(admin, soon.msg_id) == [("sg", "FIRED", -1)]
            assert states(admin, gone.msg_id) == [("sg", "CANCELLED", -1)]
            assert [s[1] for s in states(admin, later.msg_id)] == ["SCHEDULED"]
            assert [s[1] for s in states(admin, got[0].msg_id)] == ["CONSUMED"]
