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
    """The history checker: every list must be empty, except ``ack_unknown``: messages whose
    ack was in flight when its member was killed (an ``acking`` line without its ``ack``). The
    broker may have acked them before the kill, and then rightly never delivers them again, so
    they are not lost if the broker says so (see :func:`broker_acked`)."""
    dels: dict[str, list[dict[str, Any]]] = defaultdict(list)
    acked_at: dict[str, int] = {}
    acked_by: dict[tuple[str, str], int] = {}
    acking: dict[str, list[str]] = {}  # member -> ids of its ack request not answered yet
    for e in events:
        if e["f"] == "recv":
            dels[e["id"]].append(e)
        elif e["f"] == "acking":
            acking[e["w"]] = e["ids"]
        elif e["f"] == "ack":
            acking.pop(e["w"], None)
            if e.get("ok"):
                for i in e["ids"]:
                    acked_at[i] = min(acked_at.get(i, e["t"]), e["t"])
                    acked_by[(i, e["w"])] = e["t"]
    unknown = {i for w, ids in acking.items() if w in kills for i in ids} & sent
    unknown -= set(acked_at)
    r: dict[str, Any] = {
        "lost": sorted(sent - set(acked_at) - unknown),
        "ack_unknown": sorted(unknown),
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
    assert r["ack_unknown"] == []
    assert r["phantom"] == ["ghost"]
    assert r["lease_overlap"] == [("x", "a", "b")]
    assert r["redelivered_after_ack"] == ["b"]
    # a crashed holder's lease ends at its death: a later delivery is no overlap
    assert check(ev[:2], {"x"}, {"a": s // 2})["lease_overlap"] == []
    # an ack in flight when its member was killed: the broker tells (not a live member's)
    inflight = [*ev[:3], {"f": "acking", "w": "a", "t": 2, "ids": ["x", "y"]}]
    r = check(inflight, {"x", "y", "z"}, {"a": 3})
    assert (r["lost"], r["ack_unknown"]) == (["z"], ["x", "y"])
    assert check(inflight, {"x", "y", "z"}, {})["lost"] == ["x", "y", "z"]
    # answered (here: refused), or acked again later: nothing unknown
    refused = {"f": "ack", "w": "a", "t_inv": 2, "t": 3, "ok": False, "ids": ["x", "y"]}
    assert check([*inflight, refused], {"x", "y"}, {"a": 4})["ack_unknown"] == []
    by_b = {"f": "ack", "w": "b", "t_inv": 5, "t": 6, "ok": True, "ids": ["y"]}
    assert check([*inflight, by_b], {"x", "y"}, {"a": 4})["ack_unknown"] == ["x"]


def broker_acked(address: str, msg_ids: list[str]) -> list[str]:
    """Those of ``msg_ids`` that group ``g`` acknowledged (CONSUMED with an ack time: not a
    move to the retry or dead-letter queue)."""
    with AdminClient(address) as admin:
        return [i for i in msg_ids
                if any(st[0] == "g" and st[1] == "CONSUMED" and st[7] >= 0
                       for st in admin.message_status(i).statuses)]


def verdict(path: Path, address: str, sent: set[str], kills: dict[str, int]) -> dict[str, Any]:
    """:func:`check` of the history, with the messages whose ack outcome the history cannot
    tell (``ack_unknown``) lost unless the broker acknowledged them."""
    r = check(read_history(path), sent, kills)
    if r["ack_unknown"]:
        acked = set(broker_acked(address, r["ack_unknown"]))
        r["lost"] = sorted([*r["lost"], *(i for i in r["ack_unknown"] if i not in acked)])
    return r


def member(procs: dict[str, subprocess.Popen[bytes]], name: str, address: str,
           hist: Path) -> None:
    """Start delivery member ``name`` (group ``g``, topic ``t``) writing to ``hist``."""
    procs[name] = subprocess.Popen(
        [sys.executable, "-m", "tests.workers.delivery_member", address, "g", "t", str(hist),
         name], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.DEVNULL)


def stop_all(procs: dict[str, subprocess.Popen[bytes]], b: Broker) -> None:
    """Kill the members still running, then stop the broker."""
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait(10)
    b.stop()


def drained(path: Path, address: str, sent: set[str], kills: dict[str, int],
            timeout: float) -> dict[str, Any]:
    """:func:`verdict` once nothing is lost any more, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    r = verdict(path, address, sent, kills)
    while r["lost"] and time.monotonic() < deadline:
        time.sleep(0.3)
        r = verdict(path, address, sent, kills)
    return r


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
        member(procs, f"w{n[0]}", b.address, hist)

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
        r = drained(hist, b.address, sent, kills, 60)
        assert len(sent) > 1000
        assert kills, "the run should include crashes"
        assert r["lost"] == [], f"{len(r['lost'])} lost, e.g. {r['lost'][:3]}"
        assert r["phantom"] == []
        assert r["lease_overlap"] == [], r["lease_overlap"][:5]
        assert r["redelivered_after_ack"] == []
        print(f"sent {len(sent)}, kills {len(kills)}, dup rate {r['dup_rate']:.4f}, "
              f"acked by the broker as their member was killed {len(r['ack_unknown'])}")
    finally:
        stop_all(procs, b)


def test_ack_in_flight_when_killed_is_not_lost(tmp_path: Path) -> None:
    """A member killed after the broker acked its messages, before it could record the answer:
    the broker rightly never delivers them again, and the checker must not call them lost
    (the churn test failed so, twice: one receive's worth "lost", each acked by the broker)."""
    hist = tmp_path / "history.jsonl"
    b = Broker(tmp_path / "data", port=0).start()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    kills: dict[str, int] = {}

    def spawn(name: str) -> None:
        member(procs, name, b.address, hist)

    try:
        with AdminClient(b.address) as admin:
            admin.create_topic("t", 1)
        with Producer(b.address) as p:
            sent = {r.msg_id for r in p.send_batch([Message("t", b"m%d" % i) for i in range(40)])}
        delivery = b.server.delivery
        ack = delivery.ack

        def ack_then_kill(*args: Any) -> Any:  # runs on the broker's loop: the answer waits
            out = ack(*args)
            if "w1" not in kills:
                kills["w1"] = time.monotonic_ns()
                procs["w1"].kill()
            return out

        delivery.ack = ack_then_kill  # type: ignore[method-assign]
        spawn("w1")
        assert procs["w1"].wait(30) == -signal.SIGKILL
        delivery.ack = ack  # type: ignore[method-assign]
        spawn("w2")  # takes the rest (24 messages) and must not get the 16 acked ones again
        r = drained(hist, b.address, sent, kills, 30)
        assert r["lost"] == [], f"{len(r['lost'])} lost, e.g. {r['lost'][:3]}"
        assert len(r["ack_unknown"]) == 16  # w1's first receive, acked as w1 died
        assert broker_acked(b.address, r["ack_unknown"]) == r["ack_unknown"]
        assert r["phantom"] == r["lease_overlap"] == r["redelivered_after_ack"] == []
        assert r["dup_rate"] == 0
    finally:
        stop_all(procs, b)
