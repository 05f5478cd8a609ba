"""An orderly group's state (held messages, failures retried in place, leases) survives kill -9,
through the journal and through snapshots."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from ferrymq import AdminClient, Message, Producer, SimpleConsumer
from tests.helpers import BrokerProcess

pytestmark = pytest.mark.crash

KEYS = 6
PER_KEY = 6


def seq(body: bytes) -> tuple[str, int]:
    k, i = body.decode().split(":")
    return k, int(i)


@pytest.mark.parametrize("journal_bytes", [16 << 20, 1024], ids=["journal", "snapshots"])
def test_orderly_state_survives_kill9(tmp_path: Path, journal_bytes: int) -> None:
    cfg = tmp_path / "broker.toml"
    cfg.write_text(f"orderly_retry_ms = 100\ndelivery_journal_bytes = {journal_bytes}\n")
    with BrokerProcess(tmp_path / "data", extra=["--config", str(cfg)]) as bp:
        with AdminClient(bp.address) as admin:
            admin.create_topic("t", 2)
        with Producer(bp.address) as p:
            for i in range(PER_KEY):
                p.send_batch([Message("t", f"k{k}:{i}", sharding_key=f"k{k}")
                              for k in range(KEYS)])
        c = SimpleConsumer(bp.address, "og", orderly=True, invisible_duration=1.0,
                           max_reconsume=10)
        c.subscribe("t")
        acked: list[tuple[str, int]] = []
        leased_unacked: list[tuple[str, int]] = []
        # two rounds: ack the heads (except k0's, nacked for a minute, and k1's, left leased)
        for _ in range(2):
            got = c.receive(100, wait=0.5)
            for msg in got:
                s = seq(msg.body)
                if s[0] == "k0":
                    c.nack(msg, delay=60, reason="db down")
                elif s[0] == "k1":
                    leased_unacked.append(s)
                else:
                    c.ack(msg)
                    acked.append(s)
        assert sorted({k for k, _ in acked}) == ["k2", "k3", "k4", "k5"]
        assert all(i in (0, 1) for _, i in acked)
        bp.kill9()
        bp.start()
        after: dict[str, list[tuple[int, int]]] = {}  # key -> [(index, reconsume)]
        with SimpleConsumer(bp.address, "og", orderly=True) as c2, \
                AdminClient(bp.address) as admin:
            c2.subscribe("t")
            blocked = admin.describe_delivery("og").blocked
            by_key = {b[2]: (b[4], b[7]) for b in blocked}
            assert by_key.pop("k0", None) == (1, "db down")
            # k1's head is leased for 1 s: on a slow run its lease ran out before the kill, and
            # it waits for its retry (100 ms) as a failure of its own (CI, session 19)
            assert by_key in ({}, {"k1": (1, "lease expired before an ack")}), by_key
            deadline = time.monotonic() + 20
            while sum(len(v) for v in after.values()) < 4 * (PER_KEY - 2) + PER_KEY \
                    and time.monotonic() < deadline:
                got = c2.receive(100, wait=0.3)
                keys = [seq(m.body)[0] for m in got]
                assert len(keys) == len(set(keys)), keys
                for msg in got:
                    k, i = seq(msg.body)
                    after.setdefault(k, []).append((i, msg.reconsume_times))
                c2.ack_batch(got)
        assert "k0" not in after, "k0 waits for its backoff (60 s): it must stay blocked"
        # k1's head was leased when the broker died: redelivered (counted) after its lease
        assert after["k1"] == [(0, 1)] + [(i, 0) for i in range(1, PER_KEY)]
        for k in ("k2", "k3", "k4", "k5"):
            done = sorted(i for kk, i in acked if kk == k)
            assert [i for i, _ in after[k]] == list(range(len(done), PER_KEY)), k
        with contextlib.suppress(Exception):  # its broker was killed under it
            c.close()
