"""How big each scenario is: the full run (default), --quick, and the test suite's smoke run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    repeats: int
    # 1. throughput (no-op handler): with every key at its default, then tuned
    jobs: int
    workers: tuple[int, ...]
    tuned_workers: tuple[int, ...]
    # 2. CPU-bound
    cpu_jobs: int
    cpu_job_s: float
    cpu_workers: tuple[int, ...]
    # 3. crash recovery
    kills: int
    ack_wait: float
    # 4. footprint
    paced_rate: int          # jobs/s offered while the parent's CPU is measured
    paced_s: float
    idle_workers: int
    many_workers: int
    # 5. the seed experiment: seed_jobs jobs of seed_job_s on 3 workers, defaults
    seed_jobs: int = 30
    seed_job_s: float = 0.2
    # 6. `supervisor publish` against a plain publish_async loop
    publish_count: int = 50_000
    settle_s: float = 1.0     # after workers report ready, before memory is read
    idle_s: float = 3.0       # how long idle CPU is measured
    with_faststream: bool = True
    # 5. the [idempotency] guard's cost (sync no-op, with and without the guard)
    guard_jobs: int = 20_000
    guard_workers: int = 2
    # 9. latency: publish to handler start at a paced rate well under capacity
    latency_rate: int = 1_000
    latency_s: float = 10.0
    latency_workers: int = 2
    # 10. fairness at half load: fair_rate short jobs/s of fair_short_s, one of fair_long_s every
    # fair_long_every s, on fair_workers workers; the first fair_warmup_s reported apart
    fair_workers: int = 4
    fair_rate: int = 100
    fair_short_s: float = 0.01
    fair_long_s: float = 2.0
    fair_long_every: float = 2.0
    fair_s: float = 60.0
    fair_warmup_s: float = 10.0
    # 9 and 10: only the first contender of each and the plain loop (the smoke run), or all
    waits_all: bool = True
    # 11. [tracing]'s cost (no-op, sync and async, tracing off and on)
    tracing_jobs: int = 20_000
    tracing_workers: int = 2
    # 13. [ordering]: ordering_jobs sleep jobs of ordering_job_s over each count of keys, on each
    # count of workers, beside the same jobs unordered; and the no-op's cost at 2 workers
    ordering_jobs: int = 2_000
    ordering_job_s: float = 0.005
    ordering_workers: tuple[int, ...] = (1, 2, 4)
    ordering_keys: tuple[int, ...] = (1, 4, 16, 64)


PROFILES = {
    "full": Profile("full", repeats=3, jobs=50_000, workers=(1, 2, 4, 8), tuned_workers=(1, 2, 4, 8), cpu_jobs=2_000,
                    cpu_job_s=0.003, cpu_workers=(1, 2, 4), kills=20, ack_wait=30.0, paced_rate=10_000,
                    paced_s=15.0, idle_workers=4, many_workers=64, idle_s=5.0),
    "quick": Profile("quick", repeats=1, jobs=20_000, workers=(1, 2, 8), tuned_workers=(2, 8), cpu_jobs=800,
                     cpu_job_s=0.003, cpu_workers=(1, 2), kills=5, ack_wait=30.0, paced_rate=10_000, paced_s=6.0,
                     idle_workers=4, many_workers=64, publish_count=20_000, latency_s=5.0, fair_s=30.0,
                     ordering_jobs=1_000, ordering_workers=(2, 4), ordering_keys=(1, 16, 64)),
    # The test suite's: every code path, tiny counts, a short AckWait; figures are not meaningful.
    "smoke": Profile("smoke", repeats=1, jobs=400, workers=(1,), tuned_workers=(1,), cpu_jobs=40, cpu_job_s=0.001,
                     cpu_workers=(1, 2), kills=2, ack_wait=2.0, paced_rate=500, paced_s=1.5,
                     idle_workers=2, many_workers=4, seed_jobs=6, seed_job_s=0.05, publish_count=500,
                     settle_s=0.2, idle_s=0.5, with_faststream=False, guard_jobs=400, latency_rate=200,
                     latency_s=1.0, fair_rate=50, fair_long_s=0.5, fair_long_every=1.0, fair_s=2.0,
                     fair_warmup_s=0.5, waits_all=False, tracing_jobs=400, ordering_jobs=60, ordering_workers=(1,),
                     ordering_keys=(4,)),
}
