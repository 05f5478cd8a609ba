"""The chaos checker on hand-made histories: a clean one passes, each anomaly is found."""

from __future__ import annotations

from tests.cluster.chaos.history import History, check


def clean() -> History:
    """Two keys on two queues; a1 timed out and was stored anyway, b1 failed and was not."""
    h = History()
    for key, queue, ids in (("a", 0, ["a0", "a1", "a2"]), ("b", 1, ["b0", "b1", "b2"])):
        for i, msg_id in enumerate(ids):
            s = h.invoke(msg_id, key)
            if msg_id == "a1":
                h.failed(s, TimeoutError("lost answer"), timed_out=True)
            elif msg_id == "b1":
                h.failed(s, RuntimeError("refused"), timed_out=False)
            else:
                h.ok(s, queue, i if key == "a" else i - (i > 1))
    for q, ids in ((0, ["a0", "a1", "a2"]), (1, ["b0", "b2"])):
        for off, msg_id in enumerate(ids):
            h.read(q, off, msg_id)
            h.read(q, off, msg_id, final=True)
            h.high_watermark("r", q, off + 1)
    return h


def test_a_clean_history_passes() -> None:
    report = check(clean())
    assert report.clean, report.summary()
    assert (report.sent, report.acked, report.indeterminate) == (6, 4, 2)


def test_an_acknowledged_message_missing_from_the_final_log_is_lost() -> None:
    h = clean()
    h.final = [r for r in h.final if r[1] != "b2"]
    report = check(h)
    assert report.lost == ["b2"] and not report.clean


def test_a_message_acknowledged_at_one_offset_and_stored_at_another_is_misplaced() -> None:
    h = clean()
    h.sends["a2"].place = (0, 7)
    assert check(h).misplaced == [("a2", (0, 7), (0, 2))]


def test_a_message_read_but_never_sent_is_unexpected() -> None:
    h = clean()
    h.read(1, 2, "ghost")
    report = check(h)
    assert report.unexpected == ["ghost"]
    assert report.divergent == {}  # offset 2 of queue 1 was read only once


def test_one_id_at_two_offsets_is_a_duplicate() -> None:
    h = clean()
    h.read(0, 3, "a0", final=True)
    assert check(h).duplicates == {"a0": [(0, 0), (0, 3)]}


def test_one_offset_read_with_two_bodies_is_divergent() -> None:
    h = clean()
    h.read(1, 1, "b1")  # read during the run, taken back by a failover: the drain holds b2
    report = check(h)
    assert report.divergent == {(1, 1): ["b1", "b2"]}


def test_acknowledged_messages_of_one_key_in_the_other_order_are_reordered() -> None:
    h = clean()
    h.final = [((0, 0), "a2"), ((0, 1), "a1"), ((0, 2), "a0"), *h.final[3:]]
    report = check(h)
    assert ("a", "a0", "a2") in report.reordered
    assert report.misplaced  # and they are not where they were acknowledged


def test_a_key_split_over_two_queues_is_reordered() -> None:
    h = clean()
    h.sends["a2"].place = (1, 9)
    h.final = [*[r for r in h.final if r[1] != "a2"], ((1, 9), "a2")]
    assert check(h).reordered == [("a", "a0", "a2")]


def test_a_high_watermark_going_down_is_reported() -> None:
    h = clean()
    h.high_watermark("r", 0, 1)  # after 3
    h.high_watermark("r", 0, 1)  # no change: recorded once
    assert check(h).hw_back == [("r", 0, 3, 1)]
