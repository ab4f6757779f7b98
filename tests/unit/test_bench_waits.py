"""The verdicts of the bench's latency and fairness scenarios (bench/waits.py), on made-up times."""

from __future__ import annotations

from bench.waits import judge_fairness, schedule_fairness


def test_a_short_job_behind_a_long_one_is_told_apart():
    """The fairness verdict on made-up times: a short job published while its worker ran a long
    one and started after it waited behind it; one taken by another worker did not."""
    rows = [(0.0, 0.0, 2.0, 1, 2.0),          # the long job, worker 1
            (0.5, 2.0, 2.01, 1, 0.01),        # waited in worker 1's buffer: behind the long job
            (0.5, 0.501, 0.511, 2, 0.01),     # went to worker 2 at once
            (3.0, 3.001, 3.011, 1, 0.01)]     # after the long job ended: not behind it
    verdict = judge_fairness(rows, short=0.01, warmup=0.0)["measured"]
    assert verdict["jobs"] == 3 and verdict["behind_long"] == 1 and verdict["over_limit"] == 1
    assert verdict["max_s"] == 1.5 and verdict["behind_long_max_s"] == 1.5


def test_the_fairness_schedule_is_short_jobs_at_the_rate_and_a_long_one_every_period():
    jobs = schedule_fairness(rate=100, short=0.01, long=2.0, every=2.0, seconds=10.0)
    assert sum(1 for _, s in jobs if s == 0.01) == 1000 and sum(1 for _, s in jobs if s == 2.0) == 5
    assert [t for t, _ in jobs] == sorted(t for t, _ in jobs)
    assert [round(t, 3) for t, s in jobs if s == 2.0] == [0.005, 2.005, 4.005, 6.005, 8.005]
