"""One measured drain: fresh queue, backlog published, contender started, ConsumerInfo polled
until every job is acked, CPU read from /proc at 10% and 90% of the backlog."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import nats
import psutil

from .natsenv import Progress, QueueSpec, consumer_state, publish, reset_queue
from .procs import Contender

POLL = 0.01


def busy_seconds(proc: psutil.Process | None) -> float:
    if proc is None:
        return 0.0
    with contextlib.suppress(psutil.Error):
        c = proc.cpu_times()
        return c.user + c.system
    return 0.0


def syscalls(proc: psutil.Process | None) -> tuple[int, int]:
    """(write syscalls, context switches) of a process so far, all its threads: what a worker pays
    per round of work beyond its own Python (each write to the server's socket is a syscall, each
    wake-up of a thread or of the loop a context switch)."""
    if proc is None:
        return 0, 0
    writes = switches = 0
    with contextlib.suppress(psutil.Error, OSError):
        writes = proc.io_counters().write_count
        for task in os.listdir(f"/proc/{proc.pid}/task"):
            with open(f"/proc/{proc.pid}/task/{task}/status", "rb") as f:
                for line in f:
                    if line.endswith(b"\n") and b"ctxt_switches:" in line:
                        switches += int(line.split()[-1])
    return writes, switches


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent on anything but idling, since boot."""
    c = psutil.cpu_times()
    return sum(c) - c.idle - getattr(c, "iowait", 0.0)


@dataclass
class CpuMark:
    t: float
    acked: int
    per_pid: dict[int, float]          # user+system seconds
    sys_per_pid: dict[int, tuple[int, int]]   # (write syscalls, context switches)
    server: float
    bench: float                       # this process (the bench polling ConsumerInfo)
    machine: float

    @staticmethod
    def take(t: float, acked: int, procs: list[psutil.Process], server: psutil.Process | None) -> CpuMark:
        return CpuMark(t, acked, {p.pid: busy_seconds(p) for p in procs}, {p.pid: syscalls(p) for p in procs},
                       busy_seconds(server), busy_seconds(psutil.Process()), machine_busy_seconds())


@dataclass
class DrainResult:
    contender: str
    workers: int
    jobs: int
    jobs_per_s: float | None
    first_ack_s: float | None
    done_s: float | None
    cpu_ms_per_1k_jobs: float | None = None       # contender processes, all of them
    server_cpu_ms_per_1k_jobs: float | None = None
    parent_cpu_pct: float | None = None           # ours only: the supervisor process itself
    background_cpu_pct: float | None = None       # other processes on the machine, % of one core
    writes_per_1k_jobs: float | None = None       # write syscalls of the contender's processes
    switches_per_1k_jobs: float | None = None     # their context switches (all threads)
    window_s: float | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


async def drain(url: str, total: int, start: Callable[[], Contender], *, data: bytes = b"x",
                spec: QueueSpec | None = None, server_pid: int | None = None, timeout: float = 600.0,
                parent_pid: Callable[[Contender], int | None] = lambda c: None,
                subject_of: Callable[[int], str] | None = None) -> tuple[DrainResult, Contender]:
    spec = spec or QueueSpec()
    await reset_queue(url, spec)
    await publish(url, total, data, subject_of)
    nc = await nats.connect(url)
    js = nc.jetstream()
    server = psutil.Process(server_pid) if server_pid else None
    contender = None
    try:
        state = await consumer_state(js)
        assert state.stored == total, f"backlog {state.stored} != {total}"
        t0 = time.monotonic()
        contender = start()
        progress = Progress(total, t0)
        marks: list[CpuMark] = []
        procs: list[psutil.Process] = []
        while True:
            state = await consumer_state(js)
            now = time.monotonic()
            acked = progress.add(now, state)
            if len(marks) == 0 and acked >= 0.1 * total or len(marks) == 1 and acked >= 0.9 * total:
                if not procs:
                    procs = contender.tree()
                marks.append(CpuMark.take(now, acked, procs, server))
            if acked >= total:
                break
            if now - t0 > timeout:
                raise TimeoutError(f"{contender.name}: {acked}/{total} acked after {timeout:g}s\n{contender.log_tail()}")
            if not contender.alive():
                raise RuntimeError(f"{contender.name} exited early\n{contender.log_tail()}")
            await asyncio.sleep(POLL)
    except BaseException:
        if contender is not None:
            contender.stop(5)
        raise
    finally:
        await nc.close()
    result = DrainResult(contender.name, 0, total, progress.steady_rate(), progress.first_ack_s, progress.done_s)
    if len(marks) == 2:
        lo, hi = marks
        dt, djobs = hi.t - lo.t, hi.acked - lo.acked
        if dt > 0 and djobs > 0:
            cpu = sum(hi.per_pid.get(pid, 0.0) - v for pid, v in lo.per_pid.items())
            result.cpu_ms_per_1k_jobs = 1e6 * cpu / djobs
            sys_delta = [tuple(b - a for a, b in zip(v, hi.sys_per_pid[pid]))
                         for pid, v in lo.sys_per_pid.items() if pid in hi.sys_per_pid]
            result.writes_per_1k_jobs = 1000 * sum(w for w, _ in sys_delta) / djobs
            result.switches_per_1k_jobs = 1000 * sum(c for _, c in sys_delta) / djobs
            result.server_cpu_ms_per_1k_jobs = 1e6 * (hi.server - lo.server) / djobs if server else None
            result.window_s = dt
            ours = cpu + (hi.server - lo.server) + (hi.bench - lo.bench)
            result.background_cpu_pct = max(0.0, 100 * ((hi.machine - lo.machine) - ours) / dt)
            ppid = parent_pid(contender)
            if ppid in lo.per_pid and ppid in hi.per_pid:
                result.parent_cpu_pct = 100 * (hi.per_pid[ppid] - lo.per_pid[ppid]) / dt
    return result, contender
