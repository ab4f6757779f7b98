"""What [ordering] costs and how fast keys run side by side (issue 27): `python -m bench --only ordering`.

1. Speed: the same backlog of sleep jobs (`ordering_job_s` each, a handler that sleeps, so the
   workers' handlers are what limits) drained by N workers of one handler, unordered (the
   supervisor's defaults) and ordered per key (`[ordering] key = "subject:2"`) over K keys, for
   each N and K of the profile, in one run on one server. The jobs' keys are drawn at random
   (seeded: every variant drains the same subjects in the same order). Beside each figure: the
   bound, min(N, K) jobs at a time (one job of a key at a time), and the share of it reached.
2. Cost: the sync no-op at 2 workers, unordered and ordered over 64 keys: what asking the stream
   for each job's turn costs per job (no parallelism to win back there).

`sleep` is the handler of part 1; this module's top level stays light, since workers import it.
"""

from __future__ import annotations

import random
import time
from typing import Any

from workers import Job

ORDERED = {"ordering": {"key": "subject:2"}}
NOOP_KEYS = 64
NOOP_WORKERS = 2


def sleep(job: Job) -> None:
    time.sleep(float(job.data))


def subjects(keys: int, jobs: int) -> list[str]:
    rng = random.Random(27)
    return [f"jobs.k{rng.randrange(keys)}" for _ in range(jobs)] if keys else ["jobs.new"] * jobs


async def ordering_cost(ctx: Any) -> dict:
    from ..scenarios import fmt, measured_drain, rotated

    p = ctx.profile
    variants = [0, *p.ordering_keys]                          # 0: unordered
    data = f"{p.ordering_job_s:g}".encode()
    runs = []
    for rep in range(p.repeats):
        for n in p.ordering_workers:
            for keys in rotated(variants, rep):
                names = subjects(keys, p.ordering_jobs)
                r = await measured_drain(ctx, "supervisor-sync", n, p.ordering_jobs, data,
                                         handler="bench.costs.ordering:sleep", sections=ORDERED if keys else {},
                                         subject_of=names.__getitem__)
                r.extra.update(repeat=rep, keys=keys)
                runs.append(r.as_dict())
                ctx.say(f"  ordering rep {rep + 1} N={n} {'unordered' if not keys else f'{keys} keys':10s} "
                        f"{fmt(r.jobs_per_s, '.0f')} jobs/s")
    noop = await noop_cost(ctx)
    return {"jobs": p.ordering_jobs, "job_s": p.ordering_job_s, "runs": runs,
            "summary": speed_summary(runs, p.ordering_job_s), "noop": noop}


def speed_summary(runs: list[dict], job_s: float) -> list[dict]:
    """Per (N, K): median jobs/s, against unordered at N (same repeat) and against the bound
    min(N, K) / job_s."""
    from ..scenarios import median

    by = {(r["workers"], r["extra"]["keys"], r["extra"]["repeat"]): r["jobs_per_s"] for r in runs}
    out = []
    for n, keys in sorted({(w, k) for w, k, _ in by}):
        reps = sorted(rep for w, k, rep in by if (w, k) == (n, keys))
        mine = [by[(n, keys, rep)] for rep in reps]
        pairs = [(by[(n, keys, rep)], by.get((n, 0, rep))) for rep in reps]
        bound = (min(n, keys) if keys else n) / job_s
        out.append({"workers": n, "keys": keys, "repeats": len(mine), "jobs_per_s": median(mine),
                    "vs_unordered": median([a / b for a, b in pairs if a and b]),
                    "bound_per_s": round(bound, 1), "of_bound": median([a / bound for a in mine if a])})
    return out


async def noop_cost(ctx: Any) -> list[dict]:
    from ..scenarios import cost_row, fmt, measured_drain, rotated, without_runs

    p, runs = ctx.profile, []
    jobs = p.guard_jobs // 2
    for rep in range(p.repeats):
        for name in rotated(["unordered", f"{NOOP_KEYS} keys"], rep):
            keys = NOOP_KEYS if name != "unordered" else 0
            names = subjects(keys, jobs)
            r = await measured_drain(ctx, "supervisor-sync", NOOP_WORKERS, jobs, b"x",
                                     sections=ORDERED if keys else {}, subject_of=names.__getitem__)
            r.extra.update(repeat=rep, variant=name)
            runs.append(r.as_dict())
            ctx.say(f"  ordering no-op rep {rep + 1} N={NOOP_WORKERS} {name:10s} {fmt(r.jobs_per_s, '.0f')} jobs/s, "
                    f"{fmt(r.cpu_ms_per_1k_jobs, '.0f')} + server {fmt(r.server_cpu_ms_per_1k_jobs, '.0f')} "
                    "CPU ms/1k jobs")
    return [without_runs(cost_row(runs, name, "unordered", NOOP_WORKERS, "vs_unordered"))
            for name in ("unordered", f"{NOOP_KEYS} keys")]
