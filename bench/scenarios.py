"""The scenarios of issues 6 and 11, and the [idempotency] guard's cost (issue 10). Each returns
{"runs": [...raw figures...], "summary": {...}}.

Fairness rules applied everywhere: one nats-server for the whole run; every contender binds to
the same durable pull consumer, reset before each drain with the backlog already published;
progress is read from ConsumerInfo for all alike; contender order rotates between repeats;
ratios are taken between figures of the same repeat, then the median is reported.

Everything runs with the supervisor's defaults first (every key at its default but the server,
the worker count and the handler; the consumer with `supervisor start`'s default settings, for
every contender alike); the tuned variants come last, in their own scenario ("tuned").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import psutil

from . import procs
from .handlers import CPU_PREFIX, HOLD, JOURNAL_ENV, calibrate, read_journal
from .measure import DrainResult, busy_seconds, drain
from .natsenv import (
    REPO,
    STREAM,
    SUBJECT,
    NatsServer,
    Progress,
    QueueSpec,
    child_env,
    consumer_state,
    publish,
    reset_queue,
    wait_until,
)
from .observer import Observer
from .profile import Profile

# Our two no-op flavours: the same job, an async handler (on the worker's loop, like the plain
# loop's inline call) and a sync one (in the worker's handler threads, SPEC's `def handle`).
OURS = {"supervisor": "bench.handlers:anoop", "supervisor-sync": "workers.examples:noop"}
BASELINES = ("plain", "seed", "faststream")
PLAIN = "plain"
FASTSTREAM = "faststream"

# The two configurations. DEFAULTS: a consumer as `supervisor start` creates it (max_ack_pending
# 1,000, shared by all workers) and no supervisor key set. TUNED: max_ack_pending out of the way
# and a higher workers.batch ceiling. The baselines fetch up to BATCH, and within their share of
# max_ack_pending (a fetch(256) per loop at N = 8 would ask for 2,048 of 1,000 and stall 1 s
# per fetch, which is no fair yardstick).
DEFAULTS, TUNED = "defaults", "tuned"
QUEUES = {DEFAULTS: QueueSpec(), TUNED: QueueSpec(max_ack_pending=100_000)}
TUNING = {DEFAULTS: {}, TUNED: {"consumer": QUEUES[TUNED].config(), "workers": {"batch": 1024}}}
BATCH = 256


def baseline_batch(section: str, n: int) -> int:
    return max(1, min(BATCH, QUEUES[section].max_ack_pending // n))


@dataclass
class Ctx:
    server: NatsServer
    workdir: Path
    profile: Profile
    say: Callable[[str], None]
    cores: int
    product: Path | None = None      # --product: run `supervisor` from this source tree instead
    _n: int = 0

    def rundir(self, name: str) -> Path:
        self._n += 1
        path = self.workdir / f"{self._n:03d}-{name}"
        path.mkdir(parents=True)
        return path

    def product_env(self, **extra: str) -> dict[str, str]:
        """The environment of our processes: the product tree first on the path (--product)."""
        if self.product is None:
            return extra
        return {"PYTHONPATH": os.pathsep.join([str(self.product), str(REPO)]), **extra}


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def rotated(names: list[str], k: int) -> list[str]:
    k %= len(names)
    return names[k:] + names[:k]


def ours_config(ctx: Ctx, n: int, handler: str, section: str = DEFAULTS, **sections: dict[str, Any]) -> dict:
    """`supervisor start`'s config for `section`, plus `sections` (e.g. the crash scenario's restart keys)."""
    merged = {k: dict(v) for k, v in TUNING[section].items()}
    for name, keys in sections.items():
        merged.setdefault(name, {}).update(keys)
    return procs.supervisor_config(ctx.server.url, n, handler, **merged)


def starter(ctx: Ctx, name: str, n: int, rundir: Path, section: str = DEFAULTS, handler: str | None = None,
            batch: int | None = None, sections: dict | None = None,
            env: dict[str, str] | None = None) -> Callable[[], procs.Contender]:
    url = ctx.server.url
    batch = batch or baseline_batch(section, n)
    if name in ("plain", "seed"):
        return lambda: procs.start_loops(name, n, url, rundir, batch, env)
    if name == FASTSTREAM:
        return lambda: procs.start_faststream(n, url, rundir, batch, env)
    config = ours_config(ctx, n, handler or OURS[name], section, **(sections or {}))
    return lambda: procs.start_supervisor(name, config, rundir, ctx.product_env(**(env or {})))


async def measured_drain(ctx: Ctx, name: str, n: int, total: int, data: bytes, section: str = DEFAULTS,
                         handler: str | None = None, batch: int | None = None,
                         sections: dict | None = None, subject_of: Callable[[int], str] | None = None) -> DrainResult:
    start = starter(ctx, name, n, ctx.rundir(f"{name}-{n}"), section, handler, batch, sections)
    result, contender = await drain(ctx.server.url, total, start, data=data, spec=QUEUES[section],
                                    server_pid=ctx.server.proc.pid,
                                    parent_pid=lambda c: c.pid if isinstance(c, procs.Supervisor) else None,
                                    subject_of=subject_of)
    contender.stop()
    result.contender, result.workers = name, n
    return result


# ================================================================ 1. throughput (defaults), and tuned

def throughput_contenders(profile: Profile, section: str = DEFAULTS) -> list[str]:
    names = [*OURS, *BASELINES] if section == DEFAULTS else [*OURS, PLAIN]
    if FASTSTREAM in names and not (profile.with_faststream and procs.faststream_available()):
        names.remove(FASTSTREAM)
    return names


async def throughput(ctx: Ctx, section: str = DEFAULTS) -> dict:
    p = ctx.profile
    names = throughput_contenders(p, section)
    ns = p.workers if section == DEFAULTS else p.tuned_workers
    runs = []
    for rep in range(p.repeats):
        for n in ns:
            for name in rotated(names, rep + n):
                r = await measured_drain(ctx, name, n, p.jobs, b"x", section)
                r.extra.update(repeat=rep, section=section)
                if name not in OURS:
                    r.extra["fetch"] = 1 if name == "seed" else baseline_batch(section, n)
                runs.append(r.as_dict())
                ctx.say(f"  {section} rep {rep + 1} N={n} {name:16s} {fmt(r.jobs_per_s, '.0f')} jobs/s, "
                        f"first ack {fmt(r.first_ack_s, '.2f')} s")
    return {"section": section, "contenders": names, "jobs": p.jobs, "queue": QUEUES[section].__dict__,
            "tuning": TUNING[section], "runs": runs, "summary": summarize_throughput(runs, names, ns)}


async def tuned(ctx: Ctx) -> dict:
    return await throughput(ctx, TUNED)


def summarize_throughput(runs: list[dict], names: list[str], ns: tuple[int, ...]) -> list[dict]:
    by = {(r["contender"], r["workers"], r["extra"]["repeat"]): r for r in runs}
    repeats = sorted({r["extra"]["repeat"] for r in runs})
    rows = []
    for n in ns:
        for name in names:
            mine = [by.get((name, n, k)) for k in repeats]
            mine = [r for r in mine if r]

            def ratio(other: str) -> float | None:
                vals = []
                for k in repeats:
                    a, b = by.get((name, n, k)), by.get((other, n, k))
                    if a and b and a["jobs_per_s"] and b["jobs_per_s"]:
                        vals.append(a["jobs_per_s"] / b["jobs_per_s"])
                return median(vals)

            rows.append({"contender": name, "workers": n, "repeats": len(mine),
                         "jobs_per_s": median([r["jobs_per_s"] for r in mine]),
                         "jobs_per_s_all": [r["jobs_per_s"] for r in mine],
                         "first_ack_s": median([r["first_ack_s"] for r in mine]),
                         "cpu_ms_per_1k_jobs": median([r["cpu_ms_per_1k_jobs"] for r in mine]),
                         "server_cpu_ms_per_1k_jobs": median([r["server_cpu_ms_per_1k_jobs"] for r in mine]),
                         "writes_per_1k_jobs": median([r.get("writes_per_1k_jobs") for r in mine]),
                         "switches_per_1k_jobs": median([r.get("switches_per_1k_jobs") for r in mine]),
                         "background_cpu_pct": median([r["background_cpu_pct"] for r in mine]),
                         "fetch": mine[0]["extra"].get("fetch") if mine else None,
                         "vs_plain": ratio(PLAIN) if name != PLAIN else 1.0,
                         "vs_faststream": ratio(FASTSTREAM) if FASTSTREAM in names else None})
    return rows


# ================================================================ 2. CPU-bound scaling

CPU_CONTENDERS = ("supervisor-sync", "plain", "bare")
# The plain loop acks a fetched batch only when its loop next yields, i.e. after the whole batch:
# with 256 jobs of a few ms that is one ack burst per second, too coarse to time. It fetches 16;
# the supervisor runs with its defaults (it sizes its own pulls).
CPU_BATCH = 16


async def cpu_bound(ctx: Ctx) -> dict:
    p = ctx.profile
    rounds = calibrate(p.cpu_job_s)
    data = CPU_PREFIX + str(rounds).encode()
    ctx.say(f"  cpu: {rounds} rounds of spin() per job ~ {1000 * p.cpu_job_s:g} ms on one core")
    runs = []
    for rep in range(p.repeats):
        for n in p.cpu_workers:
            for name in rotated(list(CPU_CONTENDERS), rep + n):
                if name == "bare":
                    rate = await asyncio.to_thread(procs.run_bare, n, rounds, max(1, p.cpu_jobs // n),
                                                   ctx.rundir(f"bare-{n}"))
                    row = {"contender": name, "workers": n, "jobs": p.cpu_jobs, "jobs_per_s": rate, "extra": {}}
                else:
                    row = (await measured_drain(ctx, name, n, p.cpu_jobs, data, handler="bench.handlers:job",
                                                batch=CPU_BATCH)).as_dict()
                row["extra"]["repeat"] = rep
                runs.append(row)
                ctx.say(f"  cpu rep {rep + 1} N={n} {name:16s} {fmt(row['jobs_per_s'], '.0f')} jobs/s")
    return {"rounds": rounds, "job_s": p.cpu_job_s, "jobs": p.cpu_jobs, "cores": ctx.cores, "runs": runs,
            "summary": summarize_cpu(runs, ctx.cores, p.cpu_workers)}


def summarize_cpu(runs: list[dict], cores: int, ns: tuple[int, ...]) -> list[dict]:
    """Efficiency per core = jobs/s at N / (min(N, cores) x jobs/s at 1), taken within each repeat,
    then the median. `bare` (the work alone, no NATS) is what the machine itself allows."""
    def rates(name: str, n: int) -> dict[int, float]:
        return {r["extra"]["repeat"]: r["jobs_per_s"] for r in runs
                if r["contender"] == name and r["workers"] == n and r["jobs_per_s"]}
    rows = []
    for name in CPU_CONTENDERS:
        one = rates(name, 1)
        for n in ns:
            mine, plain = rates(name, n), rates("plain", n)
            rows.append({"contender": name, "workers": n, "jobs_per_s": median(list(mine.values())),
                         "speedup": median([mine[k] / one[k] for k in mine if k in one]),
                         "efficiency_per_core": median([mine[k] / (min(n, cores) * one[k]) for k in mine if k in one]),
                         "vs_plain": median([mine[k] / plain[k] for k in mine if k in plain]),
                         "cpu_ms_per_job": median([r["cpu_ms_per_1k_jobs"] / 1000 for r in runs
                                                   if r["contender"] == name and r["workers"] == n
                                                   and r.get("cpu_ms_per_1k_jobs")])})
    return rows


def resummarize(results: dict) -> dict:
    """Recompute every summary from the raw runs of a saved results.json."""
    for name, ns in (("throughput", "workers"), ("tuned", "tuned_workers")):
        if name in results:
            tp = results[name]
            tp["summary"] = summarize_throughput(tp["runs"], tp["contenders"], tuple(results["profile"][ns]))
    if "cpu" in results:
        cpu = results["cpu"]
        cpu["summary"] = summarize_cpu(cpu["runs"], cpu["cores"], tuple(results["profile"]["cpu_workers"]))
    if "crash" in results:
        results["crash"]["summary"] = summarize_crash(results["crash"]["ours"], results["crash"]["baseline"])
    if "footprint" in results:
        fp = results["footprint"]
        fp["summary"] = summarize_footprint(fp["parent_cpu"], fp["memory"], fp["many"])
    if "seed" in results:
        results["seed"]["summary"] = summarize_seed(results["seed"]["runs"])
    if "publish" in results:
        results["publish"]["summary"] = summarize_publish(results["publish"]["runs"])
    if "guard" in results:
        results["guard"]["summary"] = summarize_guard(results["guard"]["runs"], results["guard"]["workers"])
    return results


# ================================================================ 3. crash recovery

READY_RE = re.compile(r"worker (\d+) ready \(pid (\d+), (\d+) ms\)")


async def crash_recovery(ctx: Ctx) -> dict:
    p = ctx.profile
    ours, baseline = [], []
    for rep in range(p.repeats):
        ours += await crash_ours(ctx, rep)
        baseline += await crash_baseline(ctx, rep)
    return {"ack_wait": p.ack_wait, "kills_per_repeat": p.kills, "ours": ours, "baseline": baseline,
            "summary": summarize_crash(ours, baseline)}


# The crash supervisors' workers.graceful_timeout. Their hold jobs never end, and the bench's
# children get SIGTERM when it dies (PDEATHSIG, even a SIGKILLed bench): a supervisor then stops
# gracefully, and at the default 30 s it and a worker holding a job outlived the bench by 30 s.
CRASH_GRACE_S = 1.0


async def crash_ours(ctx: Ctx, rep: int) -> list[dict]:
    """SIGKILL the worker holding a job, `kills` times in a row, under `supervisor start`."""
    p = ctx.profile
    await reset_queue(ctx.server.url, QueueSpec(ack_wait=p.ack_wait))
    rundir = ctx.rundir("crash-ours")
    journal = rundir / "journal.txt"
    # Back-to-back kills would climb the crash-loop backoff (it doubles per crash of a slot within
    # 10 s, by design); pinning it at its initial 0.1 s measures the restart path itself.
    config = ours_config(ctx, 2, "bench.handlers:job", consumer=QueueSpec(ack_wait=p.ack_wait).config(),
                         restart={"backoff_initial": 0.1, "backoff_max": 0.1},
                         workers={"graceful_timeout": CRASH_GRACE_S})
    sup = procs.start_supervisor("supervisor", config, rundir, ctx.product_env(**{JOURNAL_ENV: str(journal)}))
    nc = await nats.connect(ctx.server.url)
    obs = await Observer().start(nc)
    js = nc.jetstream()
    out = []
    try:
        await asyncio.to_thread(sup.wait_ready, 2)
        for k in range(p.kills):
            seq = (await js.publish(SUBJECT, HOLD)).seq
            out.append(await kill_holder(sup, obs, str(journal), seq, rep, p.ack_wait))
            ctx.say(f"  crash rep {rep + 1} kill {k + 1}: redelivered {ms(out[-1]['redelivered_s'])}, "
                    f"acked {ms(out[-1]['acked_s'])}, replacement ready {ms(out[-1]['replacement_ready_s'])}")
        ready_ms = {(int(s), int(pid)): int(t) for s, pid, t in READY_RE.findall(sup.log_tail(10**7))}
        for row in out:
            took = ready_ms.get((row["slot"], row["replacement_pid"]))
            row["replacement_fork_to_ready_s"] = None if took is None else took / 1000
    finally:
        await obs.stop()
        await nc.close()
        sup.stop()
    return out


def started(journal: str, seq: int, after_delivery: int) -> tuple[float, int] | None:
    """(time, delivery) of the first start of `seq` on a delivery after `after_delivery`."""
    return next(((t, d) for s, d, _, t in read_journal(journal) if s == seq and d > after_delivery), None)


async def kill_holder(sup: procs.Supervisor, obs: Observer, journal: str, seq: int, rep: int,
                      ack_wait: float) -> dict:
    def holder():
        s = sup.status()
        for w in (s or {}).get("workers", {}).get("list", []):
            for j in w["in_flight"]:
                if j["stream_seq"] == seq and j.get("state", "running") == "running":
                    return w, j["delivery"]
        return None
    w, delivery = await asyncio.to_thread(wait_until, holder, ack_wait + 30, f"a worker running seq {seq}", 0.005)
    t_kill = time.monotonic()
    os.kill(w["pid"], signal.SIGKILL)

    def replaced():
        s = sup.status()
        for x in (s or {}).get("workers", {}).get("list", []):
            if x["slot"] == w["slot"] and x["pid"] != w["pid"] and x["state"] == "ready":
                return time.monotonic(), x["pid"]
        return None
    t_ready, new_pid = await asyncio.to_thread(wait_until, replaced, 60, f"slot {w['slot']} replaced", 0.005)
    await async_wait(lambda: obs.first(seq, "+ACK", delivery + 1), ack_wait + 30, f"seq {seq} acked")
    (t_redel, redelivery), t_ack = started(journal, seq, delivery), obs.first(seq, "+ACK", delivery + 1)
    t_nak = obs.first(seq, "-NAK", delivery)
    return {"repeat": rep, "seq": seq, "slot": w["slot"], "killed_pid": w["pid"], "replacement_pid": new_pid,
            "held_delivery": delivery, "redelivery": redelivery,
            "nak_s": t_nak - t_kill if t_nak else None, "redelivered_s": t_redel - t_kill,
            "acked_s": t_ack - t_kill, "replacement_ready_s": t_ready - t_kill}


async def crash_baseline(ctx: Ctx, rep: int) -> list[dict]:
    """The same without a supervisor: seed-loop processes, each SIGKILLed holding one job; the
    server redelivers after AckWait to a survivor. All kills at once, so it takes one AckWait."""
    p = ctx.profile
    await reset_queue(ctx.server.url, QueueSpec(ack_wait=p.ack_wait))
    rundir = ctx.rundir("crash-baseline")
    journal = str(rundir / "journal.txt")
    env = {JOURNAL_ENV: journal}
    holders = procs.start_loops("seed", p.kills, ctx.server.url, rundir, env=env)
    nc = await nats.connect(ctx.server.url)
    obs = await Observer().start(nc)
    js = nc.jetstream()
    survivor = None
    try:
        await async_wait(lambda: consumer_waiting(js, p.kills), 60, f"{p.kills} seed loops pulling")
        seqs = [(await js.publish(SUBJECT, HOLD)).seq for _ in range(p.kills)]
        await async_wait(lambda: all(started(journal, s, 0) for s in seqs), 30, "every hold job started")
        t_kill = time.monotonic()
        for pid in procs.loop_pids(holders):
            os.kill(pid, signal.SIGKILL)
        survivor = procs.start_loops("seed", 1, ctx.server.url, rundir, env=env)
        await async_wait(lambda: all(obs.first(s, "+ACK", 2) for s in seqs), p.ack_wait + 60, "redeliveries acked")
        rows = [{"repeat": rep, "seq": s, "started_to_kill_s": t_kill - started(journal, s, 0)[0],
                 "redelivered_s": started(journal, s, 1)[0] - t_kill, "acked_s": obs.first(s, "+ACK", 2) - t_kill}
                for s in seqs]
        ctx.say(f"  crash baseline rep {rep + 1}: {len(seqs)} jobs back after "
                f"{ms(median([r['redelivered_s'] for r in rows]))} (median)")
        return rows
    finally:
        await obs.stop()
        await nc.close()
        holders.stop(2)
        if survivor:
            survivor.stop(5)


async def consumer_waiting(js: Any, n: int) -> bool:
    return (await consumer_state(js)).num_waiting >= n


async def async_wait(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.005) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(interval)


def percentile(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    pos = q * (len(values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def summarize_crash(ours: list[dict], baseline: list[dict]) -> list[dict]:
    """p50/p99 per repeat, then the median across repeats."""
    rows = []
    for who, runs, keys in (("supervisor", ours, ("nak_s", "redelivered_s", "acked_s", "replacement_ready_s",
                                                  "replacement_fork_to_ready_s")),
                            ("no supervisor (AckWait)", baseline, ("redelivered_s", "acked_s"))):
        repeats = sorted({r["repeat"] for r in runs})
        row = {"who": who, "kills": len(runs)}
        for key in keys:
            for q, tag in ((0.5, "p50"), (0.99, "p99")):
                row[f"{key[:-2]}_{tag}_s"] = median([percentile([r[key] for r in runs if r["repeat"] == k], q)
                                                     for k in repeats])
            row[f"{key[:-2]}_max_s"] = max((r[key] for r in runs if r[key] is not None), default=None)
        rows.append(row)
    return rows


# ================================================================ 4. footprint

async def footprint(ctx: Ctx) -> dict:
    p = ctx.profile
    parent, memory, many = [], [], []
    for rep in range(p.repeats):
        parent.append(await parent_cpu(ctx, rep))
        memory.append(await worker_memory(ctx, rep))
        many.append(await many_workers(ctx, rep))
    return {"parent_cpu": parent, "memory": memory, "many": many,
            "summary": summarize_footprint(parent, memory, many)}


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


async def parent_cpu(ctx: Ctx, rep: int) -> dict:
    """The supervisor process's CPU while 2 workers take a paced `paced_rate` jobs/s, and idle."""
    p = ctx.profile
    await reset_queue(ctx.server.url, QueueSpec())
    config = ours_config(ctx, 2, OURS["supervisor"])
    sup = procs.start_supervisor("supervisor", config, ctx.rundir("parent-cpu"), ctx.product_env())
    try:
        await asyncio.to_thread(sup.wait_ready, 2)
        parent = psutil.Process(sup.pid)
        await asyncio.sleep(p.settle_s)
        c0, t0 = cpu_seconds(parent), time.monotonic()
        await asyncio.sleep(p.idle_s)
        idle_pct = 100 * (cpu_seconds(parent) - c0) / (time.monotonic() - t0)
        load = await paced_load(ctx, p.paced_rate, p.paced_s, parent)
    finally:
        sup.stop()
    row = {"repeat": rep, "idle_parent_cpu_pct": idle_pct, **load}
    ctx.say(f"  footprint rep {rep + 1}: parent {row['parent_cpu_pct']:.2f}% of a core at "
            f"{row['acked_per_s']:.0f} jobs/s acked (idle {idle_pct:.2f}%)")
    return row


async def paced_load(ctx: Ctx, rate: int, seconds: float, parent: psutil.Process) -> dict:
    """Publish `rate` jobs/s (core publishes into the stream, 100 per 10 ms tick); measure the
    parent's CPU and the ack rate over the middle of the run (first and last fifth left out)."""
    nc = await nats.connect(ctx.server.url)
    js = nc.jetstream()
    per_tick, tick = max(1, rate // 100), 0.01
    start = time.monotonic()
    marks: dict[str, tuple[float, float, int]] = {}
    sent = 0
    try:
        while (now := time.monotonic()) - start < seconds:
            due = int((now - start) / tick) + 1
            while sent < due * per_tick:
                await nc.publish(SUBJECT, b"x")
                sent += 1
            frac = (now - start) / seconds
            for tag, at in (("lo", 0.2), ("hi", 0.8)):
                if tag not in marks and frac >= at:
                    s = await consumer_state(js)
                    acked = sent - s.stored
                    marks[tag] = (time.monotonic(), cpu_seconds(parent), acked)
            await asyncio.sleep(max(0.0, start + due * tick - time.monotonic()))
    finally:
        await nc.flush()
        await nc.close()
    (t0, c0, a0), (t1, c1, a1) = marks["lo"], marks["hi"]
    return {"offered_per_s": rate, "window_s": t1 - t0, "parent_cpu_pct": 100 * (c1 - c0) / (t1 - t0),
            "acked_per_s": (a1 - a0) / (t1 - t0)}


def memory_of(proc: psutil.Process) -> dict:
    m = proc.memory_full_info()
    return {"rss": m.rss, "uss": m.uss, "pss": m.pss}


async def worker_memory(ctx: Ctx, rep: int) -> dict:
    """RSS/USS/PSS of idle workers (ready, no job yet), of the parent, and of each baseline's
    process for comparison."""
    p = ctx.profile
    await reset_queue(ctx.server.url, QueueSpec())
    config = ours_config(ctx, p.idle_workers, OURS["supervisor-sync"])
    sup = procs.start_supervisor("supervisor", config, ctx.rundir("memory"), ctx.product_env())
    try:
        await asyncio.to_thread(sup.wait_ready, p.idle_workers)
        await asyncio.sleep(p.settle_s)
        workers = [memory_of(psutil.Process(pid)) for pid in sup.worker_pids()]
        parent = memory_of(psutil.Process(sup.pid))
    finally:
        sup.stop()
    out = {"repeat": rep, "workers": workers, "parent": parent, "baselines": await baseline_memory(ctx)}
    ctx.say(f"  footprint rep {rep + 1}: idle worker USS {mib(median([w['uss'] for w in workers]))}, "
            f"RSS {mib(median([w['rss'] for w in workers]))}; parent USS {mib(parent['uss'])}")
    return out


async def baseline_memory(ctx: Ctx) -> dict:
    out = {}
    names = ["plain"] + ([FASTSTREAM] if ctx.profile.with_faststream and procs.faststream_available() else [])
    for name in names:
        c = starter(ctx, name, 1, ctx.rundir(f"memory-{name}"))()
        try:
            nc = await nats.connect(ctx.server.url)
            try:
                await async_wait(lambda: consumer_waiting(nc.jetstream(), 1), 30, f"{name} pulling")
            finally:
                await nc.close()
            await asyncio.sleep(ctx.profile.settle_s)
            out[name] = memory_of(c.tree()[-1])          # the worker itself, not a launcher
        finally:
            c.stop()
    return out


async def many_workers(ctx: Ctx, rep: int) -> dict:
    """`many_workers` started, all ready, each serving: time to all ready, jobs spread, memory."""
    p = ctx.profile
    n = p.many_workers
    await reset_queue(ctx.server.url, QueueSpec())
    config = ours_config(ctx, n, "workers.examples:sleep_job")
    sup = procs.start_supervisor("supervisor", config, ctx.rundir("many"), ctx.product_env())
    t0 = time.monotonic()
    try:
        await asyncio.to_thread(sup.wait_ready, n, 120)
        all_ready_s = time.monotonic() - t0
        jobs = 4 * n
        await publish(ctx.server.url, jobs, b"0.05")
        nc = await nats.connect(ctx.server.url)
        try:
            js = nc.jetstream()
            t1 = time.monotonic()
            await async_wait(lambda: drained(js), 120, f"{jobs} jobs acked", 0.02)
            served_s = time.monotonic() - t1
        finally:
            await nc.close()
        status = sup.status()
        served = [w["jobs_acked"] for w in status["workers"]["list"]]
        mem = [memory_of(psutil.Process(pid)) for pid in sup.worker_pids()]
        parent = psutil.Process(sup.pid)
        c0 = cpu_seconds(parent)
        await asyncio.sleep(p.idle_s)
        idle_pct = 100 * (cpu_seconds(parent) - c0) / p.idle_s
    finally:
        sup.stop(60)
    row = {"repeat": rep, "workers": n, "all_ready_s": all_ready_s, "jobs": jobs, "job_s": 0.05,
           "drain_s": served_s, "workers_serving": sum(1 for s in served if s > 0), "jobs_per_worker": served,
           "uss_total": sum(m["uss"] for m in mem), "uss_median": median([m["uss"] for m in mem]),
           "idle_parent_cpu_pct": idle_pct}
    ctx.say(f"  footprint rep {rep + 1}: {n} workers ready in {all_ready_s:.2f} s, {row['workers_serving']} served "
            f"{jobs} x 50 ms jobs in {served_s:.2f} s; USS total {mib(row['uss_total'])}")
    return row


async def drained(js: Any) -> bool:
    s = await consumer_state(js)
    return s.stored == 0 and s.num_ack_pending == 0


def summarize_footprint(parent: list[dict], memory: list[dict], many: list[dict]) -> dict:
    def med(rows: list[dict], key: str) -> float | None:
        return median([r[key] for r in rows])
    base = {}
    for name in sorted({k for m in memory for k in m["baselines"]}):
        base[name] = {k: median([m["baselines"][name][k] for m in memory if name in m["baselines"]])
                      for k in ("rss", "uss", "pss")}
    return {
        "parent_cpu_pct": med(parent, "parent_cpu_pct"), "acked_per_s": med(parent, "acked_per_s"),
        "offered_per_s": med(parent, "offered_per_s"), "idle_parent_cpu_pct": med(parent, "idle_parent_cpu_pct"),
        "worker_uss": median([median([w["uss"] for w in m["workers"]]) for m in memory]),
        "worker_rss": median([median([w["rss"] for w in m["workers"]]) for m in memory]),
        "worker_pss": median([median([w["pss"] for w in m["workers"]]) for m in memory]),
        "parent_uss": median([m["parent"]["uss"] for m in memory]),
        "parent_rss": median([m["parent"]["rss"] for m in memory]),
        "baselines": base,
        "many_workers": many[0]["workers"] if many else None,
        "many_all_ready_s": med(many, "all_ready_s"), "many_drain_s": med(many, "drain_s"),
        "many_workers_serving": min((r["workers_serving"] for r in many), default=None),
        "many_uss_total": med(many, "uss_total"), "many_idle_parent_cpu_pct": med(many, "idle_parent_cpu_pct"),
    }


# ================================================================ 5. the seed experiment

async def seed_experiment(ctx: Ctx) -> dict:
    """`seed_jobs` jobs of `seed_job_s` published at once to 3 ready workers with the defaults:
    from the publish to the last ack, and how many of the 3 workers took a job (the seed post's
    experiment: 30 x 0.2 s over 3 workers should take about 2 s and use all three)."""
    p = ctx.profile
    runs = []
    for rep in range(p.repeats):
        await reset_queue(ctx.server.url, QueueSpec())
        sup = procs.start_supervisor("supervisor", ours_config(ctx, 3, "workers.examples:sleep_job"),
                                     ctx.rundir("seed"), ctx.product_env())
        nc = await nats.connect(ctx.server.url)
        try:
            await asyncio.to_thread(sup.wait_ready, 3)
            t0 = time.monotonic()
            await publish(ctx.server.url, p.seed_jobs, str(p.seed_job_s).encode())
            await async_wait(lambda: drained(nc.jetstream()), 60, f"{p.seed_jobs} seed jobs acked", 0.005)
            took = time.monotonic() - t0
            acked = await asyncio.to_thread(wait_until, lambda: jobs_acked(sup, p.seed_jobs), 10, "acks counted")
        finally:
            await nc.close()
            sup.stop()
        runs.append({"repeat": rep, "seconds": took, "jobs_per_worker": acked,
                     "workers_used": sum(1 for a in acked if a > 0)})
        ctx.say(f"  seed rep {rep + 1}: {p.seed_jobs} x {p.seed_job_s:g} s on 3 workers in {took:.2f} s, "
                f"jobs per worker {acked}")
    return {"jobs": p.seed_jobs, "job_s": p.seed_job_s, "workers": 3, "runs": runs, "summary": summarize_seed(runs)}


def jobs_acked(sup: procs.Supervisor, total: int) -> list[int] | None:
    """Jobs acked per worker, from /status, once they add up to `total`."""
    s = sup.status()
    acked = [w["jobs_acked"] for w in (s or {}).get("workers", {}).get("list", [])]
    return acked if sum(acked) >= total else None


def summarize_seed(runs: list[dict]) -> dict:
    return {"seconds": median([r["seconds"] for r in runs]), "seconds_max": max((r["seconds"] for r in runs), default=None),
            "workers_used_min": min((r["workers_used"] for r in runs), default=None)}


# ================================================================ 6. supervisor publish

PUBLISHERS = ("supervisor-publish", "publish-async")


async def publish_throughput(ctx: Ctx) -> dict:
    """`supervisor publish --count N` against a plain nats-py publish_async loop, each started as a
    command into an empty stream; stored messages/s between 10 % and 90 % of N, from StreamInfo."""
    p = ctx.profile
    runs = []
    for rep in range(p.repeats):
        for name in rotated(list(PUBLISHERS), rep):
            row = await timed_publish(ctx, name, p.publish_count)
            row["repeat"] = rep
            runs.append(row)
            ctx.say(f"  publish rep {rep + 1} {name:18s} {fmt(row['msgs_per_s'], '.0f')} msgs/s, "
                    f"done in {row['done_s']:.2f} s")
    return {"count": p.publish_count, "runs": runs, "summary": summarize_publish(runs)}


def publisher_argv(ctx: Ctx, name: str, count: int) -> tuple[list[str], dict[str, str]]:
    if name == "supervisor-publish":
        return ([sys.executable, "-m", "supervisor", "publish", "--server", ctx.server.url, "--count", str(count),
                 "--data", "x"], child_env(**ctx.product_env()))
    return ([sys.executable, "-m", "bench.contenders", "publish-async", "--server", ctx.server.url, "--count",
             str(count)], child_env())


async def timed_publish(ctx: Ctx, name: str, count: int) -> dict:
    await reset_queue(ctx.server.url, QueueSpec())
    argv, env = publisher_argv(ctx, name, count)
    rundir = ctx.rundir(name)
    nc = await nats.connect(ctx.server.url)
    js = nc.jetstream()
    progress = Progress(count, time.monotonic())
    with open(rundir / "publish.log", "wb") as log:
        proc = await asyncio.to_thread(psutil.Popen, argv, cwd=rundir, stdout=log, stderr=log, env=env)
    try:
        cpu: list[tuple[int, float]] = []           # (stored, publisher CPU seconds) at 10 % and 90 %
        while True:
            stored = (await js.stream_info(STREAM)).state.messages
            progress.samples.append((time.monotonic() - progress.t0, stored))
            if len(cpu) < 2 and stored >= (0.1, 0.9)[len(cpu)] * count and proc.poll() is None:
                cpu.append((stored, busy_seconds(proc)))
            if stored >= count:
                break
            if proc.poll() not in (None, 0):
                raise RuntimeError(f"{name} exited with {proc.returncode}: {(rundir / 'publish.log').read_text()[-2000:]}")
            await asyncio.sleep(0.01)
        code = await asyncio.to_thread(proc.wait, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await nc.close()
    if code != 0:
        raise RuntimeError(f"{name} exited with {code}")
    (n0, c0), (n1, c1) = cpu if len(cpu) == 2 else ((0, 0.0), (0, 0.0))
    return {"contender": name, "count": count, "msgs_per_s": progress.steady_rate(), "done_s": progress.done_s,
            "cpu_ms_per_1k_msgs": 1e6 * (c1 - c0) / (n1 - n0) if n1 > n0 else None}


def summarize_publish(runs: list[dict]) -> list[dict]:
    rows = []
    for name in PUBLISHERS:
        mine = {r["repeat"]: r for r in runs if r["contender"] == name}
        base = {r["repeat"]: r for r in runs if r["contender"] == "publish-async"}
        rows.append({"contender": name, "msgs_per_s": median([r["msgs_per_s"] for r in mine.values()]),
                     "msgs_per_s_all": [r["msgs_per_s"] for r in mine.values()],
                     "done_s": median([r["done_s"] for r in mine.values()]),
                     "cpu_ms_per_1k_msgs": median([r["cpu_ms_per_1k_msgs"] for r in mine.values()]),
                     "vs_async": median([mine[k]["msgs_per_s"] / base[k]["msgs_per_s"] for k in mine
                                         if k in base and mine[k]["msgs_per_s"] and base[k]["msgs_per_s"]])})
    return rows


# ================================================================ 7. the [idempotency] guard's cost (defaults)

# The same sync no-op drain four ways, in the same run: no guard; the guard (a lease written
# before each job, replaced by its done-marker after: two KV writes); double_ack alone; and the
# guard with double_ack, the setting the README recommends beside it. Each run starts with an empty bucket: without a
# Nats-Msg-Id a job's key is JOBS:<seq>, and reset_queue starts the sequences at 1 again.
GUARD_VARIANTS = {"no guard": ({}, False), "guard": ({"idempotency": {"enabled": True}}, False),
                  "double_ack alone": ({}, True), "guard + double_ack": ({"idempotency": {"enabled": True}}, True)}
GUARD_BUCKET = "KV_JOBS_DONE"


async def guard_cost(ctx: Ctx) -> dict:
    p = ctx.profile
    runs = []
    for rep in range(p.repeats):
        for name in rotated(list(GUARD_VARIANTS), rep):
            sections, double_ack = GUARD_VARIANTS[name]
            await drop_stream(ctx.server.url, GUARD_BUCKET)
            r = await measured_drain(ctx, "supervisor-sync", p.guard_workers, p.guard_jobs, b"x",
                                     sections={**sections, "workers": {"double_ack": double_ack}})
            r.extra.update(repeat=rep, variant=name)
            runs.append(r.as_dict())
            ctx.say(f"  guard rep {rep + 1} N={p.guard_workers} {name:18s} {fmt(r.jobs_per_s, '.0f')} jobs/s, "
                    f"{fmt(r.cpu_ms_per_1k_jobs, '.0f')} + server {fmt(r.server_cpu_ms_per_1k_jobs, '.0f')} CPU ms/1k jobs")
    await drop_stream(ctx.server.url, GUARD_BUCKET)
    return {"jobs": p.guard_jobs, "workers": p.guard_workers, "runs": runs,
            "summary": summarize_guard(runs, p.guard_workers)}


async def drop_stream(url: str, name: str) -> None:
    from nats.js.errors import NotFoundError

    nc = await nats.connect(url)
    try:
        with contextlib.suppress(NotFoundError):
            await nc.jetstream().delete_stream(name)
    finally:
        await nc.close()


def cost_row(runs: list[dict], name: str, base: str, n: int, vs: str) -> dict:
    """Variant `name` of a feature-cost scenario (the guard's, tracing's, a limit's): median jobs/s
    and CPU; against variant `base` of the same repeat, the ratio (key `vs`) and the extra wall
    time per job (1/rate - 1/base, at n workers). Repeat by repeat, since a busy box moves both."""
    by = {(r["extra"]["variant"], r["extra"]["repeat"]): r for r in runs}
    repeats = sorted({r["extra"]["repeat"] for r in runs})
    mine = [by[(name, k)] for k in repeats if (name, k) in by]
    pairs = [(by[(name, k)]["jobs_per_s"], by[(base, k)]["jobs_per_s"]) for k in repeats
             if (name, k) in by and (base, k) in by]
    pairs = [(a, b) for a, b in pairs if a and b]
    return {"variant": name, "workers": n, "repeats": len(mine),
            "jobs_per_s": median([r["jobs_per_s"] for r in mine]),
            "jobs_per_s_all": [r["jobs_per_s"] for r in mine],
            vs: median([a / b for a, b in pairs]),
            "extra_us_per_job": median([1e6 * (1 / a - 1 / b) for a, b in pairs]),
            "cpu_ms_per_1k_jobs": median([r["cpu_ms_per_1k_jobs"] for r in mine]),
            "server_cpu_ms_per_1k_jobs": median([r["server_cpu_ms_per_1k_jobs"] for r in mine]),
            "runs": mine}


def summarize_guard(runs: list[dict], n: int) -> list[dict]:
    """Per variant, against "no guard" (cost_row)."""
    return [without_runs(cost_row(runs, name, "no guard", n, "vs_no_guard")) for name in GUARD_VARIANTS]


def without_runs(row: dict) -> dict:
    row.pop("runs")
    return row


# ================================================================ formatting helpers

def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f} ms"


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"
