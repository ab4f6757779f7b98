"""How long jobs wait (issue 25): end-to-end latency at a paced rate, and fairness under a mixed load.

Both publish at a steady pace into a consumer every contender shares (reset before each run),
after the contender is up and pulling, and time every job from its publish to its handler's
start: the publisher writes the time into the job (`t:PUBLISHED:SECONDS`, on the system-wide
monotonic clock), and the handler (bench/handlers.py `timed`, called the same way by every
contender) appends when it started and ended to a file the bench reads afterwards.

- **latency**: `latency_rate` no-op jobs/s for `latency_s` on `latency_workers` workers, well
  under any contender's capacity: publish to handler start, p50 / p99 / max, beside the plain
  fetch(256) loop and the seed's fetch(1) loop (FastStream too when installed).
- **fairness**: at half load on `fair_workers` workers, `fair_rate` short jobs/s of
  `fair_short_s` (sleep) and one of `fair_long_s` every `fair_long_every` s: the short jobs'
  wait p50 / p99 / max, how many waited over 0.5 s, and how many waited behind a long job (their
  worker finished a long job while they waited, and started them after it: a job held in the
  buffer of a busy worker). The first `fair_warmup_s` are reported apart: a worker learns the
  spread of job times from the jobs it runs, and one that has not met a long job yet may buffer
  short jobs ahead of its first.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats

from . import procs
from .handlers import TIMES_ENV, read_times
from .natsenv import SUBJECT, QueueSpec, consumer_state, reset_queue
from .profile import Profile
from .scenarios import FASTSTREAM, Ctx, async_wait, drained, fmt, median, percentile, rotated, starter

# Ours with the handler that times jobs: sync in the handler threads, async on the worker's loop.
TIMED_HANDLERS = {"supervisor": "bench.handlers:ajob", "supervisor-sync": "bench.handlers:job",
                  "supervisor-batch1": "bench.handlers:job"}
# Per contender, the config sections beyond the defaults (ours only).
VARIANTS: dict[str, dict[str, Any]] = {"supervisor-batch1": {"workers": {"batch": 1}}}
LATENCY_CONTENDERS = ("supervisor-sync", "supervisor", "plain", "seed", FASTSTREAM)
FAIR_CONTENDERS = ("supervisor-sync", "supervisor-batch1", "plain", "seed")
LONG_WAIT = 0.5          # the fairness target: no short job waits longer than this


def schedule_latency(rate: int, seconds: float) -> list[tuple[float, float]]:
    """(offset s, job seconds): no-op jobs evenly spaced."""
    return [(k / rate, 0.0) for k in range(int(rate * seconds))]


def schedule_fairness(rate: int, short: float, long: float, every: float, seconds: float) -> list[tuple[float, float]]:
    """Short jobs evenly spaced, and a long one every `every` s, half a tick after a short one."""
    jobs = [(k / rate, short) for k in range(int(rate * seconds))]
    jobs += [(j * every + 0.5 / rate, long) for j in range(int(seconds / every))]
    return sorted(jobs)


async def paced(url: str, schedule: list[tuple[float, float]]) -> float:
    """Publish the schedule (core publishes into the stream), each job stamped with the moment
    it was published; returns how late the last one went out, in seconds."""
    nc = await nats.connect(url)
    t0 = time.monotonic()
    late = 0.0
    try:
        for offset, seconds in schedule:
            delay = t0 + offset - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            late = max(0.0, -delay)
            await nc.publish(SUBJECT, b"t:%.6f:%g" % (time.monotonic(), seconds))
        await nc.flush()
    finally:
        await nc.close()
    return late


async def pulling(ctx: Ctx, contender: procs.Contender, n: int) -> None:
    """Until the contender is up: ours ready, a baseline's n pull requests waiting at the server."""
    if isinstance(contender, procs.Supervisor):
        await asyncio.to_thread(contender.wait_ready, n)
    else:
        nc = await nats.connect(ctx.server.url)
        try:
            async def waiting() -> bool:
                if not contender.alive():
                    raise RuntimeError(f"{contender.name} exited early\n{contender.log_tail()}")
                return (await consumer_state(nc.jetstream())).num_waiting >= n
            await async_wait(waiting, 60, f"{contender.name}: {n} pull requests waiting", 0.02)
        finally:
            await nc.close()
    await asyncio.sleep(ctx.profile.settle_s)


async def timed_run(ctx: Ctx, name: str, n: int, schedule: list[tuple[float, float]]) -> dict:
    """One contender through one schedule: every job's (published, started, ended, pid, seconds)."""
    await reset_queue(ctx.server.url, QueueSpec())
    rundir = ctx.rundir(f"{name}-timed")
    times = rundir / "times.txt"
    contender = starter(ctx, name, n, rundir, handler=TIMED_HANDLERS.get(name), sections=VARIANTS.get(name),
                        env={TIMES_ENV: str(times)})()
    try:
        await pulling(ctx, contender, n)
        late = await paced(ctx.server.url, schedule)
        longest = max((s for _, s in schedule), default=0.0)
        nc = await nats.connect(ctx.server.url)
        try:
            await async_wait(lambda: drained(nc.jetstream()), 60 + 10 * longest, f"{name}: every timed job acked", 0.02)
        finally:
            await nc.close()
    finally:
        contender.stop()
    rows = read_times(str(times))
    return {"contender": name, "workers": n, "jobs": len(schedule), "timed": len(rows), "publisher_late_s": late,
            "rows": rows}


# ================================================================ latency

def contenders(p: Profile, names: tuple[str, ...]) -> list[str]:
    """All of them, or (the smoke run) the first and the plain loop; FastStream when installed."""
    chosen = names if p.waits_all else (names[0], "plain")
    return [c for c in chosen if c != FASTSTREAM or (p.with_faststream and procs.faststream_available())]


async def latency(ctx: Ctx) -> dict:
    p = ctx.profile
    names = contenders(p, LATENCY_CONTENDERS)
    schedule = schedule_latency(p.latency_rate, p.latency_s)
    runs = []
    for rep in range(p.repeats):
        for name in rotated(names, rep):
            run = await timed_run(ctx, name, p.latency_workers, schedule)
            waits = [started - published for published, started, _, _, _ in run.pop("rows")]
            run.update(repeat=rep, p50_s=percentile(waits, 0.5), p99_s=percentile(waits, 0.99),
                       max_s=max(waits, default=None))
            runs.append(run)
            ctx.say(f"  latency rep {rep + 1} N={p.latency_workers} {name:17s} p50 {ms(run['p50_s'])} "
                    f"p99 {ms(run['p99_s'])} max {ms(run['max_s'])} ({run['timed']} of {run['jobs']} jobs timed)")
    return {"rate": p.latency_rate, "load_s": p.latency_s, "workers": p.latency_workers, "contenders": names,
            "runs": runs, "summary": summarize_latency(runs)}


def summarize_latency(runs: list[dict]) -> list[dict]:
    """Per contender: the median over repeats of p50 / p99 / max, and p99 against the plain
    loop's of the same repeat."""
    rows = []
    for name in dict.fromkeys(r["contender"] for r in runs):
        mine = {r["repeat"]: r for r in runs if r["contender"] == name}
        plain = {r["repeat"]: r for r in runs if r["contender"] == "plain"}
        rows.append({"contender": name, "repeats": len(mine), "jobs": median([r["timed"] for r in mine.values()]),
                     **{k: median([r[k] for r in mine.values()]) for k in ("p50_s", "p99_s", "max_s")},
                     "p99_vs_plain": median([mine[k]["p99_s"] / plain[k]["p99_s"] for k in mine
                                             if k in plain and mine[k]["p99_s"] and plain[k]["p99_s"]])})
    return rows


# ================================================================ fairness

async def fairness(ctx: Ctx) -> dict:
    p = ctx.profile
    schedule = schedule_fairness(p.fair_rate, p.fair_short_s, p.fair_long_s, p.fair_long_every, p.fair_s)
    runs = []
    for name in contenders(p, FAIR_CONTENDERS):  # one repeat: each run is a minute of steady load
        run = await timed_run(ctx, name, p.fair_workers, schedule)
        run.update(judge_fairness(run.pop("rows"), p.fair_short_s, p.fair_warmup_s), repeat=0)
        runs.append(run)
        m = run["measured"]
        ctx.say(f"  fairness N={p.fair_workers} {name:17s} short jobs' wait p50 {ms(m['p50_s'])} p99 {ms(m['p99_s'])} "
                f"max {ms(m['max_s'])}; {m['over_limit']} over {LONG_WAIT:g} s, {m['behind_long']} behind a long job "
                f"(warm-up: {run['warmup']['behind_long']} behind, max {ms(run['warmup']['max_s'])})")
    return {"workers": p.fair_workers, "rate": p.fair_rate, "contenders": [r["contender"] for r in runs],
            "short_s": p.fair_short_s, "long_s": p.fair_long_s,
            "long_every": p.fair_long_every, "load_s": p.fair_s, "warmup_s": p.fair_warmup_s,
            "runs": runs, "summary": summarize_fairness(runs)}


def judge_fairness(rows: list[tuple[float, float, float, int, float]], short: float, warmup: float) -> dict:
    """The short jobs' waits, after the warm-up and during it. A short job waited behind a long
    one when its worker ended a long job while it waited and started it after: it sat in that
    worker's buffer (with one handler per worker, jobs of a process run one after the other)."""
    if not rows:
        return {"measured": wait_figures([], []), "warmup": wait_figures([], [])}
    t0 = min(published for published, *_ in rows)
    long_ends: dict[int, list[float]] = {}
    for _, _, ended, pid, seconds in rows:
        if seconds > short:
            long_ends.setdefault(pid, []).append(ended)
    parts: dict[str, tuple[list[float], list[float]]] = {"measured": ([], []), "warmup": ([], [])}
    for published, started, _, pid, seconds in rows:
        if seconds != short:
            continue
        waits, behind = parts["warmup" if published - t0 < warmup else "measured"]
        waits.append(started - published)
        if any(published < end <= started for end in long_ends.get(pid, ())):
            behind.append(started - published)
    return {part: wait_figures(*lists) for part, lists in parts.items()}


def wait_figures(waits: list[float], behind: list[float]) -> dict:
    return {"jobs": len(waits), "p50_s": percentile(waits, 0.5), "p99_s": percentile(waits, 0.99),
            "max_s": max(waits, default=None), "over_limit": sum(1 for w in waits if w > LONG_WAIT),
            "behind_long": len(behind), "behind_long_max_s": max(behind, default=None)}


def summarize_fairness(runs: list[dict]) -> list[dict]:
    return [{"contender": r["contender"], **{f"warmup_{k}": v for k, v in r["warmup"].items()}, **r["measured"]}
            for r in runs]


def resummarize(results: dict) -> dict:
    """Recompute this module's summaries from the raw runs of a saved results.json."""
    if "latency" in results:
        results["latency"]["summary"] = summarize_latency(results["latency"]["runs"])
    if "fairness" in results:
        results["fairness"]["summary"] = summarize_fairness(results["fairness"]["runs"])
    return results


def ms(seconds: float | None) -> str:
    return fmt(None if seconds is None else 1000 * seconds, ".1f") + " ms"
