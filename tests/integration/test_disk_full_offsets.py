"""A consumer group's offset commit on a full disk (injected ENOSPC on the offsets file): a
retriable STORAGE_FULL, the committed offsets unchanged on disk and in memory (nothing half
applied), and the same commit going through once space is back, with no restart."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import ferrymq
from ferrymq.errors import StorageFullError
from ferrymq.testing import Faults
from tests.helpers import BrokerProcess

pytestmark = pytest.mark.integration


def test_offset_commit_on_a_full_disk_changes_nothing_and_resumes(tmp_path: Path) -> None:
    flag = tmp_path / "enospc"
    with BrokerProcess(tmp_path / "data", env={"FERRYMQ_BUSY_RETRY_AFTER_MS": "100"},
                       faults=Faults(enospc_file=str(flag))) as bp:
        with ferrymq.AdminClient(bp.address) as admin:
            admin.create_topic("o", 1)
        with ferrymq.Producer(bp.address) as p:
            p.send_batch([ferrymq.Message("o", f"m{i}".encode()) for i in range(10)])
        with ferrymq.PullConsumer(bp.address, group="g", auto_commit=False,
                                  request_timeout_s=1.0) as c:
            c.assign([("o", 0)])
            c.commit({("o", 0): 3})
            flag.write_text("write %groups/g\n")
            with pytest.raises(StorageFullError, match=r"disk full.*retry_after_ms=100"):
                c.commit({("o", 0): 7})
            assert c.committed() == {("o", 0): 3}

            # a commit waiting out the full disk goes through once space is back
            done: list[BaseException | None] = []

            def commit() -> None:
                try:
                    with ferrymq.PullConsumer(bp.address, group="g", auto_commit=False,
                                              request_timeout_s=10.0) as c2:
                        c2.assign([("o", 0)])
                        c2.commit({("o", 0): 9})
                    done.append(None)
                except BaseException as exc:
                    done.append(exc)

            th = threading.Thread(target=commit)
            th.start()
            th.join(0.8)
            assert th.is_alive() and not done  # retrying STORAGE_FULL after its retry-after
            flag.unlink()
            th.join(10)
            assert done == [None]
            assert c.committed() == {("o", 0): 9}
        assert "Traceback" not in bp.log_text()
    with BrokerProcess(tmp_path / "data") as bp:  # and it is what was stored
        with ferrymq.PullConsumer(bp.address, group="g", auto_commit=False) as c:
            c.assign([("o", 0)])
            assert c.committed() == {("o", 0): 9}
