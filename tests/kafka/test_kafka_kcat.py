"""kcat (Debian's package, librdkafka's command line) lists metadata, produces and consumes
through the Kafka port."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from ferrymq import Broker
from ferrymq.protocol.records import decode_records

KCAT = shutil.which("kcat") or shutil.which("kafkacat")

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(KCAT is None, reason="needs kcat (make kcat)")]


def kcat(b: Broker, *args: str, stdin: str | None = None) -> str:
    assert KCAT is not None
    assert b.server.kafka is not None
    res = subprocess.run([KCAT, "-b", "{}:{}".format(*b.server.kafka.address), *args],
                         input=stdin, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_kcat_lists_produces_and_consumes(kbroker: Broker) -> None:
    kbroker.server.topics.create("lines", 2, {}, 0)
    listing = kcat(kbroker, "-L")
    assert 'topic "lines" with 2 partitions' in listing
    kcat(kbroker, "-P", "-t", "lines", "-p", "1", "-K", ":", stdin="k1:alpha\nk2:beta\n")
    out = kcat(kbroker, "-C", "-t", "lines", "-p", "1", "-o", "beginning", "-c", "2", "-e",
               "-f", "%k=%s@%o\n")
    assert out.splitlines() == ["k1=alpha@0", "k2=beta@1"]
    records = decode_records(kbroker.server.topics.queue("lines", 1).log.read(0, 1 << 20))
    assert [(r.sharding_key, r.body) for r in records] == [("k1", b"alpha"), ("k2", b"beta")]
