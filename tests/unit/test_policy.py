"""Unit tests for supervisor/core/policy.py: restart backoff, the boot-failure halt, recycling limits.

Pure code: no clock is read, every duration is passed in.
"""

from __future__ import annotations

import random

import pytest

from supervisor.core.policy import (
    HEALTHY_AFTER,
    STORM_WINDOW,
    BootFailures,
    DeathRate,
    RestartPolicy,
    SlotBackoff,
    ack_wait_for,
    did_useful_work,
    job_limit,
    nak_is_safe,
)

# ---------------------------------------------------------------- SlotBackoff

def loop_delays(backoff: SlotBackoff, n: int) -> list[float]:
    """Delays for n consecutive deaths that did no useful work."""
    return [backoff.after_death(useful=False) for _ in range(n)]


def test_crash_loop_backoff_starts_at_initial_and_doubles_up_to_the_cap():
    assert loop_delays(SlotBackoff(0.1, 1.0), 7) == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])


def test_backoff_cap_equal_to_initial_is_flat():
    assert loop_delays(SlotBackoff(2.0, 2.0), 4) == [2.0, 2.0, 2.0, 2.0]


def test_backoff_initial_zero_means_immediate_restart_forever():
    assert loop_delays(SlotBackoff(0.0, 30.0), 50) == [0.0] * 50


def test_a_death_after_useful_work_restarts_at_initial_and_resets_the_loop():
    b = SlotBackoff(0.5, 60.0)
    loop_delays(b, 5)
    assert b.after_death(useful=True) == 0.5 and b.failures == 0
    assert loop_delays(b, 2) == [0.5, 1.0]


def test_useful_deaths_never_grow_the_delay():
    b = SlotBackoff(0.1, 30.0)
    assert {b.after_death(useful=True) for _ in range(1000)} == {0.1}


@pytest.mark.parametrize("ready_for,jobs,useful", [
    (None, 0, False),                       # never ready: a boot failure
    (None, 5, False),                       # (jobs cannot be finished before ready; still not useful)
    (0.5, 0, False),                        # ready, died before finishing a job
    (HEALTHY_AFTER - 0.01, 0, False),
    (0.5, 1, True),                         # finished a job
    (HEALTHY_AFTER, 0, True),               # idle but up a while: not a loop
])
def test_did_useful_work(ready_for, jobs, useful):
    assert did_useful_work(ready_for, jobs) is useful


# ---------------------------------------------------------------- RestartPolicy on simulated lives

class Pool:
    """A fake pool: slots whose workers die at scripted moments, driven by a fake clock."""

    def __init__(self, workers=4, initial=0.1, maximum=30.0, halt=10):
        self.policy = RestartPolicy(initial, maximum, halt)
        self.workers, self.t = workers, 0.0
        self.down_until = {slot: 0.0 for slot in range(workers)}

    def death(self, slot, cause="signal SIGKILL", ready_for=None, jobs=0):
        delay = self.policy.died(self.t, slot, cause, ready_for, jobs)
        self.down_until[slot] = self.t + delay
        return delay

    def waiting_longer_than(self, seconds):
        return [s for s, until in self.down_until.items() if until - self.t > seconds + 1e-9]


def test_boot_crash_loop_backs_off_and_halts():
    pool = Pool(workers=2, initial=0.1, maximum=2.0, halt=6)
    delays = []
    for i in range(6):
        delays.append(pool.death(i % 2, "exit code 3: init hook failed"))
        pool.t += delays[-1]
    assert delays == pytest.approx([0.1, 0.1, 0.2, 0.2, 0.4, 0.4])    # each slot doubles on its own
    assert pool.policy.halted and "init hook failed" in pool.policy.boot.last_reason


def test_crash_after_n_jobs_restarts_at_once_every_time():
    """A handler with a rare native crash: each worker finishes jobs, then dies."""
    pool = Pool(workers=4)
    for i in range(200):
        pool.t += 0.25
        assert pool.death(i % 4, "signal SIGSEGV", ready_for=0.9, jobs=40) == 0.1
    assert not pool.policy.halted
    assert pool.waiting_longer_than(0.1) == []


def test_crash_storm_raises_the_alert_but_keeps_the_pool_up():
    """The issue-18 soak: a random worker SIGKILLed every 2-4 s while recycling every 20 jobs."""
    rng = random.Random(18)
    pool = Pool(workers=4)
    storms = []
    for _ in range(120):                                     # four minutes
        pool.t += rng.uniform(2, 4)
        pool.death(rng.randrange(4), "signal SIGKILL (perhaps out of memory?)", ready_for=rng.uniform(0.05, 4),
                   jobs=rng.randint(1, 20))
        assert pool.waiting_longer_than(0.1) == [], "no slot waits longer than backoff_initial"
        storms.append(pool.policy.rate.storm(pool.t, 4))
    assert all(storms[30:]), "15-30 deaths a minute is a storm"
    text = pool.policy.rate.describe(pool.t)
    assert "worker deaths in the last 60s" in text and "signal SIGKILL" in text and "perhaps" not in text
    assert pool.policy.rate.per_minute(pool.t) >= 15


def test_the_storm_clears_when_deaths_stop():
    pool = Pool(workers=2)
    for i in range(6):
        pool.t += 1
        pool.death(i % 2, ready_for=5, jobs=3)
    assert pool.policy.rate.storm(pool.t, 2)
    pool.t += STORM_WINDOW + 1
    assert not pool.policy.rate.storm(pool.t, 2) and pool.policy.rate.per_minute(pool.t) == 0


def test_storm_threshold_grows_with_the_pool():
    rate = DeathRate()
    for i in range(10):
        rate.died(float(i), "signal SIGKILL")
    assert rate.storm(10.0, workers=8) and not rate.storm(10.0, workers=16)


def test_recycling_mixed_with_crashes_never_slows_restarts():
    """Recycled workers exit cleanly and never reach the policy; crashes between recycles of
    short-lived workers (they finished jobs) still restart at once."""
    pool = Pool(workers=4)
    for i in range(100):
        pool.t += 0.5
        if i % 5 == 0:
            assert pool.death(i % 4, ready_for=0.3, jobs=7) == 0.1
    assert all(b.failures == 0 for b in pool.policy.slots.values())


def test_a_crash_loop_in_one_slot_does_not_slow_the_others():
    pool = Pool(workers=3, maximum=30.0, halt=100)
    for _ in range(8):
        pool.death(0, "exit code 70: worker crashed", ready_for=0.2, jobs=0)     # dies on its first job
    assert pool.death(1, ready_for=120.0, jobs=500) == 0.1
    assert pool.waiting_longer_than(0.1) == [0]
    assert not pool.policy.halted, "ready before dying: not a boot failure"


def test_a_hung_worker_killed_by_the_heartbeat():
    pool = Pool(workers=2, initial=0.1, maximum=30.0)
    # It served for a while, then hung: killed after heartbeat_timeout, restarted at once.
    assert pool.death(0, "killed: no heartbeat for 30.1s", ready_for=45.0, jobs=120) == 0.1
    # A worker that hangs on its very first job every time, ready for less than HEALTHY_AFTER: a loop.
    assert [pool.death(1, "killed: no heartbeat for 5.0s", ready_for=5.0, jobs=0) for _ in range(3)] == \
        pytest.approx([0.1, 0.2, 0.4])


def test_ready_resets_the_boot_count_and_reload_resets_the_slots():
    pool = Pool(workers=1, halt=3)
    pool.death(0, "exit code 3")
    pool.death(0, "exit code 3")
    pool.policy.ready()
    assert pool.policy.boot.count == 0
    pool.policy.configure(1.0, 4.0, 5)
    assert pool.policy.slots == {} and pool.policy.boot.limit == 5
    assert pool.death(0, "exit code 3") == 1.0


# ---------------------------------------------------------------- BootFailures

def test_boot_failures_halt_at_the_limit_not_before():
    boot = BootFailures(limit=3)
    for n in range(1, 3):
        boot.died_before_ready(f"death {n}")
        assert not boot.halted
    boot.died_before_ready("death 3")
    assert boot.halted
    assert boot.count == 3
    assert boot.last_reason == "death 3"


def test_boot_failures_must_be_consecutive():
    boot = BootFailures(limit=3)
    for _ in range(10):
        boot.died_before_ready("x")
        boot.died_before_ready("x")
        boot.worker_ready()            # any worker getting ready breaks the run
        assert not boot.halted
    assert boot.count == 0


def test_boot_failures_limit_one_halts_on_first_failure():
    boot = BootFailures(limit=1)
    assert not boot.halted
    boot.died_before_ready("ImportError")
    assert boot.halted


def test_boot_failures_recover_after_ready():
    boot = BootFailures(limit=2)
    boot.died_before_ready("a")
    boot.died_before_ready("b")
    assert boot.halted
    boot.worker_ready()
    assert not boot.halted


# ---------------------------------------------------------------- job_limit

@pytest.mark.parametrize("max_jobs", [0, -1, -100])
def test_job_limit_zero_or_negative_means_never(max_jobs):
    assert job_limit(max_jobs, 50, random.Random(1)) == 0


def test_job_limit_without_jitter_is_exact_and_draws_nothing():
    rng = random.Random(7)
    state = rng.getstate()
    assert job_limit(100, 0, rng) == 100
    assert rng.getstate() == state


def test_job_limit_jitter_is_inclusive_and_within_range():
    rng = random.Random(1234)
    seen = {job_limit(100, 5, rng) for _ in range(500)}
    assert seen == set(range(100, 106))


def test_job_limit_is_reproducible_with_a_seeded_rng():
    a = [job_limit(1000, 100, random.Random(42)) for _ in range(3)]
    assert len(set(a)) == 1
    rng1, rng2 = random.Random(9), random.Random(9)
    assert [job_limit(10, 3, rng1) for _ in range(20)] == [job_limit(10, 3, rng2) for _ in range(20)]


def test_job_limit_spreads_workers_started_together():
    rng = random.Random(3)
    limits = [job_limit(1000, 100, rng) for _ in range(16)]
    assert len(set(limits)) > 8


# ---------------------------------------------------------------- AckWait and the NAK guard

@pytest.mark.parametrize("backoff,delivery,expected", [
    ((), 1, 30.0), ((), 7, 30.0),
    ((2.0, 10.0, 60.0), 1, 2.0), ((2.0, 10.0, 60.0), 2, 10.0), ((2.0, 10.0, 60.0), 3, 60.0),
    ((2.0, 10.0, 60.0), 9, 60.0),
])
def test_ack_wait_for_follows_the_server(backoff, delivery, expected):
    assert ack_wait_for(30.0, backoff, delivery) == expected


@pytest.mark.parametrize("ack_wait,age,safe", [
    (30.0, 0.0, True), (30.0, 28.99, True), (30.0, 29.0, False), (30.0, 31.0, False),   # 1 s margin
    (2.0, 1.79, True), (2.0, 1.81, False),                                               # 10 % margin
])
def test_a_nak_near_the_end_of_ack_wait_is_not_sent(ack_wait, age, safe):
    assert nak_is_safe(100.0 + age, 100.0, ack_wait) is safe


def test_workers_that_cannot_reach_nats_during_an_outage_do_not_halt_the_supervisor():
    """While the supervisor itself cannot reach NATS, a replacement worker that cannot either is
    the outage, not a crash loop: it backs off like any boot death, and the halt never comes."""
    policy = RestartPolicy(initial=0.1, maximum=2.0, boot_failures_to_halt=3)
    delays = [policy.died(float(t), 0, "exit code 4: cannot reach NATS or bind the consumer", None, 0, nats_down=True)
              for t in range(20)]
    assert delays[:5] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6]) and max(delays) == 2.0
    assert not policy.halted and policy.boot.count == 0
    for t in range(3):             # the same death with NATS up is the worker's: it counts
        policy.died(30.0 + t, 0, "exit code 4: cannot reach NATS or bind the consumer", None, 0)
    assert policy.halted
