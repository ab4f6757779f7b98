"""The worker process: become a clean child after fork, then pull -> handle -> ack.

One worker = one process, one uvloop loop, one NATS connection, bound to the durable pull
consumer every other worker shares. `Worker` is the loop that wires the worker's rooms:

    puller.py    raw pull requests and their credits, sized by pulls.py
    threads.py   sync handlers' threads, which take their next job themselves
    workers/middleware/   the chain every job runs through (the [idempotency] guard among it)
    settle.py    ack, NAK or TERM, and the fence that proves the server has it
    reack.py     acks sent again, until confirmed, when the consumer's leader changes
    shutdown.py  the way out: give back what will not run, wait for what runs
    orphan.py    the parent: rare events to it (events.py), and what to do once it is gone

and keeps the mode (workers/protocol/modes.py), the queue of pulled jobs, and running them. Every
message is recorded in the shared slot table before anything else happens, so the parent
always knows what this process holds.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import random
import signal
import threading
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any, NoReturn

import setproctitle

from workers import Context, Job, Pause
from workers.middleware.builtin import instances
from workers.middleware.chain import Chain
from workers.middleware.limits import Limits, Wake
from workers.protocol import slots
from workers.protocol.events import Event, PauseAsked, Ready, RecycleDue, Redelivered, Settled
from workers.protocol.exits import EXIT_CONNECT_FAILED, EXIT_CRASHED, EXIT_DRAINED, EXIT_INIT_FAILED
from workers.protocol.fork import neutralise_inherited_fds, scrub_child_env, set_parent_death_signal
from workers.protocol.modes import RETIRING, SERVING, STOPPING
from workers.runtime.ordering import Ordering
from workers.runtime.orphan import ParentWatch
from workers.runtime.outcome import Outcomes
from workers.runtime.puller import Puller
from workers.runtime.pulls import PullSizer, fair_share
from workers.runtime.reack import Reacker
from workers.runtime.settle import Settler
from workers.runtime.shutdown import Shutdown
from workers.runtime.solo import AsyncGate
from workers.runtime.spec import ChildSpec
from workers.runtime.threads import OUTCOME_EVERY, HandlerThreads

log = logging.getLogger("worker")

LIVENESS_EVERY = 0.25       # a worker proves its NATS connection with a PING/PONG this often ...
LIVENESS_TIMEOUT = 2.0      # ... and gives up waiting for the PONG after this
CLOSE_AFTER = 1.0           # past the wind-down's deadline, the close waits for NATS this long at most
LOOKAHEAD = 4               # [ordering]: jobs parked ahead per handler, beyond those it runs (pulls.py)


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
    neutralise_inherited_fds(keep={0, 1, 2, spec.events_fd, *spec.keep_fds})
    scrub_child_env(os.environ)              # only the main process talks to systemd
    random.seed()
    asyncio.events._set_running_loop(None)   # we were forked from inside the parent's loop
    setproctitle.setproctitle(f"supervisor: worker {spec.slot} [{spec.cfg.stream.name}/{spec.cfg.consumer.name}]")


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

class Worker:
    """The worker's loop, wiring its rooms: pulling (workers/runtime/puller.py), the handler threads for
    sync handlers (workers/runtime/threads.py), settling and fencing (workers/runtime/settle.py), the shutdown
    path (workers/runtime/shutdown.py), its parent (workers/runtime/orphan.py), jobs parked for their
    key's turn (workers/runtime/ordering.py). It owns the mode, the queue of pulled jobs, and running
    them. Long because it is where those rooms meet: what each asks of the others (the Protocols
    in their modules) is answered here, in methods of a few lines each; the room folder is full."""

    def __init__(self, spec: ChildSpec):
        cfg = spec.cfg
        self.spec = spec
        self.table = spec.table
        self.wcfg = cfg.workers
        self.stream, self.consumer = cfg.stream.name, cfg.consumer.name
        self.is_async = inspect.iscoroutinefunction(spec.handler)
        self.queue: deque[tuple[Any, int, Job]] = deque()   # pulled, not started
        self.running = 0                 # taken from the queue (sync: handed to the threads), not finished
        sizer = PullSizer(self.wcfg.concurrency, self.wcfg.batch,
                          fair_share(cfg.consumer.max_ack_pending, self.wcfg.count),
                          threads=not self.is_async, batching=0.0 if cfg.ordering.key else OUTCOME_EVERY,
                          lookahead=LOOKAHEAD * self.wcfg.concurrency if cfg.ordering.key else 0)
        self.pulls = Puller(self, spec.slot, sizer, spec.job_limit,
                            f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.consumer}")
        self.reacker = Reacker(self, spec.slot, self.stream, cfg.consumer)
        self.settler = Settler(self, spec.slot, self.wcfg.double_ack, self.table.entries, acked=self.reacker.sent)
        self.outcomes = Outcomes(self.settler, spec.slot, cfg, lambda: self.nc)
        self.started_jobs = 0
        self.generation = 0              # reconnects seen: what was sent on a dead connection may be lost
        self.mode = SERVING
        self.wake_pull: asyncio.Event = Wake()   # with [limits] it also nudges parked jobs (Limits.attach)
        self.wake_run = asyncio.Event()
        self.changed = asyncio.Event()
        self.stop = asyncio.Event()
        self.grace = spec.graceful_timeout
        self.nc: Any = None
        self.runners: list[asyncio.Task] = []
        # Handler threads start jobs under this lock, and the switch to STOPPING takes it: once a
        # shutdown has NAKed what runs, no handler thread can start another job behind its back.
        self.start_lock = threading.Lock()
        self.chain = Chain(spec.handler)  # every job runs through it: workers/middleware/chain.py
        self.limits: Limits | None = None  # [limits]: jobs waiting for theirs are parked there
        # [ordering]: jobs wait, parked, until they are the first of their key in the stream
        self.ordering = Ordering(cfg, spec.slot, self) if cfg.ordering.key else None
        self.gate = AsyncGate(spec.suspects)   # suspects run alone (workers/runtime/solo.py)
        self.threads = HandlerThreads(self, self.start_lock, self.wcfg.concurrency, spec.job_limit,
                                      batching=0.0 if cfg.ordering.key else OUTCOME_EVERY)
        self.shutdown = Shutdown(self, spec.slot)
        self.parent = ParentWatch(self, spec)

    # -- lifecycle

    async def run(self) -> int:
        self.table.beat()
        try:
            self.nc = await self.spec.connect()
            await self.nc.jetstream().consumer_info(self.stream, self.consumer)
        except Exception as exc:
            log.error("worker %d: cannot connect or bind %s/%s: %s", self.spec.slot, self.stream,
                      self.consumer, str(exc) or type(exc).__name__)
            return EXIT_CONNECT_FAILED
        self.table.server_answered(time.monotonic())
        loop = asyncio.get_running_loop()
        try:
            middleware = instances(self.spec.middleware, self.spec.cfg, self.is_async,   # made here, after fork
                                   self.spec.crashes)
            self.limits = next((mw for _, mw in middleware if isinstance(mw, Limits)), None)
            if self.limits is not None:       # our table, and what parked jobs go by (Limits.attach)
                self.limits.attach(self)
            await self.chain.setup(middleware, Context(self.spec.slot, os.getpid(), self.nc, loop, self.spec.cfg,
                                                       self.is_async))
        except Exception as exc:          # read by the parent like a failing init hook
            log.error("worker %d: starting workers.middleware raised %s", self.spec.slot, describe_exception(exc))
            log.debug("workers.middleware traceback", exc_info=True)
            return EXIT_INIT_FAILED
        if self.ordering is not None:
            await self.ordering.start(self.nc)
        self.pulls.inbox = self.nc.new_inbox()
        self.sub = await self.nc.subscribe(self.pulls.inbox, pending_msgs_limit=0, pending_bytes_limit=0)
        self.nc.deliver_directly(self.sub, self.on_message)     # from the read loop: supervisor/nats/fix.py
        await self.reacker.start()
        loop.add_signal_handler(signal.SIGTERM, self.on_sigterm)
        loop.add_signal_handler(signal.SIGUSR1, self.on_sigusr1)
        settling = self.essential(self.settler.run())
        beating = self.essential(self.heartbeat())
        tasks = [self.essential(c) for c in (self.liveness(), self.pulls.run(), self.reacker.run())]
        if self.is_async:
            self.runners = [self.essential(self.runner()) for _ in range(self.wcfg.concurrency)]
        else:
            self.runners = [self.essential(c) for c in (self.runner(), self.threads.finisher())]
            self.threads.start_threads(loop)
        self.table.set_state(slots.READY)
        self.emit(Ready())
        await self.stop.wait()
        await self.shutdown.wind_down()
        self.settler.close(until=self.shutdown.deadline)
        for task in tasks + self.runners:
            task.cancel()
        self.threads.stop_threads()
        if self.ordering is not None:
            self.ordering.close()
        await settling                 # never cancel a task inside a flush: see supervisor/nats/fix.py
        self.reacker.close()
        beating.cancel()               # only now: waiting for NATS to take our acks is no hang
        if self.limits is not None and self.threads.busy:
            self.limits.keep_slots()   # a handler thread runs on until we exit: its slots with it (F23)
        await self.chain.close()       # e.g. the guard's leases of jobs we did not finish: freed
        # An orphan that announced NAKs: its peers may count it gone (and its NAKs read, if fenced).
        await self.parent.goodbye(fenced=not self.settler.unconfirmed)
        await self.close_connection()
        self.parent.events.drain(timeout=1.0)   # the last settles' events, if a busy parent left no room
        return EXIT_DRAINED

    def essential(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """A task the worker cannot do without. If one fails, the worker exits as crashed: the
        parent NAKs what it held and the death explains the reruns. Carrying on would keep those
        jobs (and the slot) until AckWait with nobody left to settle them."""
        task = asyncio.ensure_future(coro)
        task.set_name(getattr(coro, "__qualname__", repr(coro)))
        task.add_done_callback(self.essential_ended)
        return task

    def essential_ended(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        name = task.get_name()
        log.error("worker %d: %s failed; exiting so the supervisor NAKs its jobs", self.spec.slot, name,
                  exc_info=task.exception(), extra={"event": "worker_task_failed", "task": name})
        os._exit(EXIT_CRASHED)

    def on_sigterm(self) -> None:
        """The supervisor's stop, or its death (PR_SET_PDEATHSIG: workers/runtime/orphan.py)."""
        if not self.parent.gone():
            self.set_mode(STOPPING)

    def on_sigusr1(self) -> None:
        if self.mode == SERVING:
            self.set_mode(RETIRING)

    def set_mode(self, mode: str) -> None:
        with self.start_lock:            # handler threads read the mode under it (workers/runtime/threads.py)
            self.mode = mode
        self.stop.set()
        for event in (self.wake_pull, self.wake_run, self.changed):
            event.set()
        self.gate.wake()

    async def heartbeat(self) -> None:
        every = min(0.5, self.wcfg.heartbeat_timeout / 4)   # the parent calls a beat older than 1.5 s stale
        while True:
            self.table.beat()
            if self.nc.stats["reconnects"] != self.generation:
                self.reconnected()
            self.parent.beat()           # the event pipe's backlog; the supervisor gone? (workers/runtime/orphan.py)
            await asyncio.sleep(every)

    async def liveness(self) -> None:
        """Prove the connection works, not just the process: a PING/PONG every LIVENESS_EVERY,
        its time in the table. A worker whose connection went half-open keeps beating, but the
        parent stops keeping its jobs alive with +WPI once this goes stale. Its round trip, loop
        and GIL latency included, is one of the samples pull sizing hides (workers/runtime/pulls.py).
        A fence, not a bare flush: its PING follows what we published before it, so its PONG also
        proves the server read our pull requests (Puller.server_read), and its round trip tells
        a stall from a quick answer (Puller.answered: when lost requests may be given up)."""
        while True:
            sent = time.monotonic()
            try:
                await self.nc.fence(timeout=LIVENESS_TIMEOUT)
            except Exception:
                self.pulls.unanswered()  # stale: the parent sees the time stop moving
            else:
                self.table.server_answered(sent)     # the PING's send time: slots.py SERVER_SEEN
                self.pulls.answered(sent, time.monotonic())
                self.pulls.sizer.round_trip(time.monotonic() - sent)
            self.threads.collect()       # outcomes kept back by a handler thread busy with a long job
            await asyncio.sleep(LIVENESS_EVERY)

    def reconnected(self) -> None:
        """Pull requests of the old connection may still deliver (Puller.reconnected); acks written
        to it may be lost (Settler.confirm sends those again)."""
        self.generation = self.nc.stats["reconnects"]
        log.info("worker %d: reconnected to NATS; pulling afresh", self.spec.slot)
        self.pulls.reconnected(time.monotonic())
        self.reacker.trigger("reconnected to NATS")   # acks the old server took may not have reached a quorum
        self.wake_pull.set()
        self.settler.wake_settle.set()
        self.changed.set()

    async def close_connection(self) -> None:
        """Hand NATS what we published last (an orphan's goodbye) and close, by the wind-down's
        deadline (CLOSE_AFTER past it at most). Not nats-py's drain(): on a stalled link it waits
        drain_timeout for the subscriptions, then flush's own timeout (20 s past graceful_timeout
        in all), while the parent's in-transit check for a request the deadline gave up needs
        our exit soon (F20: its lower bound ages). Every ack was fenced before (or given up at
        the deadline, NAKed by the parent at our exit); what close() still writes is best effort."""
        left = max(0.0, self.shutdown.deadline - time.monotonic()) + CLOSE_AFTER
        try:
            await self.nc.flush(timeout=left)
        except Exception as exc:
            log.warning("worker %d: closing the connection: %s", self.spec.slot, str(exc) or type(exc).__name__)
        try:
            await asyncio.wait_for(self.nc.close(), CLOSE_AFTER)   # its socket's last writes, on a stalled link too
        except Exception as exc:
            log.debug("worker %d: close: %s", self.spec.slot, str(exc) or type(exc).__name__)

    # -- receiving (the requests themselves: workers/runtime/puller.py)

    def busy(self) -> int:
        """Jobs that take a handler: queued, running, and parked ones that count as taking one
        (workers/middleware/limits.py, workers/runtime/ordering.py `occupying`)."""
        return len(self.queue) + self.running + (self.limits.occupying() if self.limits else 0) + \
            (self.ordering.occupying() if self.ordering else 0)

    def outstanding(self) -> int:
        """Jobs pulled and not finished: what pull sizing counts besides the credits. Jobs parked
        for their key's turn fill the look ahead (pulls.py); jobs waiting for a full limit are
        not here but in `limit_state`."""
        return self.busy() + self.waiting()

    def limit_state(self) -> tuple[int, bool]:   # jobs parked for a full limit; one held for its turn (parking.py)
        return self.limits.pull_state() if self.limits else (0, False)

    def parked(self) -> int:
        """Jobs pulled and waiting for their limits or their key's turn: not started, not queued."""
        return (len(self.limits.parked) if self.limits else 0) + (self.ordering.parked() if self.ordering else 0)

    def waiting(self) -> int:
        """Jobs parked for their key's turn: received, but not yet counted against max_jobs."""
        return self.ordering.waiting() if self.ordering else 0

    def take_key_parked(self) -> list[tuple[Any, int, Job]]:
        """A retirement: what waits for its key's turn, in stream order (workers/runtime/shutdown.py)."""
        return self.ordering.take_parked() if self.ordering else []

    def take_parked(self) -> list[tuple[Any, int, Job]]:
        """A drain: what waits for its key's turn, in stream order, then what waits for a limit."""
        return (self.ordering.take_parked() if self.ordering else []) + \
            (self.limits.take_parked() if self.limits else [])

    def release_limits(self, job: Job) -> None:
        if self.limits is not None:
            self.limits.finished(job)

    async def on_message(self, subject: str, reply: str, data: bytes, headers: dict[str, str] | None) -> None:
        if not reply:
            self.reacker.on_pull_status(headers or {})   # a leader change, or no leader, may have lost acks
            self.pulls.on_status(headers or {})
            return
        job, pending = make_job(subject, reply, data, headers)
        # Record it before anything else, credits after: a death between the two leaves the
        # parent counting the message twice (held and in transit), never zero times.
        i = self.table.hold(job.stream_seq, job.consumer_seq, job.delivery, reply.encode(), now := time.monotonic())
        self.pulls.arrived(pending, now)
        if i >= 0:
            self.settler.replies[i] = reply
        if job.delivery > 1:
            self.emit(Redelivered(job.stream_seq, job.delivery))
        if i < 0:                        # table full (more came than asked): told first, the NAK after
            self.pulls.not_started()
            self.emit(Settled(job.stream_seq, job.delivery, "nak", "table full"))
            await self.nc.publish(reply, b"-NAK")
            return
        if self.ordering is not None and self.ordering.admit((reply, i, job)):
            self.changed.set()           # it waits for its key's turn without a handler (cleared() next)
            return
        self.cleared((reply, i, job))

    def cleared(self, item: tuple[Any, int, Job]) -> None:
        """A pulled job may start as far as its key goes: on to its limits, or the queue."""
        _, _, job = item
        if self.limits is not None and self.limits.needs(job) and not self.limits.hold_now(job):
            self.limits.park(item, job, self.admitted)   # it waits for its limits without a handler
            self.changed.set()           # a shutdown NAKs it at once; a retirement lets it wait
            return
        self.queue.append(item)
        self.wake_run.set()
        self.changed.set()               # a shutdown NAKs it at once; a retirement runs it

    def admitted(self, item: tuple[Any, int, Job]) -> None:
        """A parked job has its limits: it goes first, so they are held idle as briefly as can be."""
        self.queue.appendleft(item)
        self.wake_run.set()
        self.changed.set()
        self.wake_pull.set()             # it no longer counts as parked

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
                await self.threads.hand_over(chunk)   # its finisher() takes the outcomes
                continue
            try:
                await self.run_async(*chunk[0][1:])
            finally:
                self.running -= len(chunk)
                self.changed.set()
                self.wake_pull.set()

    def take_chunk(self) -> list[tuple[Any, int, Job]]:
        """An async runner's next job; for the handler threads, everything queued."""
        n = 1 if self.is_async else len(self.queue)
        return [self.queue.popleft() for _ in range(n)]

    def count_start(self) -> None:
        self.started_jobs += 1
        if self.started_jobs == self.spec.job_limit:
            # The parent starts our replacement now (we take no further job: pull_size) and
            # retires us once the replacement is ready and our last job is done.
            self.emit(RecycleDue(self.started_jobs))

    async def run_async(self, i: int, job: Job) -> None:
        """An async handler, on the loop."""
        if self.mode == STOPPING or not await self.gate.start(job.stream_seq, lambda: self.mode == STOPPING):
            await self.shutdown.nak_unstarted_job(i, job)
            return
        self.table.start(i)
        ran = await self.chain.run_async(job, self.count_start)   # a cancellation (graceful_timeout
        self.gate.done(job.stream_seq)                            # ran out) goes on: abandon() NAKs it
        await self.finish(i, job, ran.exc, ran.elapsed, ran.started)

    async def finish(self, i: int, job: Job, exc: BaseException | None, elapsed: float, started: bool = True) -> None:
        """Ack, NAK or TERM by the outcome of the job's chain (its handler's, or a hook's)."""
        self.finished(job, exc, elapsed, started)
        await self.outcomes.settle(i, job, exc)

    def finished(self, job: Job, exc: BaseException | None, elapsed: float, started: bool) -> None:
        """A job's chain is done. One whose handler never ran (a duplicate, a hook's Retry) is not
        one of max_jobs (R1), nor a sample of job times; its limits go back whichever hook stopped
        it. A Pause (workers.Pause) is NAKed like a Retry, and the parent pauses the consumer."""
        self.release_limits(job)
        if isinstance(exc, Pause):
            self.emit(PauseAsked(exc.delay, exc.reason, job.stream_seq))
        if started:
            self.table.observe(elapsed)
            self.pulls.sizer.job_done(elapsed)
        else:
            self.pulls.not_started()

    # -- reporting rare events to the parent

    def emit(self, event: Event) -> None:
        self.parent.tell(event)

    async def before_nak(self, job: Job, reason: str, delay: float, held_at: float) -> bool:
        return await self.parent.announce_nak(job, reason, delay, held_at)


# ---------------------------------------------------------------- small pure helpers

def describe_exception(exc: BaseException) -> str:
    """`RuntimeError: message (file.py:12)`, the innermost frame being where it was raised."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = f" ({os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno})" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


def make_job(subject: str, reply: str, data: bytes, headers: dict[str, str] | None) -> tuple[Job, int]:
    """The job a message is, and how many more the stream held for the consumer after it (from
    its $JS.ACK reply subject, read once: this runs for every message)."""
    stream, sseq, cseq, delivery, pending = parse_ack_reply(reply)
    headers = {k: v for k, v in headers.items() if isinstance(k, str)} if headers else {}
    # Job(...) itself, without its frozen __init__'s object.__setattr__ per field (a third of the
    # cost of taking a message in; tests/unit/test_take_message.py checks the two are equal).
    job = _new(Job)
    vars(job).update(data=data, subject=subject, headers=headers, stream_seq=sseq, consumer_seq=cseq,
                     delivery=delivery, msg_id=headers.get("Nats-Msg-Id"), stream=stream)
    return job, pending


_new = object.__new__


def parse_ack_reply(reply: str) -> tuple[str, int, int, int, int]:
    """(stream, stream seq, consumer seq, delivery count, messages pending after this one) from a
    $JS.ACK reply subject: $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<time>.<pending>
    (v1), or with <domain>.<account hash> after $JS.ACK and a token more at the end (v2)."""
    t = reply.split(".")
    at = 2 if len(t) == 9 else 4
    return t[at], int(t[at + 3]), int(t[at + 4]), int(t[at + 2]), int(t[at + 6])
