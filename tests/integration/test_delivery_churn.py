"""Members join, leave and crash while producing: nothing lost, no concurrent double delivery,
nothing redelivered after its ack (a recorded history, checked as in shared/RELIABILITY.md)."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from ferrymq import AdminClient, Broker, Message, Producer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
EPS_NS = 50_000_000


def check(events: list[dict[str, Any]], sent: set[str], kills: dict[str, int]) -> dict[str, Any]:
    """The history checker: every list must be empty."""
    dels: dict[str, list[dict[str, Any]]] = defaultdict(list)
    acked_at: dict[str, int] = {}
    acked_by: dict[tuple[str, str], int] = {}
    for e in events:
        if e["f"] == "recv":
            dels[e["id"]].append(e)
        elif e["f"] == "ack" and e.get("ok"):
            for i in e["ids"]:
                acked_at[i] = min(acked_at.get(i, e["t"]), e["t"])
                acked_by[(i, e["w"])] = e["t"]
    r: dict[str, Any] = {
        "lost": sorted(sent - set(acked_at)),
        "phantom": sorted(set(dels) - sent),
        "lease_overlap": [],
        "redelivered_after_ack": [],
    }
    for mid, ds in dels.items():
        ds.sort(key=lambda d: d["t"])
        for x, y in itertools.pairwise(ds):
            end = min(x["end"], kills.get(x["w"], x["end"]))
            if y["t"] < end - EPS_NS:
                r["lease_overlap"].append((mid, x["w"], y["w"]))
        if mid in acked_at:
            r["redelivered_after_ack"] += [d["w"] for d in ds if d["t_inv"] > acked_at[mid]]
    r["dup_rate"] = sum(len(v) - 1 for v in dels.values()) / max(1, len(dels))
    return r


def test_checker_finds_what_it_looks_for() -> None:
    s = 1_000_000_000
    ev = [
        {"f": "recv", "w": "a", "t_inv": 0, "t": 1, "id": "x", "end": 3 * s},
        {"f": "recv", "w": "b", "t_inv": s, "t": s + 1, "id": "x", "end": 4 * s},  # overlap
        {"f": "recv", "w": "a", "t_inv": 0, "t": 1, "id": "y", "end": 3 * s},
        {"f": "ack", "w": "a", "t_inv": 2, "t": 3, "ok": True, "ids": ["y"]},
        {"f": "recv", "w": "b", "t_inv": 5 * s, "t": 5 * s, "id": "y", "end": 8 * s},
        {"f": "recv", "w": "c", "t_inv": 0, "t": 1, "id": "ghost", "end": s},
    ]
    r = check(ev, {"x", "y", "z"}, {})
    assert r["lost"] == ["x", "z"]
    assert r["phantom"] == ["ghost"]
    assert r["lease_overlap"] == [("x", "a", "b")]
    assert r["redelivered_after_ack"] == ["b"]
    # a crashed holder's lease ends at its death: a later delivery is no overlap
    assert check(ev[:2], {"x"}, {"a": s // 2})["lease_overlap"] == []


def read_history(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a killed worker may be torn
            pass
    return out


def test_churn_with_history_check(tmp_path: Path) -> None:
    rnd = random.Random(20261121)
    hist = tmp_path / "history.jsonl"
    b = Broker(tmp_path / "data", port=0).start()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    kills: dict[str, int] = {}
    sent: set[str] = set()
    n = [0]

    def spawn() -> None:
        n[0] += 1
        name = f"w{n[0]}"
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "tests.workers.delivery_member", b.address, "g", "t",
             str(hist), name], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stderr=subprocess.DEVNULL)

    try:
        with AdminClient(b.address) as admin:
            admin.create_topic("t", 4)
        stop = threading.Event()

        def produce() -> None:
            with Producer(b.address) as p:
                i = 0
                while not stop.is_set():
                    rs = p.send_batch([Message("t", f"p{i + k}".encode()) for k in range(20)])
                    sent.update(r.msg_id for r in rs)
                    i += 20
                    time.sleep(0.05)

        for _ in range(3):
            spawn()
        pt = threading.Thread(target=produce)
        pt.start()
        t_end = time.monotonic() + 15
        while time.monotonic() < t_end:
            time.sleep(rnd.uniform(1.0, 2.5))
            live = [w for w, p in procs.items() if p.poll() is None]
            action = rnd.choice(["add", "leave", "kill"]) if len(live) > 1 else "add"
            if action == "add" and len(live) < 5:
                spawn()
            elif action == "leave":
                procs[rnd.choice(live)].send_signal(signal.SIGTERM)
            elif action == "kill":
                w = rnd.choice(live)
                kills[w] = time.monotonic_ns()
                procs[w].kill()
        if not kills:
            w = next(w for w, p in procs.items() if p.poll() is None)
            kills[w] = time.monotonic_ns()
            procs[w].kill()
        stop.set()
        pt.join()
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.wait(30)
        # drain with three members. Every receive refreshes its member's session, and the
        # session (4 s) outlasts a lease (3 s): a live member's lease always expires before
        # the member could be evicted, so the checker may treat any earlier redelivery as a bug
        for _ in range(3):
            spawn()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            r = check(read_history(hist), sent, kills)
            if not r["lost"]:
                break
            time.sleep(0.5)
        events = read_history(hist)
        r = check(events, sent, kills)
        assert len(sent) > 1000
        assert kills, "the run should include crashes"
        assert r["lost"] == [], f"{len(r['lost'])} lost, e.g. {r['lost'][:3]}"
        assert r["phantom"] == []
        assert r["lease_overlap"] == [], r["lease_overlap"][:5]
        assert r["redelivered_after_ack"] == []
        print(f"sent {len(sent)}, kills {len(kills)}, dup rate {r['dup_rate']:.4f}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        b.stop()
