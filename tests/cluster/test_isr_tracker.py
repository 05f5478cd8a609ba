"""The leader's bookkeeping of its followers (pure: times are arguments)."""

from __future__ import annotations

from ferrymq.cluster.replication.isr import LEFT_OUT_RETRY_MS, UNKNOWN, IsrTracker


def tracker(sync: bool = True, isr: list[int] | None = None) -> IsrTracker:
    return IsrTracker(1, [1, 2, 3], [1, 2, 3] if isr is None else isr, sync=sync, lag_ms=1000,
                      now_ms=0)


def test_hw_is_the_lowest_position_over_the_isr_and_never_goes_back() -> None:
    t = tracker()
    assert t.high_watermark(10, 0) == 0  # followers not heard from yet
    t.on_fetch(2, 10, 8, 10, 5)
    t.on_fetch(3, 10, 6, 10, 5)
    assert t.position(2) == 8 and t.position(3) == 6
    assert t.high_watermark(10, 0) == 6  # sync mode: durable offsets
    assert t.high_watermark(5, 0) == 5  # the leader's own position counts
    assert t.high_watermark(10, 7) == 7  # never below the current HW
    t.on_fetch(3, 4, 4, 10, 6)  # (a follower going back cannot move the HW back)
    assert t.high_watermark(10, 6) == 6


def test_async_mode_uses_log_ends() -> None:
    t = tracker(sync=False)
    t.on_fetch(2, 10, 0, 10, 5)
    t.on_fetch(3, 9, 0, 10, 5)
    assert t.high_watermark(10, 0) == 9


def test_a_pending_addition_counts_for_the_hw_and_a_pending_removal_still_counts() -> None:
    t = tracker(isr=[1, 2])
    t.on_fetch(2, 10, 10, 10, 5)
    assert t.high_watermark(10, 0) == 10
    t.pending = [1, 2, 3]  # 3 being added: the HW waits for it at once
    assert t.position(3) == UNKNOWN and t.high_watermark(10, 0) == 0
    t.pending = None
    t.isr = [1, 2, 3]
    t.pending = [1, 2]  # 3 being removed: it still counts until committed
    assert t.high_watermark(10, 0) == 0


def test_caught_up_follows_kafkas_rule_and_a_lagging_member_is_proposed_out() -> None:
    t = tracker()
    t.on_fetch(2, 10, 10, 10, 100)  # at the leader's end: caught up now
    t.on_fetch(3, 10, 10, 10, 100)
    # the leader appends all the time: a fetch reaching the end the leader had at the
    # previous fetch keeps the follower caught up as of that previous fetch
    t.on_fetch(2, 10, 10, 20, 600)
    t.on_fetch(2, 20, 20, 30, 1100)
    assert t.followers[2].caught_up_ms == 600
    t.on_fetch(3, 10, 10, 30, 1100)  # 3 stays at 10
    assert t.followers[3].caught_up_ms == 100
    assert not t.lagging(2, 1500, 30)
    assert t.lagging(3, 1500, 30)
    assert t.proposal(1500, 30, 10, 0) == [1, 2]
    t.pending = [1, 2]
    assert t.proposal(1500, 30, 10, 0) is None  # one proposal at a time


def test_a_follower_at_the_leaders_end_is_never_lagging() -> None:
    t = tracker()
    t.on_fetch(2, 10, 10, 10, 0)
    t.on_fetch(3, 10, 10, 10, 0)
    assert t.proposal(60_000, 10, 10, 0) is None  # idle: long polls hold nothing back


def test_a_follower_comes_back_once_it_reaches_the_hw_and_the_epoch_start() -> None:
    t = tracker(isr=[1, 2])
    t.on_fetch(2, 50, 50, 50, 0)
    t.on_fetch(3, 40, 40, 50, 0)
    assert t.proposal(0, 50, 50, 0) is None  # 3 is below the HW
    t.on_fetch(3, 50, 45, 50, 1)
    assert t.proposal(1, 50, 50, 0) is None  # sync mode: its durable offset must reach it
    t.on_fetch(3, 50, 50, 50, 2)
    assert t.proposal(2, 50, 50, 60) is None  # not yet past this leader's epoch start
    assert t.proposal(2, 50, 50, 50) == [1, 2, 3]


def test_a_member_the_store_left_out_stays_out_until_it_fetches_again() -> None:
    # 3 died while nothing was written: at the leader's end, it looks caught up once the
    # controller took it out; the store refuses it (its broker is not alive)
    t = tracker(isr=[1, 2])
    t.on_fetch(2, 10, 10, 10, 100)
    t.on_fetch(3, 10, 10, 10, 100)
    assert t.proposal(200, 10, 10, 0) == [1, 2, 3]
    t.pending = [1, 2, 3]
    t.on_result([1, 2, 3], [1, 2], 200)
    assert t.pending is None and t.isr == [1, 2]  # what the store committed
    assert t.high_watermark(10, 0) == 10  # 3 does not hold the HW back
    assert t.proposal(5000, 10, 10, 0) is None  # not proposed again while it is silent
    t.on_fetch(3, 10, 10, 10, 300)  # alive after all (its key was missing for a moment):
    assert t.proposal(300, 10, 10, 0) is None  # not proposed at every fetch
    t.on_fetch(3, 10, 10, 10, 200 + LEFT_OUT_RETRY_MS)  # (or back, restarted)
    assert t.proposal(200 + LEFT_OUT_RETRY_MS, 10, 10, 0) == [1, 2, 3]


def test_a_refused_proposal_changes_nothing_but_the_pending_one() -> None:
    t = tracker(isr=[1, 2])
    t.on_fetch(3, 10, 10, 10, 100)
    t.pending = [1, 2, 3]
    t.on_result([1, 2, 3], None, 150)
    assert t.pending is None and t.isr == [1, 2]
    assert t.proposal(200, 10, 0, 0) == [1, 2, 3]  # a stale view: it may be proposed again
