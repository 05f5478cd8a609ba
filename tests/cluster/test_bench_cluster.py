"""``ferrymq bench cluster`` against a real local cluster (etcd and three broker processes):
tiny runs that check the output's shape and that the figures are positive (no timed
assertions: the machine is shared)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.cluster.conftest import needs_etcd

pytestmark = [pytest.mark.integration, needs_etcd]


def _bench(*args: str) -> list[dict[str, Any]]:
    proc = subprocess.run([sys.executable, "-m", "ferrymq.admin.cli", "bench", "cluster",
                           *args, "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-4000:]}"
    out = proc.stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_matrix_runs_every_setup_and_workload() -> None:
    rows = _bench("matrix", "--flush", "async", "--setups", "single,rf1,rf3-all", "--rounds",
                  "1", "--messages", "2000", "--batch", "100", "--rate", "200", "--duration",
                  "2")
    assert not [r for r in rows if "error" in r]
    seen = {(r["setup"], r["workload"]) for r in rows}
    assert seen == {(s, w) for s in ("single", "rf1", "rf3-all")
                    for w in ("produce", "consume", "e2e")}
    for r in rows:
        if r["workload"] == "e2e":
            assert r["received"] == r["sent"] > 0
            assert 0 < r["p50_ms"] <= r["p99_ms"]
        else:
            assert r["msg_per_s"] > 0
        assert r["replicas"] == {"single": None, "rf1": 1, "rf3-all": 3}[r["setup"]]
        assert r["acks"] == ("all" if r["setup"] != "rf1" else "leader")


def test_failover_measures_each_kill() -> None:
    (res,) = _bench("failover", "--kills", "1", "--rate", "100", "--lease-ms", "2000")
    assert res["kills"] == 1 and res["failed_sends"] == 0
    (kill,) = res["kills_detail"]
    assert kill["new_leader"] != kill["victim"]
    assert kill["victim"] not in kill["isr_after_kill"]
    assert 0 < res["unavailable_p50_s"] == res["unavailable_max_s"]


def test_failover_of_delayed_delivery_measures_each_kill() -> None:
    (res,) = _bench("failover", "--service", "delayed", "--kills", "1", "--rate", "20",
                    "--lease-ms", "2000")
    assert res["service"] == "delayed" and res["kills"] == 1 and res["succeeded"] > 0
    (kill,) = res["kills_detail"]
    assert kill["new_leader"] != kill["victim"]
    assert 0 < res["unavailable_p50_s"] == res["unavailable_max_s"] < 30
    assert res["delayed_sent"] > 0
    assert (res["delayed_lost"], res["delayed_twice"]) == (0, 0), res["delayed_twice_examples"]


def test_catchup_measures_the_follower() -> None:
    (res,) = _bench("catchup", "--megabytes", "2")
    assert res["megabytes"] >= 2
    assert res["catchup_s"] > 0 and res["catchup_mb_per_s"] > 0


def test_failover_of_the_commit_service_kills_the_groups_coordinator() -> None:
    (res,) = _bench("failover", "--service", "commit", "--kills", "1", "--rate", "20",
                    "--lease-ms", "2000")
    assert res["service"] == "commit" and res["kills"] == 1 and res["succeeded"] > 0
    (kill,) = res["kills_detail"]
    assert kill["new_leader"] != kill["victim"]
    assert kill["victim"] not in kill["isr_after_kill"]
    assert 0 < res["unavailable_p50_s"] == res["unavailable_max_s"] < 30


def test_failover_of_the_txn_service_kills_the_transaction_coordinator() -> None:
    (res,) = _bench("failover", "--service", "txn", "--kills", "1", "--rate", "20",
                    "--lease-ms", "2000")
    assert res["service"] == "txn" and res["kills"] == 1 and res["succeeded"] > 0
    (kill,) = res["kills_detail"]
    assert kill["new_leader"] != kill["victim"]
    assert kill["victim"] not in kill["isr_after_kill"]
    assert 0 < res["unavailable_p50_s"] == res["unavailable_max_s"] < 30


def test_failover_of_the_delivery_service_kills_the_groups_coordinator() -> None:
    (res,) = _bench("failover", "--service", "delivery", "--kills", "1", "--rate", "20",
                    "--lease-ms", "2000")
    assert res["service"] == "delivery" and res["kills"] == 1 and res["succeeded"] > 0
    (kill,) = res["kills_detail"]
    assert kill["new_leader"] != kill["victim"]
    assert 0 < res["unavailable_p50_s"] == res["unavailable_max_s"] < 30
    assert res["received"] > 0 and res["feed_sent"] > 0  # the feeder runs beside the operations


def test_matrix_runs_the_push_workload_on_a_cluster_and_alone() -> None:
    rows = _bench("matrix", "--flush", "async", "--setups", "single,rf3-all", "--workloads",
                  "push", "--rounds", "1", "--messages", "2000", "--batch", "100")
    assert not [r for r in rows if "error" in r], rows
    assert {r["setup"] for r in rows} == {"single", "rf3-all"}
    assert all(r["workload"] == "push" and r["msg_per_s"] > 0 for r in rows)
