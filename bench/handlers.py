"""Job handlers the bench runs in every contender, so each does the same work per job.

The supervisor takes them as `workers.handler = "bench.handlers:NAME"` (the bench puts the repo
on PYTHONPATH); the plain loops and the FastStream app call `work()` directly.
"""

from __future__ import annotations

import os
import time

from workers import Job

HOLD = b"hold"            # first delivery: block until the process is killed; later ones: return
CPU_PREFIX = b"cpu:"      # cpu:N -> N rounds of pure-Python arithmetic (a few ms; calibrated)
TIMED_PREFIX = b"t:"      # t:PUBLISHED:SECONDS -> sleep SECONDS, and note when the job started (TIMES_ENV)
JOURNAL_ENV = "BENCH_JOURNAL"
TIMES_ENV = "BENCH_TIMES"
_times_fd: int | None = None


def spin(rounds: int) -> int:
    """Pure Python, GIL-bound work: no I/O, no allocation to speak of."""
    x = 0
    for i in range(rounds):
        x = (x * 31 + i) & 0xFFFFFFFF
    return x


def work(data: bytes, delivery: int, seq: int = 0) -> None:
    """What every contender does for a job (blocking; the no-op case costs one compare)."""
    if data.startswith(CPU_PREFIX):
        spin(int(data[len(CPU_PREFIX):]))
    elif data.startswith(TIMED_PREFIX):
        timed(data)
    elif data == HOLD:
        journal(seq, delivery)
        if delivery == 1:
            time.sleep(3600)


def journal(seq: int, delivery: int) -> None:
    """Note when a hold job starts, on the system-wide monotonic clock the bench also reads.
    (A file, not a wildcard subscription on _INBOX.>: that would give dead workers' pull
    requests interest, and the server would deliver redeliveries to them.)"""
    path = os.environ.get(JOURNAL_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{seq} {delivery} {os.getpid()} {time.monotonic():.6f}\n")


def timed(data: bytes) -> None:
    """A job of the latency and fairness scenarios: `t:PUBLISHED:SECONDS` (PUBLISHED on the
    system-wide monotonic clock the bench reads too). Sleeps SECONDS, then appends one line,
    `PUBLISHED STARTED ENDED PID SECONDS`, to the file TIMES_ENV names: one O_APPEND write of a
    short line, so the processes of a contender can share one file."""
    global _times_fd
    started = time.monotonic()
    published, seconds = data[len(TIMED_PREFIX):].split(b":")
    if float(seconds) > 0:
        time.sleep(float(seconds))
    if _times_fd is None:
        _times_fd = os.open(os.environ[TIMES_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(_times_fd, b"%s %.6f %.6f %d %s\n" % (published, started, time.monotonic(), os.getpid(), seconds))


def read_times(path: str) -> list[tuple[float, float, float, int, float]]:
    """(published, started, ended, pid, seconds) of every timed job, in the order they ended."""
    try:
        with open(path) as f:
            rows = [line.split() for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []
    return [(float(a), float(b), float(c), int(d), float(e)) for a, b, c, d, e in rows]


def read_journal(path: str) -> list[tuple[int, int, int, float]]:
    try:
        with open(path) as f:
            rows = [line.split() for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []
    return [(int(s), int(d), int(p), float(t)) for s, d, p, t in rows]


async def anoop(job: Job) -> None:
    """Async no-op: runs on the worker's loop, no thread hop (like the plain loop's inline call)."""


def noop(job: Job) -> None:
    """Sync no-op: runs in the worker's handler thread (same as workers.examples:noop)."""


def job(job: Job) -> None:
    """Sync handler for the CPU and crash scenarios."""
    work(job.data, job.delivery, job.stream_seq)


async def ajob(job: Job) -> None:
    """Async twin of job(): the same work on the worker's loop (blocking it while it runs)."""
    work(job.data, job.delivery, job.stream_seq)


def calibrate(target_s: float) -> int:
    """Rounds of spin() that take about target_s seconds on this machine (one core)."""
    rounds = 10_000
    while True:
        t = time.perf_counter()
        spin(rounds)
        took = time.perf_counter() - t
        if took > 0.05:
            break
        rounds *= 2
    best = min(_time(rounds) for _ in range(5))
    return max(1, int(rounds * target_s / best))


def _time(rounds: int) -> float:
    t = time.perf_counter()
    spin(rounds)
    return time.perf_counter() - t
