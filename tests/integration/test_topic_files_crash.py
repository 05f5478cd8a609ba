"""A topic's files across a crash: the topic list (``meta/topics``) is the commit point of a
create and of a delete, so a topic directory the list does not name is garbage. A crash between
a delete's list write and its directory removal (or between a create's directories and its list
write) leaves one; it must never come back as data of a later topic of that name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import ferrymq
from tests.helpers import read_topic

pytestmark = pytest.mark.integration


def ends(address: str, topic: str) -> list[int]:
    with ferrymq.AdminClient(address) as admin:
        return [q[2] for q in admin.describe_topic(topic).queues]


def test_a_topic_deleted_by_a_crash_half_way_does_not_come_back(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with ferrymq.Broker(data, port=0):
        pass
    before = (data / "meta" / "topics").read_bytes() if (data / "meta" / "topics").exists() \
        else None
    with ferrymq.Broker(data, port=0) as b:
        with ferrymq.AdminClient(b.address) as admin:
            admin.create_topic("old", queues=1)
        with ferrymq.Producer(b.address) as p:
            for i in range(5):
                p.send(ferrymq.Message("old", b"from the deleted topic %d" % i))
        assert ends(b.address, "old") == [5]
    # the disk a crash leaves between delete's list write and its directory removal: the list
    # no longer names the topic, its directory is still there
    if before is None:
        (data / "meta" / "topics").unlink()
    else:
        (data / "meta" / "topics").write_bytes(before)
    assert (data / "topics" / "old" / "0").is_dir()

    with ferrymq.Broker(data, port=0) as b:
        assert not (data / "topics" / "old").exists(), "the leftover is removed at start"
        with ferrymq.AdminClient(b.address) as admin:
            assert "old" not in [t[0] for t in admin.list_topics()]
            admin.create_topic("old", queues=1)
        assert ends(b.address, "old") == [0]
        assert read_topic(b.address, "old", quiet=0.3) == []


def test_create_over_a_leftover_directory_starts_empty(tmp_path: Path) -> None:
    """A directory left in place while the broker runs (a create that failed half way, or one
    put back by hand) is not reused by a create: it is removed and the new topic starts empty."""
    data = tmp_path / "data"
    with ferrymq.Broker(data, port=0) as b:
        with ferrymq.AdminClient(b.address) as admin:
            admin.create_topic("old", queues=1)
        with ferrymq.Producer(b.address) as p:
            p.send(ferrymq.Message("old", b"x"))
    saved = tmp_path / "saved"
    shutil.copytree(data / "topics" / "old", saved)
    with ferrymq.Broker(data, port=0) as b:
        with ferrymq.AdminClient(b.address) as admin:
            admin.delete_topic("old")
            shutil.copytree(saved, data / "topics" / "old")
            admin.create_topic("old", queues=1)
        assert ends(b.address, "old") == [0]


def test_a_lost_topic_list_sets_the_data_aside(tmp_path: Path) -> None:
    """Without its topic list a data directory's topics are unknown, but their data is not
    thrown away: it is moved to orphaned/ for the operator, and the broker starts empty."""
    data = tmp_path / "data"
    with ferrymq.Broker(data, port=0) as b:
        with ferrymq.AdminClient(b.address) as admin:
            admin.create_topic("kept", queues=1)
        with ferrymq.Producer(b.address) as p:
            p.send(ferrymq.Message("kept", b"x"))
    (data / "meta" / "topics").unlink()
    with ferrymq.Broker(data, port=0) as b, ferrymq.AdminClient(b.address) as admin:
        assert [t[0] for t in admin.list_topics() if not t[0].startswith("%")] == []
    kept = list((data / "orphaned").iterdir())
    assert [p.name.split(".")[0] for p in kept] == ["kept"]
    assert any((kept[0] / "0").glob("*.log"))
