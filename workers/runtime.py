"""The worker process: become a clean child after fork, then pull -> handle -> ack.

One worker = one process, one uvloop loop, one NATS connection, bound to the durable pull
consumer every other worker shares. The pull loop issues raw pull requests to
$JS.API.CONSUMER.MSG.NEXT (not js.fetch, see DESIGN.md) and counts credits, so it never has
more messages on the way than it can start now plus a prefetch sized from the measured job time
and pull round trip (workers/pulls.py). Every message is recorded in the shared slot table
before anything else happens, so the parent always knows what this process holds.

Sync handlers run in `concurrency` handler threads of our own that take their next job from a
locked queue themselves and hand outcomes back in batches (one loop wake-up per batch): no trip
through the event loop between two jobs, which is what made CPU-bound jobs pay for GIL ping-pong.
Acks are still published from the loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import json
import logging
import os
import random
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, NoReturn

import setproctitle
from nats.js.api import Header

from supervisor.notify import scrub_child_env

from . import Job, Reject, Retry
from . import slots
from .guard import DUPLICATE, RUN, Guard
from .pulls import PullSizer, fair_share
from .slots import SlotTable

log = logging.getLogger("worker")
dead_log = logging.getLogger("supervisor.dead_letter")   # worker Rejects, poison jobs, max deliveries

PULL_EXPIRES = 1.0          # a pull request lives this long: an idle worker renews it this often, and a
                            # stopping worker waits at most this long (+ PULL_MARGIN) for its last one to end
PULL_MARGIN = 1.0           # past a request's local expiry, before its credits are given up (the server's
                            # clock starts when the request arrives; one round trip at most)
# A shutdown NAKs what it had not started with this delay: every worker of the supervisor is
# stopping too, and one whose pull request is still live would take the job only to NAK it
# again, spending another of consumer.max_deliver. By then every such request has ended.
SHUTDOWN_NAK_DELAY = PULL_EXPIRES + PULL_MARGIN
LIVENESS_EVERY = 0.25       # a worker proves its NATS connection with a PING/PONG this often ...
LIVENESS_TIMEOUT = 2.0      # ... and gives up waiting for the PONG after this
SETTLE_MIN_INTERVAL = 0.002  # coalesce ack-confirming flushes to at most one per this period
OUTCOME_EVERY = 0.02        # a busy handler thread hands outcomes back at most this often: each wake-up of
                            # the loop takes the GIL from a CPU-bound handler (a handful of context switches)
ORPHAN_GRACE = 2.0          # running jobs get this long when the parent has died
PR_SET_PDEATHSIG = 1

# Worker exit codes the parent understands.
EXIT_DRAINED = 0
EXIT_INIT_FAILED = 3
EXIT_CONNECT_FAILED = 4
EXIT_CRASHED = 70
CHILD_EXIT_REASONS = {EXIT_INIT_FAILED: "init hook failed", EXIT_CONNECT_FAILED: "cannot reach NATS or bind the consumer",
                      EXIT_CRASHED: "worker crashed"}
# Slot-table counter per outcome; a duplicate is acked without running its handler ([idempotency]).
OUTCOME_COUNTERS = {"ack": slots.ACKED_N, "duplicate": slots.DUPLICATE_N, "nak": slots.NAKED_N,
                    "term": slots.TERMED_N}
ACKS = ("ack", "duplicate")


@dataclass
class ChildSpec:
    """Everything a freshly forked worker needs; built by the parent before the fork."""
    slot: int
    parent_pid: int
    table: SlotTable
    events_fd: int
    cfg: Any                                   # supervisor.config.Config (servers resolved)
    handler: Callable[[Job], Any]
    init: Callable[[], Any] | None
    connect: Callable[[], Awaitable[Any]]      # returns a connected nats client
    job_limit: int = 0                         # tell the parent once this many jobs started (max_jobs)
    keep_fds: tuple[int, ...] = ()


# ---------------------------------------------------------------- process hygiene after fork

def child_main(spec: ChildSpec) -> NoReturn:
    """Entry point in the child right after fork(); never returns."""
    code = EXIT_CRASHED
    try:
        become_child(spec)
        code = run_worker(spec)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else EXIT_CRASHED
    except BaseException:
        log.exception("worker %d crashed", spec.slot)
    finally:
        logging.shutdown()
        os._exit(code)


def become_child(spec: ChildSpec) -> None:
    """Shed everything inherited from the parent that a worker must not use."""
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != spec.parent_pid:      # the parent died before prctl took effect
        os._exit(EXIT_CRASHED)
    signal.set_wakeup_fd(-1)                 # the parent loop's self-pipe
    for sig in (signal.SIGHUP, signal.SIGQUIT, signal.SIGTTIN, signal.SIGTTOU, signal.SIGUSR1,
                signal.SIGUSR2, signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    # Ctrl-C reaches the whole process group; the parent decides and tells us with SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    _neutralise_inherited_fds(keep={0, 1, 2, spec.events_fd, *spec.keep_fds})
    scrub_child_env(os.environ)              # only the main process talks to systemd
    random.seed()
    asyncio.events._set_running_loop(None)   # we were forked from inside the parent's loop
    setproctitle.setproctitle(f"supervisor: worker {spec.slot} [{spec.cfg.stream.name}/{spec.cfg.consumer.name}]")


def set_parent_death_signal(sig: int) -> None:
    """Linux delivers `sig` to this process when its parent dies (prctl PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def _neutralise_inherited_fds(keep: set[int]) -> None:
    """Point every inherited descriptor at /dev/null instead of closing it.

    That releases the parent's sockets (its NATS connection above all: a child holding it keeps
    the parent's connection open on the server) while keeping the numbers taken, so an
    inherited object that closes "its" fd later can never close one of ours.
    """
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in keep or fd == devnull:
            continue
        try:
            os.dup2(devnull, fd, inheritable=False)
        except OSError:
            pass                              # the listing's own directory fd, already gone
    os.close(devnull)


def run_worker(spec: ChildSpec) -> int:
    if spec.init is not None:
        try:
            spec.init()
        except Exception as exc:
            # One line that names the culprit; the full traceback only at debug level.
            log.error("worker %d: workers.init raised %s", spec.slot, describe_exception(exc))
            log.debug("workers.init traceback", exc_info=True)
            return EXIT_INIT_FAILED
    import uvloop

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(Worker(spec).run())
    finally:
        loop.close()


# ---------------------------------------------------------------- the pull / handle / ack loop

# Worker modes. SERVING pulls and runs. RETIRING (SIGUSR1: scale down, recycle, a config roll)
# stops pulling and runs what it already holds, so a routine retirement spends no delivery
# attempt and redelivers nothing. STOPPING (SIGTERM: the supervisor stops, or graceful_timeout
# ran out) NAKs what has not started and lets running jobs finish within graceful_timeout.
SERVING, RETIRING, STOPPING = "serving", "retiring", "stopping"


class Worker:
    def __init__(self, spec: ChildSpec):
        cfg = spec.cfg
        self.spec = spec
        self.table = spec.table
        self.wcfg = cfg.workers
        self.stream, self.consumer = cfg.stream.name, cfg.consumer.name
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.consumer}"
        self.is_async = inspect.iscoroutinefunction(spec.handler)
        self.queue: deque[tuple[Any, int, Job]] = deque()   # pulled, not started
        self.running = 0                 # taken from the queue (sync: handed to the threads), not finished
        self.credits = 0                 # messages asked for and not yet received or expired
        self.pull_deadline = 0.0         # when the last outstanding pull request expires
        self.pull_sent = 0.0             # when a request left alone towards a backlog (its round trip)
        self.backlog = False             # the last message said more were pending
        self.received = 0                # messages received, ever (max_jobs caps what we ask for)
        self.sizer = PullSizer(self.wcfg.concurrency, self.wcfg.batch,
                               fair_share(cfg.consumer.max_ack_pending, self.wcfg.count),
                               threads=not self.is_async, batching=OUTCOME_EVERY)
        self.started_jobs = 0
        # ACKED/SETTLED entries awaiting a fence: (entry, connection generation, was an ack)
        self.unconfirmed: list[tuple[int, int, bool]] = []
        self.generation = 0              # reconnects seen: what was sent on a dead connection may be lost
        self.mode = SERVING
        self.closing = False
        self.wake_pull = asyncio.Event()
        self.wake_run = asyncio.Event()
        self.wake_settle = asyncio.Event()
        self.changed = asyncio.Event()
        self.stop = asyncio.Event()
        self.grace = self.wcfg.graceful_timeout
        self.replies: list[str] = [""] * self.table.entries   # reply subject by entry index
        self.nc: Any = None
        self.runners: list[asyncio.Task] = []
        self.last_refusal = ("", 0.0)
        # Handler threads start jobs under this lock, and the switch to STOPPING takes it: once a
        # shutdown has NAKed what runs, no handler thread can start another job behind its back.
        self.start_lock = threading.Lock()
        self.guard: Guard | None = None   # [idempotency] (workers/guard.py)
        # Sync handlers: jobs handed to the threads (guarded by start_lock), outcomes coming back,
        # and whether the loop has been rung for them since it last took them.
        self.handed = threading.Condition(self.start_lock)
        self.ready: deque[tuple[Any, int, Job]] = deque()
        self.outcomes: list[tuple[int, Job, BaseException | None, float]] = []
        self.outcomes_since = 0.0        # when the oldest outcome the loop has not been rung for came
        self.rung = False
        self.handed_back = self.settled_back = 0   # outcomes handed to the loop, and settled by it
        self.threads_stop = False
        self.wake_finish = asyncio.Event()

    # -- lifecycle

    async def run(self) -> int:
        self.table.beat()
        try:
            self.nc = await self.spec.connect()
            await self.nc.jetstream().consumer_info(self.stream, self.consumer)
        except Exception as exc:
            log.error("worker %d: cannot connect or bind %s/%s: %s", self.spec.slot, self.stream,
                      self.consumer, exc or type(exc).__name__)
            return EXIT_CONNECT_FAILED
        self.table.server_answered(time.monotonic())
        if self.spec.cfg.idempotency.enabled:          # issue 10: done-markers and leases
            self.guard = Guard(self.nc, self.spec.cfg.idempotency.bucket, f"worker {self.spec.slot}",
                               lambda delivery: retry_delay(self.wcfg.retry_backoff, delivery)).start()
        self.inbox = self.nc.new_inbox()
        self.sub = await self.nc.subscribe(self.inbox, cb=self.on_message, pending_msgs_limit=0,
                                           pending_bytes_limit=0)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.on_sigterm)
        loop.add_signal_handler(signal.SIGUSR1, self.on_sigusr1)
        settler = asyncio.ensure_future(self.settler())
        tasks = [asyncio.ensure_future(c) for c in (self.heartbeat(), self.liveness(), self.puller())]
        if self.is_async:
            self.runners = [asyncio.ensure_future(self.runner()) for _ in range(self.wcfg.concurrency)]
        else:
            self.runners = [asyncio.ensure_future(c) for c in (self.runner(), self.finisher())]
            self.start_threads(loop)
        self.table.set_state(slots.READY)
        self.emit(ev="ready")
        await self.stop.wait()
        await self.wind_down()
        self.closing = True
        self.wake_settle.set()
        for task in tasks + self.runners:
            task.cancel()
        self.stop_threads()
        await settler                  # never cancel a task inside a flush: see supervisor/natsfix.py
        if self.guard:
            await self.guard.close()   # leases of jobs we did not finish: free for their redelivery
        await self.close_connection()
        return EXIT_DRAINED

    def on_sigterm(self) -> None:
        if os.getppid() != self.spec.parent_pid:
            self.grace = min(self.grace, ORPHAN_GRACE)
            log.warning("worker %d: supervisor is gone; stopping", self.spec.slot)
        self.set_mode(STOPPING)

    def on_sigusr1(self) -> None:
        if self.mode == SERVING:
            self.set_mode(RETIRING)

    def set_mode(self, mode: str) -> None:
        with self.handed:
            self.mode = mode
        self.stop.set()
        for event in (self.wake_pull, self.wake_run, self.changed):
            event.set()

    async def heartbeat(self) -> None:
        every = min(0.5, self.wcfg.heartbeat_timeout / 4)   # the parent calls a beat older than 1.5 s stale
        while True:
            self.table.beat()
            if self.nc.stats["reconnects"] != self.generation:
                self.reconnected()
            if os.getppid() != self.spec.parent_pid and self.mode != STOPPING:
                self.on_sigterm()
            await asyncio.sleep(every)

    async def liveness(self) -> None:
        """Prove the connection works, not just the process: a PING/PONG every LIVENESS_EVERY,
        its time in the table. A worker whose connection went half-open keeps beating, but the
        parent stops keeping its jobs alive with +WPI once this goes stale. Its round trip, loop
        and GIL latency included, is one of the samples pull sizing hides (workers/pulls.py)."""
        while True:
            sent = time.monotonic()
            try:
                await self.nc.flush(timeout=LIVENESS_TIMEOUT)
            except Exception:
                pass                     # stale: the parent sees the time stop moving
            else:
                now = time.monotonic()
                self.table.server_answered(now)
                self.sizer.round_trip(now - sent)
            if self.outcomes:            # kept back by a handler thread busy with a long job
                self.wake_finish.set()
            await asyncio.sleep(LIVENESS_EVERY)

    def reconnected(self) -> None:
        """Pull requests died with the old connection; acks written to it may be lost (confirm_settled
        sends those again)."""
        self.generation = self.nc.stats["reconnects"]
        log.info("worker %d: reconnected to NATS; pulling afresh", self.spec.slot)
        self.credits = 0
        self.table.set_credits(0)
        self.wake_pull.set()
        self.wake_settle.set()
        self.changed.set()

    async def wind_down(self) -> None:
        """Stop pulling. Run (RETIRING) or NAK (STOPPING) what was pulled but not started; let
        running jobs finish within graceful_timeout and NAK what still runs after it. Keep the
        subscription until every pull request we sent has ended (filled, 408 on expiry, 409),
        at most PULL_EXPIRES + PULL_MARGIN: no interest may be dropped while a request is live.
        An UNSUB, however well fenced, races the server itself: a message it has just assigned
        to our request is routed after the UNSUB to nobody, and waits for AckWait (and nats-py's
        drain() even removes the subscription before the server reads the UNSUB). Then fence
        every ack."""
        self.table.set_state(slots.DRAINING)
        deadline = time.monotonic() + self.grace
        while True:
            if self.mode == STOPPING:
                await self.nak_queued()
            now = time.monotonic()
            busy = bool(self.running or self.queue)
            if busy and now >= deadline:
                await self.abandon()
                busy = False
            pulls_end = self.pull_deadline + PULL_MARGIN if self.credits > 0 else 0.0
            if not busy and now >= pulls_end:
                break
            wake = min(deadline if busy else float("inf"), pulls_end if pulls_end > now else float("inf"))
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), max(0.001, wake - now))
            except asyncio.TimeoutError:
                pass
        self.credits = 0
        self.table.set_credits(0)
        try:
            await self.sub.unsubscribe()
        except Exception as exc:         # closed: nothing more can reach us anyway
            log.debug("worker %d: unsubscribe: %s", self.spec.slot, exc)
        await self.confirm_settled()

    async def nak_queued(self) -> None:
        """NAK what was pulled and not started: the queue, and what the handler threads have not
        taken yet (in STOPPING they take nothing more: start_lock). The [idempotency] guard
        admitted the latter: their leases are released first, for their redelivery."""
        with self.handed:
            admitted = list(self.ready)
            self.ready.clear()
        self.running -= len(admitted)
        if self.guard and admitted:
            await asyncio.gather(*(self.guard.after(job, False) for _, _, job in admitted))
        admitted.extend(self.queue)
        self.queue.clear()
        for _, i, job in admitted:
            await self.nak_unstarted_job(i, job)

    async def nak_unstarted_job(self, i: int, job: Job) -> None:
        """A shutdown gives back a job it never started, with a delay (SHUTDOWN_NAK_DELAY)."""
        await self.settle(i, job, nak_payload(SHUTDOWN_NAK_DELAY), "nak", "not started before shutdown")

    async def abandon(self) -> None:
        """graceful_timeout ran out: NAK what still runs (its handler's outcome will never be
        sent: the runners are cancelled first, so no late ack can hit the job's next delivery)."""
        self.set_mode(STOPPING)
        await self.nak_queued()
        for task in self.runners:
            task.cancel()
        await asyncio.gather(*self.runners, return_exceptions=True)
        for entry in self.table.snapshot():      # HELD here: taken by a runner, not started yet
            if entry.state in (slots.HELD, slots.RUNNING):
                log.warning("worker %d: job seq=%d still %s after graceful_timeout (%gs); NAKing it",
                            self.spec.slot, entry.stream_seq,
                            "running" if entry.state == slots.RUNNING else "waiting to start", self.grace,
                            extra={"event": "graceful_timeout_nak", "slot": self.spec.slot, "seq": entry.stream_seq,
                                   "delivery": entry.delivery})
                job = Job(data=b"", subject="", headers={}, stream_seq=entry.stream_seq,
                          consumer_seq=entry.consumer_seq, delivery=entry.delivery)
                await self.settle(entry.index, job, b"-NAK", "nak", "still running when graceful_timeout ran out")
        self.running = 0

    async def close_connection(self) -> None:
        try:
            await self.nc.drain()
        except Exception as exc:
            log.warning("worker %d: closing the connection: %s", self.spec.slot, exc)

    # -- pulling

    async def puller(self) -> None:
        while self.mode == SERVING:
            self.expire_lost_pull()
            n = self.pull_size()
            if n > 0:
                now = time.monotonic()
                # Nothing else on its way and a backlog to serve it at once: its first message
                # times a round trip (a request the server holds until a publish times nothing).
                self.pull_sent = now if not self.credits and self.backlog else 0.0
                self.credits += n
                self.table.set_credits(self.credits)
                self.pull_deadline = now + PULL_EXPIRES
                body = b'{"batch":%d,"expires":%d}' % (n, int(PULL_EXPIRES * 1e9))
                await self.nc.publish(self.next_subject, body, reply=self.inbox)
                continue
            self.wake_pull.clear()
            try:
                await asyncio.wait_for(self.wake_pull.wait(), PULL_EXPIRES)
            except asyncio.TimeoutError:
                pass

    def expire_lost_pull(self) -> None:
        """A pull request the server forgot (restart, leader change) must not hold credits forever."""
        if self.credits > 0 and time.monotonic() > self.pull_deadline + PULL_MARGIN:
            self.credits = 0
            self.table.set_credits(0)

    def pull_size(self) -> int:
        outstanding = len(self.queue) + self.running + self.credits
        # A worker due for recycling takes no job it will not run.
        jobs_left = self.spec.job_limit - self.received - self.credits if self.spec.job_limit else None
        return self.sizer.size(time.monotonic(), outstanding, self.credits, self.table.free_entries(), jobs_left)

    async def on_message(self, msg: Any) -> None:
        if not msg.reply:
            self.on_status(msg)
            return
        job = make_job(msg)
        # Record it before anything else, credits after: a death between the two leaves the
        # parent counting the message twice (held and in transit), never zero times.
        i = self.table.hold(job.stream_seq, job.consumer_seq, job.delivery, msg.reply.encode())
        self.received += 1
        if self.credits > 0:
            self.credits -= 1
            self.table.set_credits(self.credits)
        self.timed(msg.reply)
        if i >= 0:
            self.replies[i] = msg.reply
        if job.delivery > 1:
            self.emit(ev="redelivered", seq=job.stream_seq, delivery=job.delivery)
        if i < 0:                        # more arrived than we asked for and the table is full
            await self.nc.publish(msg.reply, b"-NAK")
            self.emit(ev="settled", seq=job.stream_seq, delivery=job.delivery, outcome="nak", reason="table full")
            return
        self.queue.append((msg, i, job))
        self.wake_run.set()
        self.changed.set()               # a shutdown NAKs it at once; a retirement runs it

    def timed(self, reply: str) -> None:
        """Feed pull sizing: a message arrived (idleness); whether more are pending; the round
        trip of a request sent alone while they were."""
        now = time.monotonic()
        self.sizer.message(now)
        self.backlog = pending_after(reply) > 0
        if self.pull_sent:
            self.sizer.round_trip(now - self.pull_sent)
            self.pull_sent = 0.0

    def on_status(self, msg: Any) -> None:
        headers = msg.headers or {}
        status = headers.get("Status")
        if status in ("408", "409"):
            unfilled = int(headers.get("Nats-Pending-Messages", "0") or 0)
            self.credits = max(0, self.credits - unfilled)
            self.table.set_credits(self.credits)
            if status == "409":
                self.refused(headers.get(Header.DESCRIPTION, "409"))
        self.wake_pull.set()
        self.changed.set()

    def refused(self, why: str) -> None:
        """409 (consumer deleted, leadership change, max waiting): say so once a minute, not per pull."""
        now = time.monotonic()
        if why != self.last_refusal[0] or now - self.last_refusal[1] > 60:
            log.warning("worker %d: pull request refused: %s", self.spec.slot, why)
            self.last_refusal = (why, now)

    # -- running jobs

    async def runner(self) -> None:
        """Async handlers: one of `concurrency` tasks, each running a job at a time on the loop.
        Sync handlers: the only one, handing what was pulled to the handler threads."""
        while True:
            while not self.queue or self.mode == STOPPING:
                self.wake_run.clear()
                await self.wake_run.wait()
            chunk = self.take_chunk()
            self.running += len(chunk)
            if not self.is_async:
                await self.hand_over(chunk)   # finisher() takes the outcomes
                continue
            try:
                runnable = await self.admit(chunk) if self.guard else chunk   # [idempotency], issue 10
                if runnable:
                    await self.run_async(*runnable[0][1:])
            finally:
                self.running -= len(chunk)
                self.changed.set()
                self.wake_pull.set()

    async def admit(self, chunk: list[tuple[Any, int, Job]]) -> list[tuple[Any, int, Job]]:
        """[idempotency] (workers/guard.py): ack the jobs already done without running them, NAK
        those another worker is running or that cannot be checked; return the ones to run."""
        verdicts = await asyncio.gather(*(self.guard.before(job) for _, _, job in chunk))
        runnable = []
        for (msg, i, job), verdict in zip(chunk, verdicts):
            if verdict.action == RUN:
                runnable.append((msg, i, job))
            elif verdict.action == DUPLICATE:
                await self.ack(i, job, "duplicate")
            else:
                await self.settle(i, job, nak_payload(verdict.delay), "nak", verdict.reason)
        return runnable

    def take_chunk(self) -> list[tuple[Any, int, Job]]:
        """An async runner's next job; for the handler threads, everything queued."""
        n = 1 if self.is_async else len(self.queue)
        return [self.queue.popleft() for _ in range(n)]

    def count_start(self) -> None:
        self.started_jobs += 1
        if self.started_jobs == self.spec.job_limit:
            # The parent starts our replacement now (we take no further job: pull_size) and
            # retires us once the replacement is ready and our last job is done.
            self.emit(ev="recycle_due", jobs=self.started_jobs)

    async def run_async(self, i: int, job: Job) -> None:
        """An async handler, on the loop."""
        if self.mode == STOPPING:
            await self.nak_unstarted_job(i, job)
            return
        self.table.start(i)
        self.count_start()
        started = time.monotonic()
        try:
            await self.spec.handler(job)
        except asyncio.CancelledError:
            raise                        # graceful_timeout ran out; abandon() NAKs the job
        except BaseException as exc:
            await self.finish(i, job, exc, time.monotonic() - started)
        else:
            await self.finish(i, job, None, time.monotonic() - started)

    # -- sync handlers: threads that take their next job themselves

    async def hand_over(self, chunk: list[tuple[Any, int, Job]]) -> None:
        """The jobs the [idempotency] guard admits (all of them without one) go to the threads.
        A shutdown that came while the guard was asked NAKs them (wind_down wakes for that)."""
        if self.guard:
            runnable = await self.admit(chunk)
            self.running -= len(chunk) - len(runnable)
            chunk = runnable
            self.changed.set()
            self.wake_pull.set()
        self.run_sync(chunk)

    def run_sync(self, chunk: list[tuple[Any, int, Job]]) -> None:
        """Hand pulled jobs (already in the slot table) to the handler threads."""
        with self.handed:
            self.ready.extend(chunk)
            self.handed.notify(len(chunk))

    def start_threads(self, loop: asyncio.AbstractEventLoop) -> None:
        for k in range(self.wcfg.concurrency):
            threading.Thread(target=self.handler_thread, args=(loop,), name=f"handler_{k}", daemon=True).start()

    def stop_threads(self) -> None:
        with self.handed:
            self.threads_stop = True
            self.handed.notify_all()

    def handler_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run jobs back to back while there are any: no trip through the loop between two."""
        while (taken := self.next_job()) is not None:
            i, job = taken
            if self.spec.job_limit:      # the parent starts our replacement while this job runs
                loop.call_soon_threadsafe(self.count_start)
            exc, elapsed = call_handler(self.spec.handler, job, loop)
            if not self.hand_back(loop, i, job, exc, elapsed):
                return
            if exc is not None and not isinstance(exc, Exception):
                return                   # SystemExit & co: finish() exits the process
            if elapsed >= OUTCOME_EVERY:
                self.await_settled()

    def next_job(self) -> tuple[int, Job] | None:
        """In a handler thread: the next job, marked running before its handler starts (its entry
        is this thread's alone until the loop gets the outcome back); None once the worker closes.
        Nothing starts in STOPPING: the loop NAKs what is left."""
        with self.handed:
            while not self.threads_stop:
                if self.ready and self.mode != STOPPING:
                    _, i, job = self.ready.popleft()
                    self.table.start(i)  # several handler threads share the table's counters
                    return i, job
                self.handed.wait()
        return None

    def hand_back(self, loop: asyncio.AbstractEventLoop, i: int, job: Job, exc: BaseException | None,
                  elapsed: float) -> bool:
        """Queue an outcome for the loop, and wake it only if no wake-up is on its way already and
        either this thread is about to wait (nothing ready, a shutdown, a crash) or its oldest
        outcome would be OUTCOME_EVERY old by the end of another job like this one: short jobs
        go back in batches, one loop wake-up each; long ones one by one. An outcome kept back
        behind an unexpectedly long job is collected by liveness()."""
        now = time.monotonic()
        with self.handed:
            if not self.outcomes:
                self.outcomes_since = now
            self.outcomes.append((i, job, exc, elapsed))
            self.handed_back += 1
            if self.rung:
                return True
            busy = bool(self.ready) and self.mode == SERVING and isinstance(exc, (Exception, type(None)))
            if busy and now + elapsed - self.outcomes_since < OUTCOME_EVERY:
                return True
            self.rung = True
        try:
            loop.call_soon_threadsafe(self.wake_finish.set)
        except RuntimeError:             # the loop is closed: the worker is exiting
            return False
        return True

    def await_settled(self) -> None:
        """In a handler thread, after a job of OUTCOME_EVERY or more: wait until the loop has
        acked (NAKed, TERMed) what this thread handed back, before the next job starts, as when
        every job went through the loop. A crash in the next job then finds this one's ack sent
        and its fence on the way, not still queued here (a few ms a job; short jobs never wait)."""
        with self.handed:
            mine = self.handed_back
            while self.settled_back < mine and not self.threads_stop and self.mode != STOPPING:
                self.handed.wait()

    async def finisher(self) -> None:
        """Ack, NAK or TERM the outcomes the handler threads handed back, a batch per wake-up."""
        while True:
            await self.wake_finish.wait()
            self.wake_finish.clear()
            with self.handed:
                batch, self.outcomes, self.rung = self.outcomes, [], False
            try:
                if self.guard:           # the batch's done-markers (or lease releases) at once, not a round
                                         # trip per job; finish() then finds them written
                    await asyncio.gather(*(self.guard.after(job, exc is None) for _, job, exc, _ in batch))
                for i, job, exc, elapsed in batch:
                    await self.finish(i, job, exc, elapsed)
                    self.running -= 1
            finally:
                self.changed.set()
                self.wake_pull.set()
                with self.handed:        # handler threads waiting in await_settled() go on
                    self.settled_back += len(batch)
                    self.handed.notify_all()

    async def finish(self, i: int, job: Job, exc: BaseException | None, elapsed: float) -> None:
        """Ack, NAK or TERM by the handler's outcome."""
        self.table.observe(elapsed)
        self.sizer.job_done(elapsed)
        if self.guard:                   # the done-marker before the ack; a failed job's lease released
            await self.guard.after(job, exc is None)
        if exc is None:
            await self.ack(i, job)
        elif isinstance(exc, Retry):
            await self.settle(i, job, nak_payload(exc.delay), "nak", str(exc))
        elif isinstance(exc, Reject):
            await self.reject(i, job, exc.reason)
        elif isinstance(exc, Exception):
            log.error("worker %d: handler failed on seq=%d delivery=%d", self.spec.slot, job.stream_seq,
                      job.delivery, exc_info=exc)
            delay = retry_delay(self.wcfg.retry_backoff, job.delivery)
            await self.settle(i, job, nak_payload(delay), "nak", f"{type(exc).__name__}: {exc}"[:200])
        else:                            # SystemExit from a handler: a crash, not an outcome
            log.error("worker %d: handler raised %s on seq=%d; exiting without ack",
                      self.spec.slot, type(exc).__name__, job.stream_seq)
            os._exit(EXIT_CRASHED)

    async def ack(self, i: int, job: Job, outcome: str = "ack") -> None:
        if self.wcfg.double_ack:
            try:
                await self.nc.request(self.reply_of(i), b"+ACK", timeout=5.0)
            except Exception as exc:
                log.warning("worker %d: double ack of seq=%d not confirmed: %s", self.spec.slot, job.stream_seq, exc)
            else:
                self.table.count(OUTCOME_COUNTERS[outcome])
                self.report(job, outcome, "")
                self.table.release(i)
                return
        await self.settle(i, job, b"+ACK", outcome, "")

    async def settle(self, i: int, job: Job, payload: bytes, outcome: str, reason: str) -> None:
        """Publish the ack/nak/term and keep the entry until a flush confirms it."""
        await self.nc.publish(self.reply_of(i), payload)
        self.table.mark(i, slots.ACKED if outcome in ACKS else slots.SETTLED)
        self.table.count(OUTCOME_COUNTERS[outcome])
        self.report(job, outcome, reason)
        self.unconfirmed.append((i, self.nc.stats["reconnects"], outcome in ACKS))
        self.wake_settle.set()

    def report(self, job: Job, outcome: str, reason: str) -> None:
        # Only what explains a future redelivery (or follows one) goes to the parent: acks of
        # first deliveries, the hot path, stay in the table counters.
        if outcome != "ack" or job.delivery > 1:
            if outcome == "duplicate":   # the parent's ledger knows acks, naks and terms
                outcome, reason = "ack", "duplicate: already done"
            self.emit(ev="settled", seq=job.stream_seq, delivery=job.delivery, outcome=outcome, reason=reason)

    def reply_of(self, i: int) -> str:
        return self.replies[i]

    async def reject(self, i: int, job: Job, reason: str) -> None:
        try:
            await dead_letter(self.nc, self.spec.cfg, job, reason)
        except Exception as exc:
            log.error("worker %d: cannot dead-letter seq=%d (%s); NAKing it instead", self.spec.slot, job.stream_seq, exc)
            await self.settle(i, job, nak_payload(retry_delay(self.wcfg.retry_backoff, job.delivery)), "nak",
                              f"dead-letter failed: {exc}")
            return
        await self.settle(i, job, b"+TERM " + reason.encode()[:200], "term", reason)
        log.warning("worker %d: job seq=%d subject=%s rejected by the handler (TERM): %s", self.spec.slot,
                    job.stream_seq, job.subject, reason, extra={"event": "rejected", "seq": job.stream_seq})

    async def settler(self) -> None:
        while not self.closing:
            await self.wake_settle.wait()
            self.wake_settle.clear()
            await self.confirm_settled()
            if not self.closing:
                await asyncio.sleep(SETTLE_MIN_INTERVAL)
        await self.confirm_settled()

    async def confirm_settled(self) -> None:
        """A fence (supervisor/natsfix.py) proves the server has read every ack sent before it on
        the same connection. An ack sent on a connection that has died since is sent again (acking
        twice is harmless); a NAK or TERM is not, since by now it could hit another worker's
        delivery of the job: if it was lost, the job comes back after AckWait."""
        if not self.unconfirmed:
            return
        batch, self.unconfirmed = self.unconfirmed, []
        try:
            await self.nc.fence(timeout=5)
        except Exception as exc:
            log.warning("worker %d: fence failed (%s); acks stay unconfirmed", self.spec.slot,
                        exc or type(exc).__name__)
            self.unconfirmed = batch + self.unconfirmed
            return
        current = self.nc.stats["reconnects"]
        for i, generation, was_ack in batch:
            if generation != current and was_ack:
                await self.nc.publish(self.replies[i], b"+ACK")
                self.unconfirmed.append((i, current, True))
            else:
                self.table.release(i)
        self.wake_pull.set()
        if self.unconfirmed:
            self.wake_settle.set()

    # -- reporting rare events to the parent

    def emit(self, **event: Any) -> None:
        os.write(self.spec.events_fd, json.dumps(event, separators=(",", ":")).encode() + b"\n")


# ---------------------------------------------------------------- small pure helpers

async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def call_handler(handler: Callable[[Job], Any], job: Job, loop: asyncio.AbstractEventLoop
                 ) -> tuple[BaseException | None, float]:
    """In a handler thread: run one job; (the exception it raised or None, seconds it took)."""
    started = time.monotonic()
    try:
        result = handler(job)
        if inspect.isawaitable(result):          # a sync callable that returned a coroutine
            asyncio.run_coroutine_threadsafe(_awaited(result), loop).result()
    except BaseException as exc:
        return exc, time.monotonic() - started
    return None, time.monotonic() - started


def describe_exception(exc: BaseException) -> str:
    """`RuntimeError: message (file.py:12)`, the innermost frame being where it was raised."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f" ({os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno})" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


def make_job(msg: Any) -> Job:
    sseq, cseq, delivery = parse_ack_reply(msg.reply)
    headers = {k: v for k, v in (msg.headers or {}).items() if isinstance(k, str)}
    return Job(data=msg.data, subject=msg.subject, headers=headers, stream_seq=sseq, consumer_seq=cseq,
               delivery=delivery, msg_id=headers.get("Nats-Msg-Id"), stream=ack_reply_stream(msg.reply))


def pending_after(reply: str) -> int:
    """Messages pending for the consumer after this one, from a $JS.ACK reply subject (v1 or v2)."""
    t = reply.split(".")
    return int(t[8 if len(t) == 9 else 10])


def parse_ack_reply(reply: str) -> tuple[int, int, int]:
    """(stream seq, consumer seq, delivery count) from a $JS.ACK reply subject (v1 or v2 form)."""
    t = reply.split(".")
    at = 4 if len(t) == 9 else 6         # v2 adds domain and account hash after $JS.ACK
    return int(t[at + 1]), int(t[at + 2]), int(t[at])


def ack_reply_stream(reply: str) -> str:
    """The stream name in a $JS.ACK reply subject: $JS.ACK.<stream>... (v1) or
    $JS.ACK.<domain>.<account hash>.<stream>... (v2)."""
    t = reply.split(".")
    return t[2] if len(t) == 9 else t[4]


def nak_payload(delay: float) -> bytes:
    if delay <= 0:
        return b"-NAK"
    return b'-NAK {"delay":%d}' % int(delay * 1e9)


def retry_delay(backoff: tuple[float, ...], delivery: int) -> float:
    if not backoff:
        return 0.0
    return backoff[min(delivery, len(backoff)) - 1]


DLQ_HEADER = "Supervisor-Dead-Letter-"


async def dead_letter(nc: Any, cfg: Any, job: Job, reason: str, extra: dict[str, str] | None = None) -> None:
    """Copy a job to restart.dead_letter_subject with headers that say where it came from and why.

    With a dead-letter stream the copy is confirmed by a PubAck before the caller TERMs the
    original; without one it is a plain publish for whoever listens."""
    subject = cfg.restart.dead_letter_subject
    if not subject:
        return
    headers = {k: v for k, v in job.headers.items() if k != "Nats-Msg-Id"}
    if job.msg_id:
        headers[DLQ_HEADER + "Msg-Id"] = job.msg_id
    headers.update({
        DLQ_HEADER + "Stream": cfg.stream.name,
        DLQ_HEADER + "Sequence": str(job.stream_seq),
        DLQ_HEADER + "Subject": job.subject,
        DLQ_HEADER + "Deliveries": str(job.delivery),
        DLQ_HEADER + "Reason": reason[:500],
    })
    headers.update(extra or {})
    # A worker that dies between this copy and its TERM copies again on redelivery: the
    # dead-letter stream's duplicate window folds the two into one.
    headers["Nats-Msg-Id"] = f"dlq-{cfg.stream.name}-{job.stream_seq}"
    if cfg.restart.dead_letter_stream:
        await nc.jetstream().publish(subject, job.data, headers=headers, timeout=5.0)
    else:
        await nc.publish(subject, job.data, headers=headers)
    dead_log.warning("job seq=%d subject=%s dead-lettered to %s: %s", job.stream_seq, job.subject, subject, reason,
                     extra={"event": "dead_letter", "seq": job.stream_seq})
