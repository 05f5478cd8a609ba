"""The Makefile and the Kafka port's clients in other languages: ``make test`` installs kafkajs
from its lock file (``npm ci``) and Go with Sarama (Debian's, as root), or says how."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def forced_plan(target: str, tmp_path: Path) -> str:
    """What ``make -n -B TARGET`` would run, up-to-date files included, running nothing."""
    out = subprocess.run(["make", "-n", "-B", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_make_pytest_installs_kafkajs_and_sarama(tmp_path: Path) -> None:
    plan = forced_plan("pytest", tmp_path)
    assert "cd tests/kafka/node && npm ci" in plan  # the committed package-lock.json
    assert "apt-get install -y -q nodejs npm" in plan  # as root, when npm is missing
    assert "apt-get install -y -q golang-go golang-github-shopify-sarama-dev" in plan
    assert "sudo apt-get install -y golang-go golang-github-shopify-sarama-dev" in plan
    assert plan.index("npm ci") < plan.index("/bin/pytest -n 2")
