"""Chaos on real processes (one etcd, three brokers, RF3, ``min_insync`` 2, ``acks="all"``,
``--flush sync``): leader kills, leaders paused past their lease, leaders partitioned from
clients, brokers and etcd, power losses of one replica, clock jumps; a history of every send
and read, checked for acknowledged loss, duplicates, divergent offsets, per-key order and the
high watermark going back (``tests/cluster/chaos/``).

The CI part injects a dozen faults in about three minutes. The soak (``make soak``) injects the
issue's counts (``FERRYMQ_CHAOS_KILLS``, ``_PARTITIONS``, ``_POWER_LOSSES``, ``_PAUSES``,
``_CLOCK_JUMPS``, ``_SEED``) and writes its figures to ``FERRYMQ_CHAOS_FIGURES`` (``make soak``:
``bench/results/cluster-chaos.json``, which ``bench/README.md`` quotes; a plain pytest run: a
file under its tmp_path).
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from tests.cluster.chaos.history import History, Report
from tests.cluster.chaos.scenario import Figures, Plan, dump_history, run
from tests.cluster.conftest import needs_etcd

pytestmark = [pytest.mark.integration, pytest.mark.crash, needs_etcd]


def assert_safe(base: Path, h: History, report: Report, fig: Figures) -> None:
    """Nothing acknowledged lost, no duplicate, no divergent offset, per-key order kept."""
    where = dump_history(base, h)
    detail = f"{report.summary()}\nfaults: {h.faults}\nhistory: {where}"
    assert report.acked > 0, detail
    assert not report.lost, detail
    assert not report.misplaced, detail
    assert not report.unexpected, detail
    assert not report.duplicates, detail
    assert not report.divergent, detail
    assert not report.reordered, detail
    assert not report.hw_back, detail
    assert sum(fig.faults_done.values()) == sum(
        v for k, v in fig.plan.items() if k != "seed"), fig.faults_done


@pytest.mark.timeout(420)
def test_no_acknowledged_message_is_lost_through_a_dozen_faults(tmp_path: Path) -> None:
    logging.getLogger("tests.cluster.chaos").setLevel(logging.INFO)
    plan = Plan(kills=5, pauses=2, partitions=2, power_losses=2, clock_jumps=1)
    h, report, fig = asyncio.run(run(tmp_path, plan, figures_path=tmp_path / "figures.json"))
    assert_safe(tmp_path, h, report, fig)
    assert all(u < 30 for u in fig.unavailability_s), fig.unavailability_s


def _count(name: str, default: int) -> int:
    return int(os.environ.get(f"FERRYMQ_CHAOS_{name}", default))


@pytest.mark.soak
@pytest.mark.timeout(0)
def test_soak_the_issues_counts_of_faults(tmp_path: Path) -> None:
    plan = Plan(kills=_count("KILLS", 50), pauses=_count("PAUSES", 10),
                partitions=_count("PARTITIONS", 20), power_losses=_count("POWER_LOSSES", 20),
                clock_jumps=_count("CLOCK_JUMPS", 5), seed=_count("SEED", 20))
    # `make soak` records the figures in bench/results/cluster-chaos.json; a plain pytest run
    # writes them under tmp_path, never over the recorded ones
    out = Path(os.environ.get("FERRYMQ_CHAOS_FIGURES", tmp_path / "cluster-chaos.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    h, report, fig = asyncio.run(run(tmp_path, plan, figures_path=out))
    assert_safe(tmp_path, h, report, fig)
