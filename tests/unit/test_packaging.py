"""The packaging files stay in step with the code: every broker flag they pass exists, the
image's health check asks /healthz, the systemd unit waits for the broker's own READY=1."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ferrymq.admin.cli import broker

ROOT = Path(__file__).resolve().parents[2]
BROKER_FLAGS = {opt for p in broker.params for opt in p.opts}


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", text))


@pytest.mark.parametrize("path", ["compose.yaml", "contrib/ferrymq.service"])
def test_every_broker_flag_they_pass_exists(path: str) -> None:
    text = "\n".join(line for line in (ROOT / path).read_text().splitlines()
                     if not line.lstrip().startswith("#"))
    if path == "compose.yaml":
        text = "\n".join(re.findall(r"command: \[(.*?)\]", text, re.S))  # the brokers' only
    else:
        text = "\n".join(re.findall(r"^ExecStart=.*$", text, re.M))
    flags = _flags(text)
    assert flags, path
    assert flags <= BROKER_FLAGS, flags - BROKER_FLAGS


def test_compose_cluster_runs_three_brokers_with_distinct_ids() -> None:
    text = (ROOT / "compose.yaml").read_text()
    ids = re.findall(r'--broker-id, "(\d+)"', text)
    assert sorted(ids) == ["1", "2", "3"]
    assert text.count('--metadata, "etcd://etcd:2379"') == 3


def test_image_runs_unprivileged_with_a_volume_and_checks_healthz() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER [1-9]\d*:[1-9]\d*$", text, re.M)  # numeric, not root
    assert 'VOLUME ["/var/lib/ferrymq"]' in text and "FERRYMQ_DATA_DIR=/var/lib/ferrymq" in text
    (check,) = re.findall(r"^HEALTHCHECK .*(?:\n\s+.*)*", text, re.M)
    assert "http://127.0.0.1:9877/healthz" in check and "urllib.request" in check


def test_systemd_unit_is_type_notify() -> None:
    text = (ROOT / "contrib/ferrymq.service").read_text()
    assert re.search(r"^Type=notify$", text, re.M)
    assert re.search(r"^KillSignal=SIGTERM$", text, re.M)
