"""Unit tests for workers/runtime/pulls.py: pull sizing from the measured job time and round trip.

Pure code: every time is passed in, no clock is read.
"""

from __future__ import annotations

import pytest

from workers.runtime.pulls import (
    BACKLOG_RUN,
    BUFFER_REQUESTS,
    DEPTH,
    IDLE_STALE,
    KNOWN_JOBS,
    MIN_SPAN,
    RTT_CAP,
    RTT_SAMPLES,
    SPREAD_JOBS,
    WAIT_ROUNDS,
    PullSizer,
    fair_share,
)

NOW = 1000.0


def sizer(concurrency: int = 1, ceiling: int = 256, share: int = 1000, job: float | None = None,
          rtt: float | None = None, known: bool = True) -> PullSizer:
    """A worker's sizing; `known`: the fleet has seen enough jobs to trust their spread (the
    start-up rule has its own tests below)."""
    s = PullSizer(concurrency, ceiling, share)
    s.fleet_seen = KNOWN_JOBS if known else 0.0
    s.message(NOW)
    if rtt is not None:
        s.round_trip(rtt)
    if job is not None:
        s.job_done(job)
    return s


def test_a_fresh_worker_asks_for_one_job_per_handler():
    s = PullSizer(concurrency=3, ceiling=256, share=1000)
    assert s.prefetch(NOW) == 0 and s.capacity(NOW) == 3
    assert s.size(NOW, outstanding=0, credits=0, free_entries=100) == 3


def test_short_jobs_get_a_deep_buffer_and_large_pulls():
    s = sizer(job=0.00001, rtt=0.01, share=5000)       # 10 µs jobs, 10 ms round trip: capped by the ceiling
    assert s.capacity(NOW) == 1 + BUFFER_REQUESTS * 256                     # several requests' worth ...
    assert s.size(NOW, outstanding=0, credits=0, free_entries=3000) == 256  # ... each of one batch at most
    assert s.size(NOW, outstanding=1, credits=0, free_entries=3000) == 256
    assert sizer(job=0.00001, rtt=0.01).capacity(NOW) == 1000               # and within the fair share


def test_slow_jobs_hoard_nothing():
    s = sizer(job=0.2, rtt=0.002)                      # the seed experiment: 0.2 s jobs
    assert s.prefetch(NOW) == 0 and s.capacity(NOW) == 1
    assert s.size(NOW, outstanding=1, credits=0, free_entries=100) == 0      # busy: ask for nothing
    assert s.size(NOW, outstanding=0, credits=0, free_entries=100) == 1      # free handler: one job


def test_prefetch_covers_depth_round_trips_of_work():
    s = sizer(concurrency=2, job=0.003, rtt=0.012)
    assert s.prefetch(NOW) == round(2 * DEPTH * 0.012 / 0.003)               # 16 jobs of 3 ms
    assert s.capacity(NOW) == 2 + 16


def test_a_job_is_buffered_once_a_round_trip_is_a_quarter_of_it():
    assert sizer(job=0.1, rtt=0.024).prefetch(NOW) == 0          # 2 x 24 ms / 100 ms = 0.48
    assert sizer(job=0.1, rtt=0.026).prefetch(NOW) == 1          # 0.52


def test_requests_top_up_only_once_half_the_capacity_is_free():
    s = sizer(job=0.003, rtt=0.012)                              # capacity 1 + 8 = 9
    assert s.capacity(NOW) == 9
    assert s.size(NOW, outstanding=6, credits=0, free_entries=100) == 0      # room 3 < 4
    assert s.size(NOW, outstanding=5, credits=2, free_entries=100) == 4      # room 4
    assert s.size(NOW, outstanding=0, credits=0, free_entries=100) == 9


def test_the_round_trip_is_bounded_below_and_above():
    assert sizer(job=0.001, rtt=0.0001).rtt == MIN_SPAN
    assert sizer(job=0.001, rtt=5.0).rtt == RTT_CAP
    assert sizer(job=0.1, rtt=5.0).prefetch(NOW) == round(DEPTH * RTT_CAP / 0.1)   # never more work than that


def test_the_round_trip_is_the_worst_recent_sample_and_an_old_spike_ages_out():
    s = sizer(job=0.001)
    s.round_trip(0.05)                                  # a start-up spike
    s.round_trip(0.01)
    assert s.rtt == 0.05
    for _ in range(RTT_SAMPLES):
        s.round_trip(0.01)
    assert s.rtt == 0.01


def test_a_slower_job_counts_at_once_and_faster_ones_slowly():
    s = sizer(job=0.001)
    s.job_done(0.021)
    assert s.job_time == pytest.approx(0.011)           # half way up at once
    s.job_done(0.001)
    assert s.job_time == pytest.approx(0.010)           # a tenth of the way down


def test_the_fair_share_of_max_ack_pending_caps_everything():
    assert fair_share(1000, 8) == 125 and fair_share(1000, 3) == 333
    assert fair_share(4, 8) == 1 and fair_share(0, 0) == 1              # robust when small
    s = sizer(concurrency=4, share=fair_share(10, 4), job=0.00001, rtt=0.01)
    assert s.capacity(NOW) == 2                          # below concurrency: the server would stop there anyway
    assert s.size(NOW, outstanding=0, credits=0, free_entries=100) == 2
    assert s.size(NOW, outstanding=1, credits=1, free_entries=100) == 1
    assert s.size(NOW, outstanding=2, credits=1, free_entries=100) == 0


def test_the_ceiling_caps_prefetch_and_each_request():
    s = sizer(ceiling=16, job=0.00001, rtt=0.01)
    assert s.prefetch(NOW) == BUFFER_REQUESTS * 16 and s.capacity(NOW) == 1 + BUFFER_REQUESTS * 16
    assert s.size(NOW, outstanding=0, credits=0, free_entries=100) == 16


def test_the_slot_table_and_max_jobs_limit_the_request():
    s = sizer(ceiling=64, job=0.00001, rtt=0.01)         # capacity 1 + 4 x 64 = 257
    assert s.size(NOW, outstanding=0, credits=0, free_entries=200) == 64    # a batch at a time
    assert s.size(NOW, outstanding=0, credits=0, free_entries=150) == 64
    assert s.size(NOW, outstanding=100, credits=0, free_entries=110) == 0   # room 110 < half of 257
    assert s.size(NOW, outstanding=100, credits=100, free_entries=200) == 0  # room 100 < half of 257
    assert s.size(NOW, outstanding=0, credits=0, free_entries=200, jobs_left=3) == 3
    assert s.size(NOW, outstanding=0, credits=0, free_entries=200, jobs_left=0) == 0


def test_after_an_idle_spell_the_job_time_is_stale_until_a_new_job_finishes():
    s = sizer(ceiling=64, job=0.00001, rtt=0.01)         # capacity 257
    assert s.capacity(NOW + IDLE_STALE - 1) == 257
    later = NOW + IDLE_STALE + 1
    assert s.capacity(later) == 1                        # the idle worker's renewed request: one job
    s.message(later, pending=50)                         # a new burst: still one until a job of it is timed
    assert s.capacity(later) == 1
    s.job_done(0.5)                                      # a slow one: replaces the estimate outright
    assert s.job_time == 0.5 and s.capacity(later) == 1
    for _ in range(100):                                 # then fast ones win it back, slowly
        s.job_done(0.00001)
    assert s.capacity(later) == 1                        # (a backlog of one message: not yet a backlog)
    for _ in range(BACKLOG_RUN - 1):
        s.message(later, pending=50)
    assert s.capacity(later) == 257


def test_sync_handlers_hide_two_hand_overs_and_the_outcome_batching():
    threads = PullSizer(1, 256, 1000, threads=True, batching=0.005)
    threads.fleet_seen = KNOWN_JOBS
    threads.message(NOW)
    threads.round_trip(0.004)
    assert threads.rtt == pytest.approx(2 * 0.004 + 0.005)
    threads.job_done(0.003)                                   # outcomes of 3 ms jobs wait up to 2 ms more
    assert threads.rtt == pytest.approx(2 * 0.004 + 0.002)
    assert threads.prefetch(NOW) == round(DEPTH * 0.010 / 0.003)
    assert sizer(job=0.003, rtt=0.004).rtt == MIN_SPAN        # an async handler: one round trip


def test_jobs_longer_than_the_outcome_batching_go_back_alone_and_buy_no_buffer():
    s = PullSizer(1, 256, 1000, threads=True, batching=0.02)
    s.message(NOW)
    s.round_trip(0.004)
    s.job_done(0.05)                                          # the crash test's 50 ms jobs
    assert s.rtt == pytest.approx(2 * 0.004)
    assert s.prefetch(NOW) == 0 and s.capacity(NOW) == 1     # what a death leaves: the running job


# -- the spread of job times (issue 25): buffer nothing a handler may not start soon

def mixed(s: PullSizer, short: float, long: float, every: int, jobs: int) -> None:
    """`jobs` job times: `short` ones, and one `long` among every `every`."""
    for k in range(jobs):
        s.job_done(long if k % every == every // 2 else short)


def test_uniform_jobs_are_sized_by_the_mean_alone_the_spread_rule_never_binds():
    # The residual of uniform jobs is half a job: its threshold is the formula's own, so for every
    # job time, round trip and concurrency the spread rule only ever agrees with it.
    for concurrency in (1, 2, 4):
        for rtt in (0.001, 0.004, 0.02):
            for job in (0.00001, 0.001, 0.003, 0.01, 0.015, 0.02, 0.05, 0.2, 1.0):
                s = sizer(concurrency=concurrency, job=job, rtt=rtt)
                for _ in range(50):
                    s.job_done(job)
                by_mean = min(BUFFER_REQUESTS * 256, int(concurrency * DEPTH * s.rtt / job + 0.5))
                assert s.prefetch(NOW) == by_mean, (concurrency, rtt, job)
                assert s.residual == pytest.approx(job / 2)


def test_one_long_job_among_short_ones_stops_the_buffer():
    # The fairness scenario's mix: 10 ms jobs, one of 2 s among every 200. The mean alone buffers
    # two short jobs; the residual (about 0.5 s) says a buffered job would wait behind a long one.
    s = sizer(job=0.01, rtt=0.005)
    for _ in range(100):
        s.job_done(0.01)
    assert s.prefetch(NOW) == 1 and not s.spread()
    mixed(s, 0.01, 2.0, 200, 1000)
    assert s.residual > 0.3 and s.spread()
    assert s.prefetch(NOW) == 0 and s.capacity(NOW) == 1
    assert s.size(NOW, outstanding=1, credits=0, free_entries=100) == 0      # running one: ask for nothing


def test_the_spread_is_remembered_for_thousands_of_jobs_then_forgotten():
    s = sizer(job=0.01, rtt=0.005)
    mixed(s, 0.01, 2.0, 200, 1000)
    for _ in range(SPREAD_JOBS):                       # a thousand short jobs after the last long one
        s.job_done(0.01)
    assert s.spread()
    for _ in range(5 * SPREAD_JOBS):
        s.job_done(0.01)
    assert not s.spread() and s.prefetch(NOW) == 1     # uniform again: the mean's buffer is back


def test_short_hiccups_among_no_op_jobs_keep_the_buffer():
    # A no-op timed at 20 ms once in a thousand (a thread descheduled on a busy box) is no reason
    # to stop buffering: the residual stays far below the buffer's span.
    s = sizer(job=0.00001, rtt=0.005)
    mixed(s, 0.00001, 0.02, 1000, 5000)
    assert not s.spread() and s.prefetch(NOW) >= 256


def test_more_handlers_share_the_wait_behind_a_long_job():
    # With 8 handlers a buffered job waits for the first of them to free: the same mix that stops
    # one handler's buffer (residual ~50 ms against 2 x 5 ms) still buffers at 8 (against 8 x 10 ms).
    one, eight = sizer(concurrency=1, rtt=0.005), sizer(concurrency=8, rtt=0.005)
    for s in (one, eight):
        mixed(s, 0.001, 0.2, 100, 2000)
    assert one.spread() and one.prefetch(NOW) == 0
    assert not eight.spread() and eight.prefetch(NOW) > 0


def test_without_a_buffer_a_free_handler_asks_at_once():
    # Slow jobs, 4 handlers, nothing buffered: one free handler is worth a request (the half-free
    # rule is for buffers; here it would leave the handler idle until a second one finished).
    s = sizer(concurrency=4, job=0.2, rtt=0.002)
    assert s.prefetch(NOW) == 0
    assert s.size(NOW, outstanding=3, credits=0, free_entries=100) == 1
    assert s.size(NOW, outstanding=4, credits=0, free_entries=100) == 0


def test_with_a_backlog_the_buffer_stays_whatever_the_spread():
    # Every free handler finds work at once and a job waits in the stream if not in a buffer: the
    # buffer only saves round trips. One message saying more were pending is not a backlog yet
    # (a burst that other workers' requests are about to take); BACKLOG_RUN in a row are.
    s = sizer(job=0.01, rtt=0.005)
    mixed(s, 0.01, 2.0, 200, 1000)
    for k in range(BACKLOG_RUN):
        assert s.spread() and s.prefetch(NOW) == 0, k
        s.message(NOW, pending=100)
    assert not s.spread() and s.prefetch(NOW) == 1
    s.message(NOW, pending=0)                          # drained: fair again
    assert s.spread() and s.prefetch(NOW) == 0


def test_a_new_burst_after_an_idle_spell_starts_the_spread_over():
    s = sizer(job=0.01, rtt=0.005)
    mixed(s, 0.01, 2.0, 200, 1000)
    assert s.spread()
    later = NOW + IDLE_STALE + 1
    s.message(later)
    s.job_done(0.01)
    s.fleet_seen = 0.0                                  # what the parent pools from idle workers: nothing
    assert s.residual == pytest.approx(0.005) and s.seen == 1
    assert s.spread() and s.prefetch(later) == 0        # a new burst's spread is not known yet ...
    s.fleet_seen = KNOWN_JOBS                           # ... until the fleet has seen enough of it
    assert not s.spread()


def test_a_worker_that_has_not_met_a_long_job_learns_the_spread_from_the_fleet():
    # Worker A ran the mix, worker B only short jobs so far: B alone would buffer. Through their
    # slot tables the parent pools both (Stats.share_spread) and B stops buffering too.
    from types import SimpleNamespace

    from supervisor.parent.stats import Stats
    from workers.protocol.slots import SlotTable

    a, b = sizer(job=0.01, rtt=0.005), sizer(job=0.01, rtt=0.005)
    mixed(a, 0.01, 2.0, 200, 1000)
    for _ in range(1000):
        b.job_done(0.01)
    assert a.spread() and not b.spread() and b.prefetch(NOW) == 1
    tables = [SlotTable(8, 64), SlotTable(8, 64)]
    try:
        for s, t in zip((a, b), tables):
            t.share_spread(*s.shared(NOW))
        fleet = Stats(lambda: [SimpleNamespace(table=t) for t in tables]).share_spread()
        assert a.residual > fleet > b.residual
        b.fleet_residual, b.fleet_seen = tables[1].fleet_spread()
        assert b.fleet_residual == fleet and b.fleet_seen == pytest.approx(a.seen + b.seen)
        assert b.spread() and b.prefetch(NOW) == 0
    finally:
        for t in tables:
            t.close()


def test_until_the_spread_is_known_nothing_is_buffered_without_a_backlog():
    # The warm-up of the fairness scenario: short jobs timed, no long one finished yet. A buffer
    # open now would fill with short jobs behind the first long one, so none is opened until
    # KNOWN_JOBS recent jobs (the decayed count: about 700 after a start) vouch for the spread.
    s = sizer(job=0.01, rtt=0.005, known=False)
    jobs = 1
    while not s.known:
        assert s.spread() and s.prefetch(NOW) == 0 and s.capacity(NOW) == 1, jobs
        s.job_done(0.01)
        jobs += 1
    assert 650 < jobs < 750 and s.seen >= KNOWN_JOBS
    assert not s.spread() and s.prefetch(NOW) == 1                  # uniform: the mean's buffer


def test_the_fleets_count_vouches_for_a_worker_that_has_seen_few_jobs():
    s = sizer(job=0.01, rtt=0.005, known=False)
    s.fleet_seen = KNOWN_JOBS - 1
    assert s.spread() and s.prefetch(NOW) == 0
    s.fleet_seen = KNOWN_JOBS
    assert not s.spread() and s.prefetch(NOW) == 1


def test_an_unknown_spread_keeps_the_buffer_of_a_backlog():
    # With a backlog a job waits in the stream if not in a buffer: the start-up rule, like the
    # spread rule, is for a stream that keeps up.
    s = sizer(job=0.00001, rtt=0.005, known=False)
    assert s.prefetch(NOW) == 0
    for _ in range(BACKLOG_RUN):
        s.message(NOW, pending=100)
    assert s.prefetch(NOW) >= 256


def test_an_idle_worker_shares_nothing_of_its_last_burst():
    s = sizer(job=0.01, rtt=0.005)
    mixed(s, 0.01, 2.0, 200, 1000)
    assert s.shared(NOW) == (s.spent, s.spent_sq, s.seen)
    assert s.shared(NOW + IDLE_STALE + 1) == (0.0, 0.0, 0.0)


def test_jobs_waiting_for_a_full_limit_take_no_handler_and_buy_no_buffer():
    """[limits]: jobs parked for a full limit are not outstanding, so a free handler asks past
    them (for jobs that need none); while any wait the worker asks only for what its free
    handlers can start, within the fair share with the waiters in it, and for nothing once
    WAIT_ROUNDS rounds of its handlers wait (or its capacity, if more), nor while a parked job
    is held for its turn to take its limits. Before: waiters beyond `concurrency` counted as
    taking a handler, so a worker of concurrency 1 with two waiters stopped asking, idle."""
    slow = sizer(concurrency=2, job=0.2, rtt=0.002)          # no buffer: capacity 2
    assert slow.size(NOW, outstanding=0, credits=0, free_entries=100, limit_waiting=5) == 2
    assert slow.size(NOW, outstanding=1, credits=0, free_entries=100, limit_waiting=5) == 1
    assert slow.size(NOW, outstanding=2, credits=0, free_entries=100, limit_waiting=5) == 0
    assert slow.waiting_allowance(NOW) == WAIT_ROUNDS * 2
    assert slow.size(NOW, outstanding=0, credits=0, free_entries=100, limit_waiting=WAIT_ROUNDS * 2) == 0
    assert slow.size(NOW, outstanding=0, credits=0, free_entries=100, held=True) == 0
    one = sizer(concurrency=1, job=0.2, rtt=0.002)
    assert one.size(NOW, outstanding=0, credits=0, free_entries=100, limit_waiting=2) == 1   # idle: asks
    fast = sizer(concurrency=2, job=0.00001, rtt=0.01, share=5000)   # a deep buffer without waiters ...
    assert fast.size(NOW, outstanding=0, credits=0, free_entries=3000) == 256
    assert fast.size(NOW, outstanding=0, credits=0, free_entries=3000, limit_waiting=3) == 2   # ... none with
    assert fast.waiting_allowance(NOW) == fast.capacity(NOW)         # a pull alone never stops it
    shared = sizer(concurrency=2, job=0.2, rtt=0.002, share=4)
    assert shared.size(NOW, outstanding=0, credits=0, free_entries=100, limit_waiting=3) == 1   # the share holds


@pytest.mark.parametrize("concurrency, batch, max_ack_pending, count",
                         [(1, 256, 1000, 1), (1, 256, 1000, 8), (4, 16, 100_000, 2), (1, 1, 1000, 1), (8, 1024, 20_000, 1)])
def test_the_slot_table_holds_the_largest_buffer_twice(concurrency, batch, max_ack_pending, count):
    # Every pulled message is recorded before anything else; a full table NAKs (a delivery spent).
    # The parent sizes the table for the largest capacity a worker can reach, and as many again
    # for acked entries waiting for their fence.
    from types import SimpleNamespace

    from supervisor.config import Config
    from supervisor.parent.pool import Pool

    cfg = Config().replace(workers={"concurrency": concurrency, "batch": batch, "count": count},
                           consumer={"max_ack_pending": max_ack_pending})
    s = PullSizer(concurrency, batch, fair_share(max_ack_pending, count))
    s.message(NOW)
    s.round_trip(RTT_CAP)
    s.job_done(1e-6)                                   # the deepest buffer there is
    assert Pool.table_entries(SimpleNamespace(cfg=cfg)) >= 2 * s.capacity(NOW)


def test_ordered_workers_buffer_only_by_the_spread_and_look_past_parked_jobs():
    """[ordering]: a busy handler asks for nothing while the spread is wide or unknown (a job of
    another key would wait behind it while another worker is free); uniform short jobs are
    buffered as without ordering. Parked jobs take no handler nor buffer, so the worker asks past
    them until the look ahead is full; credits, the fair share, the table and max_jobs bind."""
    s = PullSizer(concurrency=2, ceiling=256, share=100, lookahead=8)
    s.message(NOW)
    s.job_done(0.001)                                                               # spread not known
    assert s.ordered_size(NOW, busy=0, parked=0, credits=0, free_entries=100) == 2
    assert s.ordered_size(NOW, busy=2, parked=0, credits=0, free_entries=100) == 0  # both handlers busy
    assert s.ordered_size(NOW, busy=1, parked=5, credits=0, free_entries=100) == 1  # past the parked ones
    assert s.ordered_size(NOW, busy=0, parked=7, credits=0, free_entries=100) == 1  # the look ahead nearly full
    assert s.ordered_size(NOW, busy=0, parked=8, credits=0, free_entries=100) == 0
    assert s.ordered_size(NOW, busy=0, parked=0, credits=2, free_entries=100) == 0  # already asked
    assert s.ordered_size(NOW, busy=0, parked=0, credits=0, free_entries=1) == 1
    assert s.ordered_size(NOW, busy=0, parked=0, credits=0, free_entries=100, jobs_left=1) == 1
    for _ in range(BACKLOG_RUN):
        s.message(NOW, pending=100)
    assert s.backlog and s.ordered_size(NOW, busy=2, parked=0, credits=0, free_entries=100) == 0   # no buffer
    uniform = sizer(concurrency=2, share=100, job=0.001, rtt=0.001)
    uniform.lookahead = 8
    assert uniform.prefetch(NOW) > 0
    assert uniform.ordered_size(NOW, busy=2, parked=0, credits=0, free_entries=100) > 0   # a buffer
    assert uniform.ordered_size(NOW, busy=2, parked=3, credits=0, free_entries=100) == 5  # the look ahead binds
    assert uniform.ordered_size(NOW, busy=2, parked=0, credits=0, free_entries=100) <= 8
