"""Handlers the tests run inside real workers. Each job is logged to $JOBS_LOG as
`start|done pid seq delivery time data`, one O_APPEND write per line (atomic), so the test
knows exactly which process ran what, when, and how often."""

import asyncio
import builtins
import os
import signal
import time
from pathlib import Path

from workers import Job, Reject, Retry

_fd = None
_hoard = []          # memory kept on purpose by "grow:MB" jobs


def _log(event: str, job: Job, tag: str = "") -> None:
    global _fd
    if _fd is None:
        _fd = os.open(os.environ["JOBS_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    data = tag + job.data.decode(errors="replace").replace("\n", " ")
    os.write(_fd, f"{event} {os.getpid()} {job.stream_seq} {job.delivery} {time.time():.6f} {data}\n".encode())


def _act(job: Job) -> float:
    """What the payload asks for; returns seconds to sleep."""
    text = job.data.decode(errors="replace").strip()
    if text == "crash" or (text == "crash-once" and job.delivery == 1):
        os._exit(13)
    if text.startswith("crash-after:"):  # dies mid-job, every time (a poison job that takes a while)
        time.sleep(float(text.split(":")[1]))
        os._exit(13)
    if text == "reject":
        raise Reject("payload asked to be rejected")
    if text.startswith("retry:") and job.delivery == 1:
        raise Retry(delay=float(text.split(":")[1]))
    if text.startswith("retry-always:"):
        raise Retry(delay=float(text.split(":")[1]))
    if text.startswith("raise:"):       # raise:KeyError, raise:Declined (below): what [retry.rules] match
        name = text.split(":")[1]
        cls = globals().get(name) or getattr(builtins, name)
        raise cls(f"{name} on delivery {job.delivery} of seq {job.stream_seq}")
    if text == "fail-first-attempt" and "Supervisor-Attempts" not in job.headers:   # a re-published copy has it
        raise RuntimeError("failing the first attempt on purpose")
    if text == "fail-once" and job.delivery == 1:
        raise RuntimeError("failing the first delivery on purpose")
    if text == "fail":
        raise RuntimeError("failing every delivery on purpose")
    if text.startswith("grow:"):
        _hoard.append(bytearray(int(text.split(":")[1]) * 1024 * 1024))   # zero-filled pages count in RSS once touched
        _hoard[-1][::4096] = b"x" * len(_hoard[-1][::4096])
        return 0.0
    if text.startswith("long-once:"):   # long the first time (a test can catch it running), then instant
        return float(text.split(":")[1]) if job.delivery == 1 else 0.0
    if text.startswith("until:"):       # runs until the test creates that file: as long as the test needs
        gate, deadline = Path(text.split(":", 1)[1]), time.monotonic() + 120
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return 0.0
    if text.startswith("hog") and job.delivery == 1:
        while True:           # a handler that never yields the GIL long enough... burns CPU forever
            pass
    try:
        return float(text.split(":")[-1])
    except ValueError:
        return 0.0


class Declined(Exception):
    """An error of the handler's own, for rules that name it by module ("testhandlers:Declined")."""


def record(job: Job) -> None:
    _log("start", job)
    seconds = _act(job)
    time.sleep(seconds)
    _log("done", job)


def record_raises(job: Job) -> None:
    """`record` that also journals a run its payload made raise (`raised`): when it ended."""
    _log("start", job)
    try:
        seconds = _act(job)
    except Exception:
        _log("raised", job)
        raise
    time.sleep(seconds)
    _log("done", job)


def record_v2(job: Job) -> None:
    """`record` that tags what it logs (data "v2:<payload>"): which handler ran a job."""
    _log("start", job, "v2:")
    time.sleep(_act(job))
    _log("done", job, "v2:")


async def record_async(job: Job) -> None:
    _log("start", job)
    seconds = _act(job)
    await asyncio.sleep(seconds)
    _log("done", job)


def boom_init() -> None:
    raise RuntimeError("init hook failing on purpose")


def gate_init() -> None:
    """Hold a worker before it becomes ready until the test creates $GATE_DIR/open. With
    $GATE_ONE set only the first worker to get here waits (it claims the gate); the rest go on."""
    gate = Path(os.environ["GATE_DIR"])
    if os.environ.get("GATE_ONE"):
        try:
            os.close(os.open(gate / "claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    while not (gate / "open").exists():
        time.sleep(0.02)


def slow_init() -> None:
    """A worker slow to become ready ($SLOW_INIT seconds): a replacement that takes its time."""
    time.sleep(float(os.environ.get("SLOW_INIT", "2")))


def die_after_ack_init() -> None:
    """A kill point between an ack and its fence, made explicit: a worker running a job whose
    payload is `die-after-ack` (first delivery) SIGKILLs itself right after it has published the
    ack and marked the entry ACKED, before its settler can fence it (nats-py's publish only
    queues the bytes for the flusher task, and nothing here yields to the loop, so the ack never
    reaches the server: the parent's NAK is what brings the job back)."""
    from workers.runtime import settle as settling

    original, original_all = settling.Settler.settle, settling.Settler.ack_all

    async def settle(self, i, job, payload, outcome, reason):
        await original(self, i, job, payload, outcome, reason)
        if outcome == "ack" and job.delivery == 1 and job.data == b"die-after-ack":
            os.kill(os.getpid(), signal.SIGKILL)

    async def ack_all(self, done):
        """`die-after-acks`: the same kill point after a batch of acks (one write for several jobs:
        Settler.ack_all), the first time one holds such a first delivery ($DIE_ONCE: a file
        claimed once, so a replacement lives)."""
        await original_all(self, done)
        if len(done) > 1 and any(job.data == b"die-after-acks" and job.delivery == 1 for _, job in done):
            try:
                os.close(os.open(os.environ["DIE_ONCE"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return
            os.kill(os.getpid(), signal.SIGKILL)

    settling.Settler.settle, settling.Settler.ack_all = settle, ack_all


def full_buffer_when_down_init() -> None:
    """Fault hook (workers.init): while the worker's connection is down its reconnect buffer is
    full, so whatever it publishes then (acks, pull requests) is refused by nats-py's own check
    (OutboundBufferLimitError, raised from its real state: only the limit is set here)."""
    from supervisor.nats import fix as natsfix

    def refusing(original):
        async def publish(self, *args, **kwargs):
            if self.is_connected:
                return await original(self, *args, **kwargs)
            saved, self._max_pending_size = self._max_pending_size, 1
            try:
                return await original(self, *args, **kwargs)
            finally:
                self._max_pending_size = saved
        return publish

    # A batch of acks goes out through publish_each (workers/runtime/settle.py ack_all).
    natsfix.Client.publish, natsfix.Client.publish_each = refusing(natsfix.Client.publish), \
        refusing(natsfix.Client.publish_each)


def pulls_while_down_init() -> None:
    """Probe (workers.init): log every pull request the worker publishes while its connection is
    down (event pull_buffered). nats-py buffers such a publish and sends it once reconnected,
    where it is a live request the worker may no longer count."""
    import logging

    from supervisor.nats import fix as natsfix

    original = natsfix.Client.publish

    async def publish(self, subject, *args, **kwargs):
        if subject.startswith("$JS.API.CONSUMER.MSG.NEXT.") and not self.is_connected:
            logging.getLogger("worker").warning("pull request published while disconnected",
                                                extra={"event": "pull_buffered"})
        return await original(self, subject, *args, **kwargs)

    natsfix.Client.publish = publish


def finish_fails_init() -> None:
    """Fault hook (workers.init): settling the first delivery of a "finish-fails" job raises, as a
    bug in the settle path would: the task that settles jobs dies with it. Worker.finished is
    the first step of every settle (a batch of plain acks too: threads.py finisher)."""
    from workers.runtime import worker as runtime

    original = runtime.Worker.finished

    def finished(self, job, *rest):
        if job.data.startswith(b"finish-fails") and job.delivery == 1:
            raise RuntimeError("the settle path failing on purpose")
        original(self, job, *rest)

    runtime.Worker.finished = finished


def lose_parent_death_signal_init() -> None:
    """Fault hook (workers.init): change the worker's credentials, as an init that drops its
    privileges does; the kernel then clears PR_SET_PDEATHSIG (commit_creds), so the worker is no
    longer signalled when its supervisor dies. As root, the effective group changes and back;
    otherwise the signal is cleared directly. Fails the init unless the signal is gone."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if os.geteuid() == 0:
        os.setegid(65534)
        os.setegid(0)
    else:
        libc.prctl(1, 0, 0, 0, 0)                # PR_SET_PDEATHSIG
    current = ctypes.c_int(-1)
    libc.prctl(2, ctypes.byref(current), 0, 0, 0)  # PR_GET_PDEATHSIG
    assert current.value == 0, f"the parent-death signal is still {current.value}"


NOT_CALLABLE = 42


# ---------------------------------------------------------------- autoscaling workloads

_pool_fds: list[int] = []


def _pool() -> list[int]:
    """$POOL_SIZE lock files in $POOL_DIR: the "connections" of a pool every worker shares."""
    if not _pool_fds:
        size, where = int(os.environ["POOL_SIZE"]), os.environ["POOL_DIR"]
        _pool_fds.extend(os.open(os.path.join(where, f"conn{i}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
                         for i in range(size))
    return _pool_fds


def pooled(job: Job) -> None:
    """Hold one of the pool's connections (a file lock) for the payload's seconds (0.1 by default),
    waiting for a free one like a client of a saturated database pool. Logged inside the lock,
    so the test can check that no more than $POOL_SIZE jobs ever ran at once."""
    import fcntl

    seconds = float(job.data or b"0.1")
    while True:
        for fd in _pool():
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            try:
                _log("start", job)
                time.sleep(seconds)
                _log("done", job)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            return
        time.sleep(0.002)


def burn(job: Job) -> None:
    """Spend the payload's seconds (0.05 by default) of this thread's CPU time: however many
    workers share the cores, each job costs the same CPU."""
    seconds = float(job.data or b"0.05")
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def record_any(job: Job) -> None:
    """`record` that ignores what the payload asks (tag "any:"): a pool whose jobs always succeed
    beside a pool whose handler fails the same message."""
    _log("start", job, "any:")
    _log("done", job, "any:")
