"""Unit tests for supervisor.lag: fake times only, no sleeps, no I/O.

Scenarios follow the seed post: the 40-job burst drained at ~4/s by two workers, a publisher that
outpaces the workers, a worker crash that pins the ack floor, and hung workers.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from supervisor.core.lag import (
    STALE_MIN_S,
    LagAnalyzer,
    LagReport,
    Sample,
    fit_line,
    latest_step,
    remove_latest_step,
    step_jumps,
)

ACK_WAIT = 30.0


def mk(t, pending=0, ack_pending=0, delivered=0, floor=0, local=None, alive=False, redelivered=0):
    """A sample; local_acked follows the ack floor unless given."""
    return Sample(t, pending, ack_pending, redelivered, delivered, floor,
                  floor if local is None else local, alive)


class FakeQueue:
    """Work-queue bookkeeping that keeps the ConsumerInfo counters consistent with each other.

    Each tick the test publishes and finishes some jobs; workers hold at most `workers` jobs in
    flight; everything finished is acked (floor = acked, no holes) by our own workers.
    """

    def __init__(self, workers: int = 2):
        self.workers = workers
        self.pending = self.in_flight = self.acked = 0

    def publish(self, n: int) -> None:
        self._settle(self.pending + self.in_flight + n)

    def finish(self, n: int) -> None:
        done = min(n, self.pending + self.in_flight)
        self.acked += done
        self._settle(self.pending + self.in_flight - done)

    def _settle(self, work: int) -> None:
        self.in_flight = min(self.workers, work)
        self.pending = work - self.in_flight

    def sample(self, t: float, noise: int = 0, alive: bool = False) -> Sample:
        return Sample(t, max(0, self.pending + noise), self.in_flight, 0,
                      self.acked + self.in_flight, self.acked, self.acked, alive)


def feed(an: LagAnalyzer, samples) -> list[LagReport]:
    """Add each sample and report right after it, as the monitor does every tick."""
    out = []
    for s in samples:
        an.add(s)
        out.append(an.report(s.t))
    return out


def states(reports) -> str:
    """One letter per tick (u/o/g/s): failures print the whole timeline at a glance."""
    return "".join(r.state[0] for r in reports)


def steady_climb(seed=1, pre=10, climb=20, after=30, up=6, capacity=4, down=0, noise=2):
    """Workers finish `capacity`/s. The publisher matches them for `pre` s, outpaces them at
    `up`/s for `climb` s, then publishes `down`/s (0: stopped, pending falls). num_pending
    carries +-noise per sample."""
    rng, q = random.Random(seed), FakeQueue(workers=4)
    q.publish(10)
    for i in range(pre + climb + after):
        q.publish(capacity if i < pre else up if i < pre + climb else down)
        q.finish(capacity)
        yield q.sample(float(i), rng.randint(-noise, noise))


def seed_burst(seed=7, idle=10, jobs=40, rate=4, ticks=40):
    """The seed post's burst: `jobs` published at once, two workers finishing ~rate/s (+-1)."""
    rng, q = random.Random(seed), FakeQueue(workers=2)
    for i in range(ticks):
        if i == idle:
            q.publish(jobs)
        elif i > idle:
            q.finish(rate + rng.randint(-1, 1))
        yield q.sample(float(i))


# --- unknown ----------------------------------------------------------------------------------


def test_fewer_than_two_samples_is_unknown():
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    assert an.report(0.0).state == "unknown"
    an.add(mk(0.0, pending=5))
    rep = an.report(0.0)
    assert rep.state == "unknown" and "1 of 2" in rep.reason
    an.add(mk(1.0, pending=5))
    assert an.report(1.0).state == "ok"


def test_stale_newest_sample_is_unknown():
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT, interval=1.0)
    feed(an, [mk(float(t), pending=3, ack_pending=1) for t in range(5)])
    assert an.stale_after == 3.0  # 3 polls
    assert an.report(4.0 + 2.9).state == "ok"
    rep = an.report(4.0 + 3.1)
    assert rep.state == "unknown" and "no ConsumerInfo for 3.1 s" in rep.reason
    assert (rep.pending_slope_per_s, rep.drain_rate_per_s, rep.eta_s) == (None, None, None)


def test_stale_after_has_a_floor_for_fast_polls():
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT, interval=0.1)
    assert an.stale_after == STALE_MIN_S
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT, interval=5.0)
    assert an.stale_after == 15.0


def test_missing_consumer_turns_unknown_then_recovers():
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    feed(an, [mk(float(t), pending=2, ack_pending=2, delivered=4 * t, floor=4 * t - 2)
              for t in range(1, 6)])
    an.poll_failed(6.0, "consumer not found")
    assert an.report(6.0).state == "ok"  # one blip changes nothing before the sample is stale
    for t in (7.0, 8.0, 9.0):
        an.poll_failed(t, "consumer not found")
    rep = an.report(9.0)
    assert rep.state == "unknown"
    assert "4 failed polls: consumer not found" in rep.reason
    an.add(mk(10.0, pending=2, ack_pending=2, delivered=40, floor=38))
    rep = an.report(10.0)
    assert rep.state == "ok" and "failed" not in rep.reason


def test_server_down_without_error_text():
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    feed(an, [mk(0.0), mk(1.0)])
    an.poll_failed(0.5, "raced")  # failed before the answer we already have: ignored
    an.poll_failed(2.0)
    assert an.report(5.0).reason == "no ConsumerInfo for 4.0 s (1 failed polls)"


def test_recreated_consumer_drops_the_old_history():
    # delivered/floor going back means a new consumer: fitting across it would read as a
    # negative drain and a bogus trend.
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    feed(an, [mk(float(t), pending=5, ack_pending=1, delivered=1000 + 4 * t, floor=999 + 4 * t)
              for t in range(10)])
    an.add(mk(10.0, pending=5, ack_pending=1, delivered=1, floor=0))
    assert len(an.samples) == 1 and an.report(10.0).state == "unknown"
    an.add(mk(11.0, pending=5, ack_pending=1, delivered=5, floor=4))
    rep = an.report(11.0)
    assert rep.state == "ok" and rep.drain_rate_per_s == pytest.approx(4.0)


# --- window, degenerate input -----------------------------------------------------------------


def test_window_trimming():
    an = LagAnalyzer(window=10, ack_wait=ACK_WAIT)
    feed(an, [mk(float(t), pending=3) for t in range(100)])
    ts = [s.t for s in an.samples]
    assert ts[0] == 89.0 and ts[-1] == 99.0 and len(ts) == 11


def test_window_shorter_than_interval_still_keeps_two_samples():
    an = LagAnalyzer(window=0.5, ack_wait=ACK_WAIT, interval=1.0)
    feed(an, [mk(float(t), pending=3, ack_pending=1, delivered=t, floor=t - 1)
              for t in range(1, 10)])
    assert len(an.samples) == 2
    assert an.report(9.0).state == "ok"


def test_identical_times_do_not_divide_by_zero():
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    reps = feed(an, [mk(5.0, pending=p, ack_pending=1, delivered=p) for p in (3, 9, 1, 40)])
    rep = reps[-1]
    assert rep.state == "ok"
    assert (rep.pending_slope_per_s, rep.drain_rate_per_s, rep.eta_s) == (None, None, None)
    # Duplicated instants among regular polls are harmless too.
    reps = feed(an, [mk(t, pending=40, ack_pending=1) for t in (6.0, 6.0, 7.0, 7.0, 8.0)])
    assert reps[-1].state == "ok" and reps[-1].pending_slope_per_s is not None


def test_zero_length_fit_is_none():
    assert fit_line([], []) is None
    assert fit_line([1.0], [2.0]) is None
    assert fit_line([1.0, 1.0, 1.0], [0.0, 5.0, 9.0]) is None
    two = fit_line([0.0, 2.0], [0.0, 4.0])
    assert two.slope == 2.0 and math.isinf(two.stderr)


def test_out_of_order_sample_is_ignored():
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    feed(an, [mk(0.0), mk(1.0), mk(2.0)])
    an.add(mk(1.5, pending=99))
    assert [s.t for s in an.samples] == [0.0, 1.0, 2.0]


def test_huge_numbers_keep_their_precision():
    base = 2**62
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    reps = feed(an, [mk(1e9 + t, pending=10**15 - 4 * t, ack_pending=2,
                        delivered=base + 4 * t, floor=base + 4 * t - 2)
                     for t in range(20)])
    rep = reps[-1]
    assert rep.state == "ok"
    assert rep.drain_rate_per_s == pytest.approx(4.0, abs=1e-6)
    assert rep.pending_slope_per_s == pytest.approx(-4.0, abs=1e-6)
    assert rep.eta_s == pytest.approx((10**15 - 76 + 2) / 4.0, rel=1e-9)
    assert rep.as_dict()["drain_rate_per_s"] == 4.0


# --- growing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [10.0, 30.0, 60.0])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_burst_is_not_growing(window, seed):
    an = LagAnalyzer(window=window, ack_wait=ACK_WAIT)
    reps = feed(an, seed_burst(seed=seed))
    assert "g" not in states(reps), states(reps)
    assert reps[10].state == "ok"  # at the jump itself
    assert reps[11].pending_slope_per_s < 0  # and the trend is already the drain


@pytest.mark.parametrize("window", [10.0, 60.0, 120.0])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_burst_over_a_noisy_busy_queue_is_not_growing(window, seed):
    # Publisher 4+-3/s, workers up to 6/s, +-2 noise on pending; 40 extra jobs at tick 40.
    rng, q, an = random.Random(seed), FakeQueue(workers=8), LagAnalyzer(window, ACK_WAIT)
    samples = []
    for i in range(90):
        q.publish(4 + rng.randint(-3, 3) + (40 if i == 40 else 0))
        q.finish(6)
        samples.append(q.sample(float(i), rng.randint(-2, 2)))
    assert "g" not in states(feed(an, samples))


def test_reason_at_the_burst_does_not_claim_a_drain():
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    rep = feed(an, seed_burst(seed=1))[10]
    assert rep.state == "ok" and rep.reason == "38 waiting, 2 in flight, not draining"


def test_burst_caught_across_two_polls_is_one_step():
    q, an = FakeQueue(workers=2), LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    samples = []
    for i in range(40):
        if i in (10, 11):
            q.publish(20)
        elif i > 11:
            q.finish(4)
        samples.append(q.sample(float(i)))
    assert "g" not in states(feed(an, samples))


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_steady_publisher_reads_growing_then_ok_after_it_stops(seed):
    # +2/s net for 20 s (ticks 10..29) with +-2 noise, then the workers drain it.
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    line = states(feed(an, steady_climb(seed=seed, up=6, capacity=4)))
    first = line.index("g")
    assert first <= 29, line  # within the 20 s of climbing
    last = line.rindex("g")
    assert set(line[first:last + 1]) == {"g"}, line  # no flapping once it holds
    assert last <= 29 + 8, line  # ok within 8 s of the publisher stopping ...
    assert set(line[last + 1:]) == {"o"}, line  # ... and stays ok


@pytest.mark.parametrize("window", [10.0, 30.0, 120.0])
def test_steady_publisher_with_other_windows(window):
    an = LagAnalyzer(window=window, ack_wait=ACK_WAIT)
    line = states(feed(an, steady_climb(seed=9)))
    first, last = line.index("g"), line.rindex("g")
    assert first <= 29 and set(line[first:last + 1]) == {"g"} and last <= 37, line


def test_growing_reason_names_the_rise():
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    reps = feed(an, steady_climb(seed=1, noise=0))
    rep = next(r for r in reps if r.state == "growing")
    assert rep.reason.startswith("pending rose ") and " over " in rep.reason
    assert rep.reason.endswith("/s)") and "(+" in rep.reason
    assert rep.pending_slope_per_s > 0


@pytest.mark.parametrize("noise", [1, 2, 5])
def test_noise_around_a_flat_level_is_ok(noise):
    rng, an = random.Random(noise), LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    reps = feed(an, [mk(float(t), pending=50 + rng.randint(-noise, noise), ack_pending=2,
                        delivered=4 * t + 2, floor=4 * t) for t in range(2000)])
    assert set(states(reps)[1:]) == {"o"}


def test_plateau_after_a_rise_returns_to_ok_without_flapping():
    # Publisher drops back to exactly the workers' pace: pending stops rising but stays high.
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    line = states(feed(an, steady_climb(seed=4, pre=60, climb=80, after=120, up=5, down=4)))
    first, last = line.index("g"), line.rindex("g")
    assert set(line[first:last + 1]) == {"g"} and last < 140 + 15, line


def test_fast_steady_publisher_is_growing_not_a_series_of_bursts():
    q, an = FakeQueue(workers=4), LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    samples = []
    for i in range(30):
        q.publish(100)
        q.finish(4)
        samples.append(q.sample(float(i)))
    line = states(feed(an, samples))
    assert line.endswith("g" * 10), line


def test_batch_publisher_outpacing_the_workers_reads_growing():
    # 40 jobs every 10 s against 3/s: each batch alone is a burst, together they are a backlog.
    q, an = FakeQueue(workers=2), LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    samples = []
    for i in range(200):
        if i % 10 == 0 and i <= 110:
            q.publish(40)
        q.finish(3)
        samples.append(q.sample(float(i)))
    line = states(feed(an, samples))
    first, last = line.index("g"), line.rindex("g")
    assert first <= 60 and set(line[first:last + 1]) == {"g"}, line
    assert last <= 110 + 15 and set(line[last + 1:]) == {"o"}, line  # the batches stopped


def test_batch_publisher_the_workers_keep_up_with_is_ok():
    q, an = FakeQueue(workers=2), LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    samples = []
    for i in range(150):
        if i % 10 == 0:
            q.publish(40)
        q.finish(4)
        samples.append(q.sample(float(i)))
    assert "g" not in states(feed(an, samples))


def test_burst_on_top_of_a_climb_stays_growing():
    rng, q = random.Random(3), FakeQueue(workers=4)
    an, samples = LagAnalyzer(window=60, ack_wait=ACK_WAIT), []
    for i in range(60):
        q.publish(6 + (40 if i == 40 else 0))
        q.finish(4)
        samples.append(q.sample(float(i), rng.randint(-2, 2)))
    line = states(feed(an, samples))
    assert set(line[30:]) == {"g"}, line


def test_step_detection_helpers():
    ts = [float(t) for t in range(10)]
    burst = [0.0] * 5 + [38.0, 34.0, 30.0, 26.0, 22.0]
    jumps = step_jumps(ts, burst)
    assert latest_step(jumps) == range(5, 6)
    assert remove_latest_step(burst, jumps)[4:7] == [0.0, 0.0, pytest.approx(-4.0)]
    climb = [2.0 * t + d for t, d in zip(range(10), [0, 2, -2, 1, -1, 2, -2, 0, 1, -1])]
    assert latest_step(step_jumps(ts, climb)) == range(0)
    drained = [40.0, 32.0, 24.0, 16.0, 8.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # empty is not a burst
    assert latest_step(step_jumps(ts, drained)) == range(0)


# --- stuck ------------------------------------------------------------------------------------


def hung(t0, t1, pending=12, ack_pending=3, floor=100, local=50, alive=False, step=1.0):
    """Work waiting and in flight, acks frozen."""
    n = int((t1 - t0) / step) + 1
    return [mk(t0 + i * step, pending=pending, ack_pending=ack_pending, delivered=floor + 3,
               floor=floor, local=local, alive=alive) for i in range(n)]


def test_hung_workers_read_stuck_after_ack_wait():
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    reps = feed(an, hung(0.0, 34.0))
    assert reps[30].state == "ok"  # exactly AckWait: not longer than it yet
    assert reps[31].state == "stuck"
    assert reps[34].reason == "3 in flight, 12 waiting, nothing acked for 34 s (AckWait 30 s)"


def test_stuck_sees_further_back_than_a_short_window():
    an = LagAnalyzer(window=10, ack_wait=ACK_WAIT)
    reps = feed(an, hung(0.0, 40.0))
    assert states(reps) == "u" + "o" * 30 + "s" * 10
    assert len(an.samples) == 11


def test_waiting_jobs_with_no_worker_taking_them_is_stuck():
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    reps = feed(an, hung(0.0, 31.0, pending=5, ack_pending=0))
    assert reps[-1].state == "stuck"


def test_long_job_on_a_live_worker_is_not_stuck():
    # One 90 s job (3x AckWait), in-progress pings from a heart-beating worker: not stuck.
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    reps = feed(an, hung(0.0, 90.0, pending=0, ack_pending=1, alive=True))
    assert set(states(reps)[1:]) == {"o"}
    reps = feed(an, [mk(91.0, delivered=104, floor=104, local=51)])  # it finishes
    assert reps[-1].state == "ok" and reps[-1].eta_s == 0.0


def test_stall_clock_starts_when_the_live_worker_stops_progressing():
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    feed(an, hung(0.0, 60.0, pending=4, ack_pending=1, alive=True))
    reps = feed(an, hung(61.0, 92.0, pending=4, ack_pending=1, alive=False))
    # The worker's pings ended at 60.0: like the server's AckWait, ours counts from there.
    assert reps[29].state == "ok" and reps[30].state == "stuck"  # t=90 vs t=91


def test_pinned_ack_floor_with_our_acks_moving_is_not_stuck():
    # A crashed (or very slow) job pins the floor at 8 while the other worker keeps acking.
    an = LagAnalyzer(window=60, ack_wait=3.0)
    reps = feed(an, [mk(float(t), pending=40 - 2 * t, ack_pending=2, delivered=10 + 2 * t,
                        floor=8, local=8 + 2 * t) for t in range(15)])
    assert "s" not in states(reps)
    assert reps[-1].drain_rate_per_s == pytest.approx(2.0)


def test_no_work_is_not_stuck_and_the_clock_starts_with_the_work():
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    feed(an, [mk(float(t), delivered=10, floor=10) for t in range(100)])  # idle, floor flat
    reps = feed(an, hung(100.0, 131.0, pending=2, ack_pending=1, floor=10))
    assert reps[0].state == "ok" and reps[30].state == "ok" and reps[31].state == "stuck"


def test_stuck_takes_precedence_over_growing():
    rng, an = random.Random(5), LagAnalyzer(window=60, ack_wait=10.0)
    reps = feed(an, [mk(float(t), pending=10 + 2 * t + rng.randint(-2, 2), ack_pending=2,
                        delivered=2, floor=0) for t in range(40)])
    assert reps[25].state == "stuck" and reps[-1].state == "stuck"


def test_stuck_recovers_once_acks_move():
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    assert feed(an, hung(0.0, 35.0))[-1].state == "stuck"
    reps = feed(an, [mk(36.0, pending=11, ack_pending=3, delivered=104, floor=101, local=51),
                     mk(37.0, pending=10, ack_pending=3, delivered=105, floor=102, local=52)])
    assert states(reps) == "oo"


# --- drain rate and eta -----------------------------------------------------------------------


SEED_RUN = [  # the seed post's ticker: t, pending, ackPending, redelivered, delivered, ackFloor
    (1.0, 0, 0, 0, 0, 0), (2.0, 38, 2, 0, 2, 0), (3.0, 34, 2, 0, 6, 4),
    (4.0, 30, 2, 0, 10, 8), (5.0, 28, 2, 0, 12, 8), (6.0, 26, 2, 0, 14, 8),
    (7.0, 25, 1, 1, 16, 8), (8.0, 23, 1, 0, 18, 17),
    *[(8.0 + k, 23 - 2 * k, 1, 0, 18 + 2 * k, 17 + 2 * k) for k in range(1, 12)],  # "..."
    (20.0, 0, 0, 0, 41, 41),
]


def seed_run_samples():
    # Our own ack counter: everything finished except the crashed worker's job-09 until 8.0.
    for t, p, ap, rd, dl, fl in SEED_RUN:
        local = fl if t < 5.0 or t >= 8.0 else dl - ap - (2 if t < 7.0 else 1)
        yield Sample(t, p, ap, rd, dl, fl, local, False)


def test_seed_run_reads_ok_throughout_with_the_expected_rates():
    an = LagAnalyzer(window=60, ack_wait=3.0)
    reps = dict(zip([row[0] for row in SEED_RUN], feed(an, seed_run_samples())))
    assert {r.state for t, r in reps.items() if t > 1.0} == {"ok"}
    assert reps[4.0].drain_rate_per_s == pytest.approx(4.0)  # two workers, 0.5 s jobs
    assert reps[4.0].eta_s == pytest.approx(8.0)  # 32 left at -4/s
    assert reps[14.0].drain_rate_per_s == pytest.approx(2.0, abs=0.3)  # one worker left
    assert reps[20.0].eta_s == 0.0 and reps[20.0].reason == "queue empty"


def test_eta_two_seconds_into_a_seed_burst_is_within_30_percent():
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    samples = list(seed_burst(seed=7))
    rep = feed(an, samples[:13])[-1]  # burst lands at tick 10; tick 12 is 2 s into the drain
    remaining = samples[12].num_pending + samples[12].num_ack_pending
    true_eta = remaining / 4.0
    assert rep.eta_s == pytest.approx(true_eta, rel=0.30)
    assert rep.drain_rate_per_s == pytest.approx(4.0, rel=0.30)


def test_eta_converges_as_the_drain_goes_on():
    for seed in range(20):
        an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
        samples = list(seed_burst(seed=seed))
        rep = feed(an, samples[:16])[-1]  # 5 s into the drain
        remaining = samples[15].num_pending + samples[15].num_ack_pending
        assert rep.eta_s == pytest.approx(remaining / 4.0, rel=0.35), seed


def test_drain_rate_and_eta_skip_the_idle_time_before_the_burst():
    # Fitting across the step would blend 10 idle seconds into the rate.
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    reps = feed(an, seed_burst(seed=1, rate=4, ticks=14))
    assert reps[10].eta_s is None  # at the jump: nothing drained yet
    assert reps[13].drain_rate_per_s == pytest.approx(4.0, rel=0.3)


def test_eta_is_zero_when_empty_and_none_when_not_draining():
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    rep = feed(an, [mk(float(t), delivered=5, floor=5) for t in range(5)])[-1]
    assert (rep.eta_s, rep.drain_rate_per_s, rep.reason) == (0.0, 0.0, "queue empty")
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    rep = feed(an, [mk(float(t), pending=20 + t, ack_pending=2, delivered=2 + 4 * t, floor=4 * t)
                    for t in range(10)])[-1]
    assert rep.eta_s is None and rep.drain_rate_per_s == pytest.approx(4.0)
    assert rep.reason == "29 waiting, 2 in flight, finishing 4.0/s, not draining"


def test_drain_rate_keeps_counting_while_one_long_job_pins_the_floor():
    # delivered - ack_pending moves with every finished job; the floor waits for the long one.
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    rep = feed(an, [mk(float(t), pending=60 - 3 * t, ack_pending=2, delivered=2 + 3 * t,
                       floor=0, local=3 * t, alive=True) for t in range(15)])[-1]
    assert rep.state == "ok" and rep.drain_rate_per_s == pytest.approx(3.0)
    assert rep.eta_s == pytest.approx((60 - 42 + 2) / 3.0)


# --- state-change log and JSON ----------------------------------------------------------------


def test_transition_reports_each_change_once():
    an = LagAnalyzer(window=60, ack_wait=10.0)
    log = []
    for s in hung(0.0, 15.0):
        an.add(s)
        log.append(an.transition(s.t))
    assert log[0] is None  # still unknown: no change
    assert log[1] == ("unknown", "ok")
    assert log[11] == ("ok", "stuck")
    assert [x for x in log if x] == [("unknown", "ok"), ("ok", "stuck")]
    assert an.transition(15.0) is None
    assert an.transition(30.0) == ("stuck", "unknown")  # stale now


def test_as_dict_shape_and_rounding():
    rep = LagReport("growing", 1.23456, 3.98765, 9.54321, "why")
    assert rep.as_dict() == {"state": "growing", "pending_slope_per_s": 1.23,
                             "drain_rate_per_s": 3.99, "eta_s": 9.5, "reason": "why"}
    rep = LagReport("unknown", -0.0001, None, math.inf, "x")
    d = rep.as_dict()
    assert d["pending_slope_per_s"] == 0.0 and str(d["pending_slope_per_s"]) == "0.0"
    assert d["drain_rate_per_s"] is None and d["eta_s"] is None


def test_reports_are_deterministic():
    def run():
        an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
        return [r.as_dict() for r in feed(an, steady_climb(seed=2))]
    assert run() == run()


def test_a_paused_consumer_is_never_stuck_and_a_stall_after_it_counts_from_the_resume():
    """Work waits and nothing is acked for longer than AckWait while the consumer is paused on
    purpose (workers.Pause, `supervisor pause`): not stuck. Once it resumes, the stall clock
    starts again from there."""
    an = LagAnalyzer(window=60, ack_wait=ACK_WAIT)
    paused = [dataclasses.replace(s, paused=True) for s in hung(0.0, 40.0, pending=5, ack_pending=0)]
    reps = feed(an, paused)
    assert {r.state for r in reps[2:]} == {"ok"}
    after = feed(an, hung(41.0, 75.0, pending=5, ack_pending=0))
    assert after[29].state == "ok" and after[-1].state == "stuck"     # 30 s after the resume: AckWait
