"""What a [limits.NAME] costs and how well it holds (issue 26): `python -m bench --only limits`.

1. Cost: the sync no-op drained by 2 workers with no limit, with a concurrency limit it never
   reaches (every job takes a slot and gives it back: two KV writes, a purge and a word on core
   NATS), and with a rate it never reaches (one KV write per job). Against "no limit" of the same
   repeat: the ratio and the extra wall time per job.
2. Holding: `rate = 10` over 30 s and more (300 jobs; the smoke profile's are far fewer) by two
   workers of 4 handlers each: every start taken, by the server's timestamp of its key
   (`watch_starts`), and every start journalled by the handler (`stamp`): the most starts in any
   one-second window each way, and the rate achieved.

`stamp` is the handler of part 2; this module's top level stays light, since workers import it.
"""

from __future__ import annotations

import os
import time
from typing import Any

from workers import Job

JOURNAL_ENV = "BENCH_LIMITS_JOURNAL"
EVERYTHING = [">"]
VARIANTS: dict[str, dict[str, Any]] = {
    "no limit": {},
    "concurrency 100000": {"limits": {"bench": {"concurrency": 100_000, "subjects": EVERYTHING}}},
    "rate 100000/s": {"limits": {"bench": {"rate": 100_000.0, "subjects": EVERYTHING}}},
}
RATE = 10.0
RATE_JOBS = {"full": 300, "quick": 300, "smoke": 30}


def stamp(job: Job) -> None:
    """Journal the wall time of each start (one O_APPEND write a line)."""
    fd = os.open(os.environ[JOURNAL_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{time.time():.6f}\n".encode())
    finally:
        os.close(fd)


def most_in_window(times: list[float], window: float) -> int:
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] >= window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


async def limit_cost(ctx: Any) -> dict:
    from ..scenarios import cost_row, drop_stream, fmt, measured_drain, rotated, without_runs

    p, workers = ctx.profile, 2
    runs = []
    for rep in range(p.repeats):
        for name in rotated(list(VARIANTS), rep):
            await drop_stream(ctx.server.url, "KV_SUPERVISOR_LIMITS")
            r = await measured_drain(ctx, "supervisor-sync", workers, p.guard_jobs, b"x", sections=VARIANTS[name])
            r.extra.update(repeat=rep, variant=name)
            runs.append(r.as_dict())
            ctx.say(f"  limits rep {rep + 1} N={workers} {name:20s} {fmt(r.jobs_per_s, '.0f')} jobs/s, "
                    f"{fmt(r.cpu_ms_per_1k_jobs, '.0f')} + server {fmt(r.server_cpu_ms_per_1k_jobs, '.0f')} CPU ms/1k jobs")
    summary = [without_runs(cost_row(runs, name, "no limit", workers, "vs_no_limit")) for name in VARIANTS]
    return {"jobs": p.guard_jobs, "workers": workers, "runs": runs, "summary": summary,
            "rate": await rate_holds(ctx)}


async def rate_holds(ctx: Any) -> dict:
    from .. import procs
    from ..measure import drain
    from ..scenarios import drop_stream, ours_config

    n, jobs = 2, RATE_JOBS.get(ctx.profile.name, 300)
    await drop_stream(ctx.server.url, "KV_SUPERVISOR_LIMITS")
    limits = {"bench": {"rate": RATE, "subjects": EVERYTHING}}
    writes, watching = await watch_starts(ctx.server.url, limits)
    rundir = ctx.rundir("limits-rate")
    journal = rundir / "starts"
    config = ours_config(ctx, n, "bench.costs.limits:stamp", workers={"concurrency": 4}, limits=limits)
    try:
        result, contender = await drain(
            ctx.server.url, jobs, lambda: procs.start_supervisor("supervisor-sync", config, rundir,
                                                                 ctx.product_env(**{JOURNAL_ENV: str(journal)})),
            data=b"x", server_pid=ctx.server.proc.pid, parent_pid=lambda c: c.pid)
        contender.stop()
    finally:
        await watching.close()
    starts = sorted(float(line) for line in journal.read_text().split())
    span = starts[-1] - starts[0] if len(starts) > 1 else 0.0
    taken = sorted(writes)
    out = {"rate": RATE, "jobs": jobs, "starts": len(starts), "span_s": round(span, 2),
           "achieved_per_s": round((len(starts) - 1) / span, 2) if span else None,
           "most_in_1s": most_in_window(starts, 1.0), "most_in_0.95s": most_in_window(starts, 0.95),
           "taken": len(taken), "most_taken_in_1s": most_in_window(taken, 1.0), "jobs_per_s": result.jobs_per_s}
    ctx.say(f"  rate {RATE:g}/s: {len(starts)} starts over {span:.1f} s ({out['achieved_per_s']}/s); at most "
            f"{out['most_in_1s']} in any 1 s ({out['most_in_0.95s']} in any 0.95 s) by the handlers' stamps; "
            f"{len(taken)} starts taken, at most {out['most_taken_in_1s']} in any 1 s by the server's clock")
    return out


async def watch_starts(url: str, limits: dict) -> tuple[list[float], Any]:
    """The limits bucket made now (as `supervisor start` makes it), and the server's timestamp of
    every start key written to it from now on (an ordered consumer: each is seen before its
    window's TTL removes it). The bound the rate keeps is on these, by the server's clock; a
    handler's stamp comes a few ms after its take (its queue, a thread), more on a loaded box.
    (The connection to close, as the second item.)"""
    import nats
    from nats.js.api import DeliverPolicy

    from supervisor.config import Config
    from supervisor.nats.provision import ensure_limits_bucket

    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_limits_bucket(js, Config().replace(limits=limits))
    stamps: list[float] = []

    async def seen(msg: Any) -> None:
        stamps.append(msg.metadata.timestamp.timestamp())
    await js.subscribe("$KV.SUPERVISOR_LIMITS.bench.r.*", cb=seen, ordered_consumer=True,
                       deliver_policy=DeliverPolicy.NEW)
    return stamps, nc
