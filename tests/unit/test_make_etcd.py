"""The Makefile and etcd: ``make test`` installs it (as root) or says how; ``make run`` stays
without it; ``make cluster`` runs ``ferrymq dev-cluster``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def planned(target: str, tmp_path: Path) -> str:
    """What ``make -n TARGET`` would run (a fresh venv's steps included), running nothing."""
    out = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_test_installs_etcd_when_missing_or_says_how(tmp_path: Path) -> None:
    plan = planned("pytest", tmp_path)
    assert "command -v etcd" in plan
    assert "apt-get install -y -q etcd-server" in plan  # as root
    assert "apt-get update" in plan  # a fresh machine has no package lists
    assert "sudo apt-get install -y etcd-server" in plan  # what others are told


def test_make_run_needs_no_etcd(tmp_path: Path) -> None:
    plan = planned("run", tmp_path).replace(str(tmp_path), "TMP")  # the path names this test
    assert "ferrymq broker" in plan
    assert "etcd" not in plan


def test_make_cluster_runs_dev_cluster(tmp_path: Path) -> None:
    plan = " ".join(planned("cluster", tmp_path).replace("\\\n", " ").split())
    assert (f"{tmp_path / 'venv'}/bin/ferrymq dev-cluster --brokers 3 --port 9876 "
            "--etcd-port 2379 --dir ./ferrymq-cluster --flush sync") in plan
