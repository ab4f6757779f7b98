"""Unit tests for supervisor/policy.py: restart backoff, the boot-failure halt, recycling limits.

Pure code: no clock is read, every duration is passed in.
"""

from __future__ import annotations

import random

import pytest

from supervisor.policy import HEALTHY_AFTER, BootFailures, SlotBackoff, job_limit


# ---------------------------------------------------------------- SlotBackoff

def delays(backoff: SlotBackoff, n: int) -> list[float]:
    return [backoff.next_delay() for _ in range(n)]


def test_backoff_starts_at_initial_and_doubles_up_to_the_cap():
    assert delays(SlotBackoff(0.1, 1.0), 7) == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])


def test_backoff_cap_equal_to_initial_is_flat():
    assert delays(SlotBackoff(2.0, 2.0), 4) == [2.0, 2.0, 2.0, 2.0]


def test_backoff_initial_zero_means_immediate_restart_forever():
    assert delays(SlotBackoff(0.0, 30.0), 50) == [0.0] * 50


def test_backoff_counts_failures():
    b = SlotBackoff(1.0, 8.0)
    delays(b, 3)
    assert b.failures == 3


@pytest.mark.parametrize("ready_for", [HEALTHY_AFTER, HEALTHY_AFTER + 0.001, 3600.0])
def test_backoff_resets_after_a_healthy_run(ready_for):
    b = SlotBackoff(0.5, 60.0)
    delays(b, 5)
    b.worker_exited(ready_for)
    assert b.failures == 0
    assert b.next_delay() == 0.5


@pytest.mark.parametrize("ready_for", [None, 0.0, HEALTHY_AFTER - 0.001])
def test_backoff_keeps_growing_when_the_worker_was_not_healthy_long_enough(ready_for):
    b = SlotBackoff(0.5, 60.0)
    delays(b, 3)                       # 0.5, 1, 2
    b.worker_exited(ready_for)         # never ready, or ready too briefly
    assert b.next_delay() == 4.0


def test_backoff_sequence_across_a_realistic_life():
    """crash, crash, healthy for a minute, crash: the third restart is quick again."""
    b = SlotBackoff(0.1, 30.0)
    out = []
    for ready_for in (None, 2.0, 60.0, None):
        b.worker_exited(ready_for)
        out.append(b.next_delay())
    assert out == pytest.approx([0.1, 0.2, 0.1, 0.2])


def test_backoff_survives_a_very_long_crash_loop():
    # A worker that gets ready and dies within HEALTHY_AFTER never resets its slot's backoff and
    # never trips the boot-failure halt; at backoff_max=30 s this is ~8.5 hours of crash loop.
    b = SlotBackoff(0.1, 30.0)
    for _ in range(1100):
        b.worker_exited(1.0)
        assert b.next_delay() <= 30.0


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
