"""The cluster bench's rotation and its paired ratios (ferrymq.admin.bench_cluster): peers as
callables, no cluster started."""

from __future__ import annotations

from typing import Any

from ferrymq.admin.bench_cluster import BenchCluster, paired_ratios, run_matrix


def _run(setup: str, rnd: int, value: float, workload: str = "produce",
         flush: str = "sync") -> dict[str, Any]:
    return {"setup": setup, "round": rnd, "workload": workload, "flush": flush,
            "msg_per_s": value}


def test_paired_ratios_divide_within_each_round() -> None:
    results = [_run("rf1", 1, 100.0), _run("rf3-all", 1, 50.0),
               _run("rf1", 2, 400.0), _run("rf3-all", 2, 100.0),
               _run("rf3-all", 3, 80.0),                       # rf1 failed in round 3
               {"setup": "rf1", "round": 3, "workload": "produce", "flush": "sync",
                "error": "boom"},
               _run("rf1", 4, 0.0), _run("rf3-all", 4, 10.0),  # nothing to divide by
               _run("rf1", 1, 999.0, flush="async"), _run("rf3-all", 1, 1.0, workload="e2e")]
    assert paired_ratios(results, "sync", "produce", "msg_per_s", "rf3-all", "rf1") == [0.5, 0.25]
    assert paired_ratios(results, "async", "produce", "msg_per_s", "rf3-all", "rf1") == []


def test_the_rotation_reverses_every_other_round() -> None:
    order: list[str] = []

    def peer(name: str) -> Any:
        def run(workload: str) -> dict[str, Any]:
            order.append(name)
            return {"workload": workload, "msg_per_s": 1.0}
        return run

    bench = BenchCluster(cluster=None, single=None, flush="sync")  # type: ignore[arg-type]
    rows = run_matrix(bench, [], ["produce"], rounds=3,
                      messages=1, peers={n: peer(n) for n in ("a", "b", "c")})
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert [(r["setup"], r["round"]) for r in rows][:4] == [("a", 1), ("b", 1), ("c", 1),
                                                            ("c", 2)]
