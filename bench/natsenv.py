"""The bench's own nats-server, the queue every contender drains, and the measuring probes.

Every contender binds to the same durable pull consumer (`JOBS` / `workers`, AckExplicit) on the
same server, reset before each run, with the backlog published before any consumer starts: a
run measures consumption only. Progress is read from ConsumerInfo (acked = published - pending -
ack pending), the same way for every contender, so no contender carries instrumentation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.js import api
from nats.js.errors import NotFoundError

from supervisor.config import ConsumerConfig
from supervisor.nats.embedded import find_binary as nats_server_binary
from supervisor.nats.embedded import free_port
from workers.protocol.fork import set_parent_death_signal

STREAM = "JOBS"
CONSUMER = "workers"
SUBJECT = "jobs.new"
SUBJECTS = ["jobs.>"]
REPO = Path(__file__).resolve().parent.parent
# Set on SIGTERM: waits running in threads (which a cancelled task cannot stop) give up at once,
# so the bench stops within seconds instead of when their timeouts run out.
STOPPING = threading.Event()


def child_env(**extra: str) -> dict[str, str]:
    """The environment for every process the bench starts: the repo importable, no stray
    SUPERVISOR_* overrides from the caller's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERVISOR_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _die_with(parent: int) -> None:
    """In a child of the bench, before exec: SIGTERM when the bench dies, however it dies (the
    SIGKILL of a test's timeout included). Every process the bench starts gets it: they live in
    sessions of their own, so no group kill of the bench reaches them."""
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:           # the bench died before the prctl took effect
        os._exit(1)


def dies_with_the_bench():
    """preexec_fn for subprocess.Popen (call it in the thread that starts the child, and keep
    that thread alive while the child runs: the signal follows the thread that forked)."""
    return functools.partial(_die_with, os.getpid())


def wait_until(predicate, timeout: float, what: str, interval: float = 0.01) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if STOPPING.is_set():
            raise TimeoutError(f"the bench is stopping; gave up waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


class NatsServer:
    """nats-server -js on free ports with a temporary store, stopped on exit."""

    def __init__(self, workdir: Path):
        self.store = Path(tempfile.mkdtemp(prefix="store-", dir=workdir))
        self.log_path = self.store.with_suffix(".log")
        self.port, self.monitor_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None
        self.version = ""

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def __enter__(self) -> NatsServer:
        binary = nats_server_binary()
        self.version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip()
        # The ports were picked free a moment ago; any socket (an outgoing connection's included) may
        # take one before the server binds it: it exits "address already in use", and starts again
        # on ports picked again (nothing uses them yet).
        for attempt in range(1, 4):
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen([binary, "-js", "-sd", str(self.store), "-a", "127.0.0.1",
                                              "-p", str(self.port), "-m", str(self.monitor_port)],
                                             stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
                                             preexec_fn=dies_with_the_bench())
            try:
                wait_until(self._serving, 30, "nats-server", 0.05)
                break
            except RuntimeError as exc:
                if attempt == 3 or "address already in use" not in str(exc):
                    raise
                self.port, self.monitor_port = free_port(), free_port()
        return self

    def _serving(self) -> bool:
        if self.proc.poll() is not None:
            said = self.log_path.read_text(errors="replace")
            raise RuntimeError(f"nats-server exited with {self.proc.returncode}: {said[-1500:]}")
        if "Server is ready" not in self.log_path.read_text(errors="replace"):
            return False        # not every listener of its own yet: /healthz might reach whoever took the port
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true",
                                        timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def __exit__(self, *exc: Any) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.store, ignore_errors=True)


# ---------------------------------------------------------------- the queue

_DEFAULT = ConsumerConfig()


@dataclass(frozen=True)
class QueueSpec:
    """The consumer's settings; the defaults are `supervisor start`'s own (a user's consumer)."""
    ack_wait: float = _DEFAULT.ack_wait
    max_ack_pending: int = _DEFAULT.max_ack_pending
    max_deliver: int = _DEFAULT.max_deliver

    def config(self) -> dict[str, Any]:
        """The [consumer] keys that give a supervisor this queue."""
        return {"ack_wait": self.ack_wait, "max_ack_pending": self.max_ack_pending, "max_deliver": self.max_deliver}


async def reset_queue(url: str, spec: QueueSpec) -> None:
    """A fresh work-queue stream and durable pull consumer, as `supervisor start` would create
    them from the config the bench gives it (so it finds nothing to change)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for name in (STREAM, "JOBS_DLQ"):
            with contextlib.suppress(NotFoundError):
                await js.delete_stream(name)
        await js.add_stream(api.StreamConfig(name=STREAM, subjects=SUBJECTS, retention=api.RetentionPolicy.WORK_QUEUE,
                                             storage=api.StorageType.FILE, num_replicas=1, duplicate_window=120.0))
        await js.add_consumer(STREAM, api.ConsumerConfig(
            durable_name=CONSUMER, ack_policy=api.AckPolicy.EXPLICIT, ack_wait=spec.ack_wait, max_deliver=spec.max_deliver,
            max_ack_pending=spec.max_ack_pending, deliver_policy=api.DeliverPolicy.ALL))
    finally:
        await nc.close()


async def publish(url: str, count: int, data: bytes = b"x", subject_of: Callable[[int], str] | None = None) -> float:
    """The backlog: publish_async (nats-py's window of 4,000 PubAcks), every PubAck checked; job i
    on `subject_of(i)` (default: SUBJECT); returns the seconds it took."""
    nc = await nats.connect(url)
    started = time.monotonic()
    try:
        js = nc.jetstream()
        futures = [await js.publish_async(subject_of(i) if subject_of else SUBJECT, data) for i in range(count)]
        acks = await asyncio.wait_for(asyncio.gather(*futures), 60)
        assert all(a.stream == STREAM for a in acks)
    finally:
        await nc.close()
    return time.monotonic() - started


@dataclass
class ConsumerState:
    num_pending: int
    num_ack_pending: int
    num_redelivered: int
    delivered: int
    ack_floor: int
    num_waiting: int
    stored: int         # messages left in the work-queue stream: one leaves on its ack, so: not yet acked


async def consumer_state(js: Any) -> ConsumerState:
    """ConsumerInfo, and the stream's message count beside it. Progress is judged from the count:
    the server's num_pending can drift for a moment under contention (nats-server PR #6297), and
    one smoke run saw num_pending + num_ack_pending read 0 three milliseconds after six jobs were
    published, while those jobs were still running."""
    info = await js.consumer_info(STREAM, CONSUMER, timeout=5)
    stream = await js.stream_info(STREAM)
    return ConsumerState(info.num_pending or 0, info.num_ack_pending or 0, info.num_redelivered or 0,
                         info.delivered.consumer_seq or 0, info.ack_floor.consumer_seq or 0, info.num_waiting or 0,
                         stream.state.messages)


@dataclass
class Progress:
    """Acked jobs over time for one run, from ConsumerInfo polls."""
    total: int
    t0: float
    samples: list[tuple[float, int]] = field(default_factory=list)   # (seconds since t0, acked)

    def add(self, t: float, state: ConsumerState) -> int:
        acked = self.total - state.stored
        self.samples.append((t - self.t0, acked))
        return acked

    @property
    def first_ack_s(self) -> float | None:
        return next((t for t, a in self.samples if a > 0), None)

    @property
    def done_s(self) -> float | None:
        return next((t for t, a in self.samples if a >= self.total), None)

    def time_at(self, acked: float) -> float | None:
        """Linear interpolation of the moment `acked` jobs were done."""
        prev = (0.0, 0)
        for t, a in self.samples:
            if a >= acked:
                if a == prev[1]:
                    return t
                return prev[0] + (t - prev[0]) * (acked - prev[1]) / (a - prev[1])
            prev = (t, a)
        return None

    def steady_rate(self, lo: float = 0.1, hi: float = 0.9) -> float | None:
        """Jobs/s between lo and hi of the backlog: start-up and the tail are left out."""
        t_lo, t_hi = self.time_at(lo * self.total), self.time_at(hi * self.total)
        if t_lo is None or t_hi is None or t_hi <= t_lo:
            return None
        return (hi - lo) * self.total / (t_hi - t_lo)
