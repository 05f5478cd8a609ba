"""A delivery group's snapshot and journal: a compaction that fails half-way changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrymq.broker.delivery.store import GroupStore


@pytest.mark.parametrize("blocked", ["journal.1", "state"])
def test_a_rotation_that_fails_keeps_the_old_generation(tmp_path: Path, blocked: str) -> None:
    """The new journal (``journal.1``; in production: EMFILE) or the new snapshot (``state``:
    no space) cannot be written, here because a directory is in the way: the rotation fails
    and changes nothing, and what is journaled after it is replayed at the next load. (When
    the journal could not be created, it used to be written to a journal the snapshot just
    written had disowned: lost at the next load.)"""
    d = tmp_path / "g"
    store, snap, records = GroupStore.load(d)
    assert snap is None and records == []
    store.append(["N", "t", 0, 5])
    (d / blocked).mkdir()
    (d / blocked / "x").write_bytes(b"")
    with pytest.raises(OSError):
        store.rotate({"sources": "snapshot of the state"})
    assert store.gen == 0 and sorted(p.name for p in d.iterdir()) == sorted(["journal.0", blocked])
    store.append(["N", "t", 0, 7])
    store.close()
    (d / blocked / "x").unlink()
    (d / blocked).rmdir()
    _, snap, records = GroupStore.load(d)
    assert snap is None and records == [["N", "t", 0, 5], ["N", "t", 0, 7]]


def test_a_rotation_starts_an_empty_journal(tmp_path: Path) -> None:
    d = tmp_path / "g"
    store, _, _ = GroupStore.load(d)
    store.append(["N", "t", 0, 5])
    store.rotate({"sources": [], "marker": 1})
    store.append(["N", "t", 0, 9])
    store.close()
    assert sorted(p.name for p in d.iterdir()) == ["journal.1", "state"]
    _, snap, records = GroupStore.load(d)
    assert snap is not None and snap["marker"] == 1 and snap["gen"] == 1
    assert records == [["N", "t", 0, 9]]
