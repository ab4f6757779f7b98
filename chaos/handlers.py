"""The handler the chaos runs put inside real workers, and the init hooks that constrain them.

Every job's payload is `KEY:A1[:A2...]`: what attempt 1, 2, ... does (the last one repeats for
later attempts; an attempt is a delivery, counted across a job's [retry] copies for later),
each either seconds to sleep, seconds of CPU to burn (`0.01cpu`), `oom`, `grow8` (keep 8 MB
more of this worker's memory, as a leaking handler does), `fail` (raise: the worker NAKs with
workers.retry_backoff) or `retry0.5` (raise Retry(0.5)).
The handler journals each run to $CHAOS_JOURNAL before and after the work, one line per event written with a single
O_APPEND write (line-atomic between processes, no fsync: a SIGKILLed worker loses nothing it
wrote, and nothing it did not write can appear):

    S|D|R  pid  stream_seq  delivery  monotonic  wall  key

`S` is written right before the work starts, `D` right after it returned, before the worker
acks: a `D` without an ack behind it is exactly the duplicate a crash can cause. `R` is written
right before the handler raises on purpose (`fail`, `retry`): the next delivery is the one it
asked for. CLOCK_MONOTONIC is system-wide, so the runner compares these times with the moments
it injected faults. `journal` is a sync handler (run in a worker thread), `journal_async` the
same work as an async one (on the worker's event loop). A test may set $CHAOS_GATE to a path: a
`retry` action then waits (up to 2 minutes) until that file exists, so the test decides when the
handler raises.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time

from workers import Context, Job, Middleware, Retry
from workers.middleware.retries import attempt_of

_fd: int | None = None
_hoard: list[bytearray] = []     # memory an `oom` job keeps on purpose


def _journal(event: str, job: Job, key: str) -> None:
    global _fd
    if _fd is None:
        _fd = os.open(os.environ["CHAOS_JOURNAL"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    line = f"{event} {os.getpid()} {job.stream_seq} {job.delivery} {time.monotonic():.6f} {time.time():.6f} {key}\n"
    os.write(_fd, line.encode())


def parse_payload(data: bytes, delivery: int) -> tuple[str, str]:
    """(key, what this delivery does): the delivery's own action, or the last one given."""
    key, _, rest = data.decode(errors="replace").partition(":")
    actions = rest.split(":")
    return key, actions[min(max(delivery, 1), len(actions)) - 1] or "0"


class Failed(RuntimeError):
    """What a `fail` action raises: any exception but Retry/Reject NAKs with retry_backoff."""


def begin(job: Job) -> tuple[str, str, float]:
    """Journal the start; (key, action, seconds to sleep after the synchronous part)."""
    # By attempt, not delivery: a [retry] copy for later (retry.republish_after) counts its
    # deliveries from 1 again, and says what the copies before it spent.
    key, what = parse_payload(job.data, attempt_of(job.headers, job.delivery))
    _journal("S", job, key)
    if what == "fail":
        _journal("R", job, key)
        raise Failed(f"chaos: delivery {job.delivery} fails on purpose")
    if what.startswith("retry"):
        wait_for_gate()
        _journal("R", job, key)
        raise Retry(float(what[5:]))
    if what == "oom":
        exhaust_memory()
    elif what.startswith("grow"):
        _hoard.append(touched(int(what[4:])))
    elif what.endswith("cpu"):
        spin(float(what[:-3]))
    else:
        return key, what, float(what)
    return key, what, 0.0


def wait_for_gate() -> None:
    gate = os.environ.get("CHAOS_GATE")
    deadline = time.monotonic() + 120
    while gate and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)


def journal(job: Job) -> None:
    key, _, sleep = begin(job)
    time.sleep(sleep)
    _journal("D", job, key)


async def journal_async(job: Job) -> None:
    """The same work on the worker's loop (a CPU action blocks the loop, as such a handler would).
    Cancelled while asleep (workers.soft_timeout, or a drain's graceful_timeout running out), it
    ends with an `R`: the job comes back, as asked."""
    key, _, sleep = begin(job)
    try:
        await asyncio.sleep(sleep)
    except asyncio.CancelledError:
        _journal("R", job, key)
        raise
    _journal("D", job, key)


class Hops(Middleware):
    """A middleware that does nothing but make the chain's hops (workers.middleware in a drawn
    run): an async before_job (for a sync handler: from its thread to the loop and back) and a
    plain after_job."""

    def setup(self, ctx: Context) -> None:
        self.is_async = ctx.is_async

    async def before_job(self, job: Job) -> None:
        await asyncio.sleep(0)

    def after_job(self, job: Job, outcome: str, error: BaseException | None) -> None:
        self.last = outcome


def touched(megabytes: int) -> bytearray:
    chunk = bytearray(megabytes * 1024 * 1024)
    chunk[::4096] = b"x" * len(chunk[::4096])
    return chunk


def spin(seconds: float) -> None:
    """Burn CPU holding the GIL, as a CPU-bound handler does: the worker's loop thread then gets
    it back only every switch interval (5 ms), which widens any race in the loop."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def exhaust_memory() -> None:
    """Allocate and touch 8 MB at a time until the kernel says no: a memory cgroup's OOM killer
    SIGKILLs us, or RLIMIT_AS makes the allocation raise MemoryError (which we let escape with
    the hoard kept, as a leaking handler would)."""
    while True:
        _hoard.append(touched(8))


# ---------------------------------------------------------------- workers.init hooks

def slow_init() -> None:
    """A worker that takes $CHAOS_INIT_SECONDS to get ready (imports, a model to load...)."""
    time.sleep(float(os.environ.get("CHAOS_INIT_SECONDS", "0.3")))


def join_memory_cgroup() -> None:
    """Move this worker into the memory cgroup $CHAOS_MEMCG (cgroup v1 or v2 directory)."""
    with open(os.path.join(os.environ["CHAOS_MEMCG"], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def limit_address_space() -> None:
    """RLIMIT_AS = what this worker maps now + $CHAOS_AS_HEADROOM_MB: enough for its loop, its
    connection and a handler thread, not for an `oom` job."""
    with open("/proc/self/status") as f:
        vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
    limit = vm_kb * 1024 + int(os.environ.get("CHAOS_AS_HEADROOM_MB", "160")) * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
