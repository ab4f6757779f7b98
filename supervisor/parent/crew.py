"""One pool as the parent runs it: a crew of workers on one durable consumer.

A pool ([pools.NAME], or `default` without any) has its own effective config (config/pools.py),
its own handler, and every room that belongs to one consumer: its slots (pool.py), its restart
policy (a crash loop halts this pool alone), its crash ledger, its peers on that consumer, what
was in transit to its dead workers, its deaths, its watch, its counters, its autoscaler, its
monitor. The arbiter's loop walks each step of a tick for every crew in turn, each (step, crew)
isolated (LoopSteps.guard), so one pool's failing step never skips another's.

What a crew is handed by its parent (the arbiter, `Parent` below): the loop and its queue (every
change of state is posted to the one writer), the alert list, the NATS connection, the stop in
progress, the count of all pools together. The logic here is what the arbiter did for its one
pool before pools existed, moved, not changed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import psutil

from supervisor.config import Config
from supervisor.core.ledger import CrashLedger
from supervisor.core.policy import BootFailures, RestartPolicy
from supervisor.logcontext import POOL
from supervisor.nats import limits
from supervisor.parent.loopsteps import LoopSteps
from supervisor.parent.pool import Pool
from supervisor.parent.process import WorkerProcess
from supervisor.parent.safety.deaths import Deaths
from supervisor.parent.safety.in_transit import SLACK, InTransit, settled_once
from supervisor.parent.safety.peers import SUSPECT_GRACE, Peers
from supervisor.parent.safety.watch import Watch
from supervisor.parent.scaler import Scaler
from supervisor.parent.stats import Stats
from workers.protocol import slots
from workers.protocol.crashes import CrashBoard
from workers.protocol.events import AcksResent, Event, PauseAsked, Ready, RecycleDue, Redelivered, Settled, Unsent
from workers.protocol.exits import CHILD_EXIT_REASONS, EXIT_CONNECT_FAILED
from workers.runtime.solo import SuspectBoard
from workers.runtime.spec import ChildSpec

log = logging.getLogger("supervisor")

STORM_LOG_EVERY = 60.0      # while workers keep dying fast, say so this often
RELEASE_RETRY = 0.5         # a dead worker's limit slots: tried again this often until released, or their lease ran out

# (handler, init, workers.middleware as (entry, class)): a pool's code, imported in the parent
Code = tuple[Callable, Callable | None, tuple]


class Parent(Protocol):
    """What a crew uses of the arbiter."""
    loop: asyncio.AbstractEventLoop
    nc: Any
    steps: LoopSteps
    wakeup: asyncio.Event
    stopping: str | None
    server_dies_with_parent: bool
    fleet_key: str                        # our fleet heartbeat's key: an orphan claims its jobs there

    def post(self, work: Callable[[], Any], wake: bool = True) -> None: ...

    def apply_posted(self) -> None: ...

    def spawn_task(self, coro: Any) -> None: ...

    def alert(self, kind: str, message: str, pool: str = "") -> None: ...

    def check_all_ready(self) -> None: ...

    def scale(self, n: int, source: str, pool: str | None = None) -> str | None: ...

    def connect_worker(self, label: str) -> Any: ...


class Crew:
    """One pool's rooms and what the loop does with them. Long because it is every per-consumer
    part of the parent: forking and the events of its workers, reaping its dead, its audit, its
    halt, its reload; each method hands the work to a room."""

    def __init__(self, name: str, cfg: Config, code: Code, parent: Parent, label: str = ""):
        self.name = name
        self.label = label                 # the pool's name in logs, alerts and metrics ("" without [pools.*])
        self.cfg = cfg                     # the pool's effective config
        self.parent = parent
        self.nc = parent.nc
        self.handler, self.init, self.middleware = code
        self.restarts = RestartPolicy(cfg.restart.backoff_initial, cfg.restart.backoff_max,
                                      cfg.restart.boot_failures_to_halt)
        self.ledger = CrashLedger(cfg.consumer.ack_wait, cfg.restart.poison_after_crashes, cfg.consumer.backoff)
        self.in_transit = InTransit(cfg, self.nc, self.ledger)
        self.peers = Peers(self.nc, cfg.stream.name, cfg.consumer.name, self.ledger, self.post, self.in_transit)
        self.suspects = SuspectBoard()      # jobs on poison probation, run alone by every worker (workers/runtime/solo.py)
        self.crashes = CrashBoard()         # the death each redelivery comes back from (workers/protocol/crashes.py)
        self.deaths = Deaths(cfg, self.nc, self.ledger, self.peers, self.alert, self.suspects, self.crashes)
        self.stats = Stats(self.living)
        self.pool = Pool(cfg, self.fork, self.restarts, self.stats, self.alert)
        self.watch = Watch(cfg, self.nc, self.ledger, self.deaths, self.stats, self.alert)
        self.dead: collections.deque[WorkerProcess] = collections.deque()
        self.autoscale = Scaler(self)
        self.monitor: Any = None            # its Monitor (parent/tasks/monitor.py), set by supervisor.py ...
        self.tasks: list[asyncio.Task] = []  # ... and the task running it
        self.halted = ""                    # why this pool stopped at boot (a crash loop); "" while it runs
        self.last_storm_log = 0.0

    # ------------------------------------------------------------ what the rooms and the scaler read

    @property
    def stopping(self) -> str | None:
        return self.parent.stopping

    def living(self) -> list[WorkerProcess]:
        return self.pool.living()

    def post(self, work: Callable[[], Any], wake: bool = True) -> None:
        """Queue work for the loop, to run as this pool's (its log lines name the pool)."""
        self.parent.post(lambda: self.within(work), wake)

    def within(self, work: Callable[[], Any]) -> Any:
        with self.context():
            return work()

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """This pool's name on every log line logged inside (supervisor/logcontext.py POOL)."""
        token = POOL.set(self.label)
        try:
            yield
        finally:
            POOL.reset(token)

    def alert(self, kind: str, message: str) -> None:
        self.parent.alert(kind, message, self.label)

    def scale(self, n: int, source: str) -> None:
        """The autoscaler's way to set this pool's count (scaler.py Host)."""
        self.parent.scale(n, source, self.name)

    # ------------------------------------------------------------ starting workers

    def fork(self, w: WorkerProcess) -> None:
        loop = self.parent.loop
        try:
            w.spawn(loop, self.child_spec, self.on_exit, self.on_events)
        except OSError:
            w.close(loop)
            raise

    def child_spec(self, w: WorkerProcess, events_fd: int) -> ChildSpec:
        who = f"{self.label}/{w.slot}" if self.label else str(w.slot)
        return ChildSpec(slot=w.slot, parent_pid=os.getpid(), table=w.table, events_fd=events_fd, cfg=self.cfg,
                         handler=self.handler, init=self.init, middleware=self.middleware,
                         connect=lambda: self.parent.connect_worker(who),
                         job_limit=w.job_limit, suspects=self.suspects, crashes=self.crashes,
                         graceful_timeout=w.graceful_timeout,
                         server_dies_with_parent=self.parent.server_dies_with_parent,
                         fleet_key=self.parent.fleet_key)

    # ------------------------------------------------------------ events from its workers

    def on_exit(self, w: WorkerProcess) -> None:
        self.parent.loop.remove_reader(w.pidfd)
        self.dead.append(w)
        self.parent.wakeup.set()

    def on_events(self, w: WorkerProcess) -> None:
        events = w.read_events()
        if events:
            self.post(lambda: self.apply_events(w, events))

    def apply_events(self, w: WorkerProcess, events: list[Event]) -> None:
        for event in events:
            self.apply_event(w, event)

    def apply_event(self, w: WorkerProcess, event: Event) -> None:
        now = time.monotonic()
        seq = getattr(event, "seq", None)
        if seq is not None:              # a live delivery of it, or its settling: no in-transit NAK for it
            self.in_transit.named_by_worker(seq, now, getattr(event, "delivery", 0))
        match event:
            case Ready():
                self.pool.worker_ready(w, now)
                self.parent.check_all_ready()
            case Redelivered(seq, delivery):
                why = self.ledger.redelivered(now, seq, delivery)
                self.peers.seen(seq, delivery)
                log.info("job seq=%d redelivered (delivery %d) to worker %d: %s", seq, delivery, w.slot,
                         why or "no explanation yet", extra={"event": "redelivered", "seq": seq, "delivery": delivery,
                                                             "slot": w.slot, "worker_pid": w.pid, "why": why})
            case Settled(seq, delivery, outcome, _, at, delay, held_at):
                self.ledger.settled(now, seq, delivery, outcome)
                if outcome == "nak":
                    self.peers.announce(seq, f"NAKed by a worker at delivery {delivery}")
                    self.in_transit.worker_nak(seq, delivery, at, delay, held_at, now)
                elif delivery > 1:
                    self.peers.settled(seq, delivery, outcome)
            case Unsent(seq, delivery, outcome, error):    # nats-py refused it: the job may come back
                why = f"its {outcome} by worker {w.slot} (pid {w.pid}) was not sent ({error})"
                self.ledger.expect(seq, why, delivery, retroactive=False)
                self.peers.announce(seq, why)
            case AcksResent(why, resent, confirmed, unconfirmed):   # after a consumer leader change
                self.ledger.acks_resent(resent, confirmed, list(unconfirmed), why)
            case RecycleDue(jobs):           # its last job has started: start its replacement
                w.recycle_reason = f"ran {jobs} jobs (workers.max_jobs)"
                w.last_job_started = True
            case PauseAsked(seconds, reason, seq):   # a handler raised workers.Pause
                self.parent.spawn_task(self.pause(seconds, reason, f"worker {w.slot} (pid {w.pid}), job seq={seq}"))

    async def pause(self, seconds: float, reason: str, by: str) -> None:
        """Pause the consumer fleet-wide (supervisor/nats/limits.py); the monitor logs it once
        every supervisor sees it in ConsumerInfo."""
        try:
            until, moved = await limits.pause(self.nc, self.cfg, seconds, reason, by)
        except Exception as exc:          # the job was NAKed with its delay anyway
            log.warning("cannot pause consumer %s as %s asked: %s", self.cfg.consumer.name, by, exc,
                        extra={"event": "pause_failed"})
            return
        if moved:
            log.warning("pausing consumer %s until %s, as %s asked: %s", self.cfg.consumer.name, until, by, reason,
                        extra={"event": "pause_asked", "until": until, "reason": reason, "by": by})

    # ------------------------------------------------------------ reaping

    async def reap(self) -> None:
        if self.stopping == "quit" and not all(w.reap() for w in self.living()):
            return       # SIGQUIT: NAK once every worker is dead, or a NAK may hand a job to a dying one
        for _ in range(len(self.dead)):
            w = self.dead.popleft()
            reaped = False
            with self.guard("reap"):
                reaped = w.reap()
            if not reaped:
                self.dead.append(w)             # exited but not waitable yet: next tick (sleep() hurries)
                continue
            await self.reap_one(w)

    def guard(self, step: str) -> Any:
        return self.parent.steps.guard(step, self.label)

    async def reap_one(self, w: WorkerProcess) -> None:
        """Settle a dead worker's jobs and free its slot. Each part is isolated: whatever fails
        (a NATS error in the NAKs above all), the worker is still forgotten and its slot restarted,
        or the pool would shrink by one for good."""
        step = self.guard
        with step("reap"):
            self.apply_events(w, w.read_events())      # whatever it said before dying
        clean = self.exited_cleanly(w)
        cause = w.kill.text if w.kill else w.describe_exit()
        code = w.exit_code()
        if not clean and code in CHILD_EXIT_REASONS:
            cause += f": {CHILD_EXIT_REASONS[code]}"
        with step("reap"):
            # A clean exit too: a drained worker whose fence never came back leaves NAKs only the
            # server's advisory can prove read (F18), and one whose deadline came before its last
            # pull request ended left that request's credits in its table (F20: a loss like a death's).
            self.in_transit.death(time.monotonic(), w.table.header(slots.CREDITS),
                                  f"worker {w.slot} (pid {w.pid})", w.table.server_seen(),
                                  settled_once(w.table.snapshot()), w.pid, w.slot, w.started_at)
            await self.deaths.settle(w, cause, clean)
        with step("reap"):
            self.release_limits(w, clean)
        with step("reap"):
            self.stats.carry(w)
        finished = w.jobs_finished          # read before forget() unmaps its table
        with step("reap"):
            self.forget(w)
        if not clean:
            with step("reap"):
                # Reconnecting, not closed: a connection closed for good (credentials revoked) is
                # no outage to wait out, and its crash loop must still halt.
                nats_down = code == EXIT_CONNECT_FAILED and bool(self.nc and self.nc.is_reconnecting)
                # Nor is a worker that could not reach NATS while others of its pool serve: its own
                # link failed, not the handler or the config (F21: ten such boots halted a pool
                # whose other workers were serving).
                link = code == EXIT_CONNECT_FAILED and not nats_down and self.pool.ready_count() > 0
                self.pool.plan_restart(w, cause, finished, bool(self.stopping), nats_down, counts=not link)

    def release_limits(self, w: WorkerProcess, clean: bool) -> None:
        """A dead worker's limit slots go back now, not after their TTL: any death but a clean
        exit that gave them back itself (its table says it holds none)."""
        caps = [k for k, name in enumerate(w.limit_names) if name in self.cfg.limits and self.cfg.limits[name].concurrency]
        if not caps or (clean and not any(w.table.limit(k)[0] for k in caps)):
            return
        self.parent.spawn_task(self.release_slots(w.pid, w.slot))

    async def release_slots(self, pid: int, slot: int) -> None:
        """Tried again while NATS fails it (our link away, say), until the slots' lease has run
        out anyway (LEASE_TTL after the reap: the worker renewed it last before). One try in an
        outage left a fleet-wide limit blocked for a whole lease after the link was back (seed
        1102: concurrency 1, nothing limited ran for 10 s). A retry purges only a slot whose
        value still names the dead worker (limits.release_worker), by its host, our pid and its
        pid: it stops once that pid is a process again (the OS reuses pids: a new worker of ours,
        of any pool, whose slots it could not tell apart)."""
        until, why = time.monotonic() + limits.LEASE_TTL, "not connected to NATS"
        while time.monotonic() < until:
            if psutil.pid_exists(pid):    # reaped before this: the pid is another process's now
                why = f"pid {pid} is another process's now"
                break
            if self.nc is not None and self.nc.is_connected:
                try:
                    await limits.release_worker(self.nc, self.cfg, pid, slot)
                    return
                except Exception as exc:
                    why = str(exc) or type(exc).__name__
            await asyncio.sleep(RELEASE_RETRY)
        log.warning("worker %d (pid %d): its limit slots were not released (%s); they freed themselves within %ds",
                    slot, pid, why, limits.LEASE_TTL, extra={"event": "limit_release_failed"})

    @staticmethod
    def exited_cleanly(w: WorkerProcess) -> bool:
        """Exit 0 after a drain; or killed by the SIGTERM/SIGUSR1 we sent before it had installed
        its handlers (a worker told to stop while still booting): neither is a crash."""
        if w.kill:
            return False
        if w.exit_code() == 0:
            return True
        asked = w.drain_deadline is not None and w.ready_at is None
        return asked and w.signalled_by() in (signal.SIGTERM, signal.SIGUSR1)

    def forget(self, w: WorkerProcess) -> None:
        self.pool.forget(w)
        self.deaths.forget(w.pid)
        self.watch.forget(w.pid)
        w.close(self.parent.loop)

    # ------------------------------------------------------------ a crash loop at boot

    def boot_halt_due(self) -> bool:
        return self.restarts.halted and not self.halted

    def halt_message(self) -> str:
        boot = self.restarts.boot
        return (f"{boot.count} workers in a row died before becoming ready "
                f"(restart.boot_failures_to_halt={boot.limit}); last: {boot.last_reason}")

    def halt(self, message: str) -> None:
        """Stop this pool alone: its workers retire, its slots stay empty until a SIGHUP (which
        gives it another try) or the next start; the other pools run on."""
        self.halted = message
        self.empty("its pool halted")

    def empty(self, why: str) -> None:
        """Retire every worker and keep the slots empty (a halt; a pool a reload took out)."""
        self.pool.target = 0
        self.pool.restart_at.clear()
        for slot in sorted(self.pool.slots):
            self.pool.retire(self.pool.slots.pop(slot), why)

    def finished(self) -> bool:
        """Nothing of this pool's left to do: no worker, none dead unreaped, and nothing its dead
        left behind (a NAK held back while NATS is away or to be sent once more, a death whose
        in-transit jobs are not yet found, word for its peers). A pool a reload took out leaves
        only then: dropped sooner, its last worker's jobs would wait for AckWait."""
        return not self.living() and not self.dead and not self.deaths.held_back and not self.deaths.renak \
            and not self.in_transit.losses and not any(self.peers.outbox.values())

    def revive(self) -> None:
        """A SIGHUP after a halt: count boot failures from zero and start the workers again."""
        if self.halted:
            log.info("pool %s: starting again after its halt (reload)", self.name,
                     extra={"event": "pool_revived", "pool": self.name})
            self.halted = ""
            self.restarts.boot = BootFailures(self.restarts.boot.limit)
            self.pool.target = self.cfg.workers.count

    # ------------------------------------------------------------ the audit

    async def audit(self) -> None:
        """Share our NAKs with peer supervisors; count redeliveries nobody explained; NAK once more
        a dead worker's job nobody has seen again; find what was in transit to a dead worker;
        say so while workers keep dying fast."""
        step, now = self.guard, time.monotonic
        with step("audit"):
            await self.peers.flush()
        with step("audit"):
            await self.deaths.renak_unseen(self.fresh_view, self.renak_unproven)
        with step("audit"):
            await self.in_transit.step(now(), self.fresh_view, self.links_all_fresh_since, self.peers.alone(now()),
                                       self.peers.echo_at or 0.0)
        with step("audit"):
            for r in self.ledger.confirm_suspects(now(), SUSPECT_GRACE, self.peers.caught_up(now())):
                log.warning("job seq=%d redelivered (delivery %d) and nothing explains it: AckWait (%gs) shorter "
                            "than the job, or held by a process outside any supervisor's ledger", r.seq, r.delivery,
                            self.deaths.ack_wait(r.delivery - 1),
                            extra={"event": "unexplained_redelivery", "seq": r.seq, "delivery": r.delivery})
        with step("audit"):
            self.watch_deaths()
        with step("audit"):
            self.suspects.show(self.ledger.on_probation())     # settled suspects leave the board

    def held_anywhere(self) -> set[int]:
        """Stream sequences in any of its workers' tables, the dead not yet reaped included."""
        return {e.stream_seq for w in [*self.living(), *self.dead] for e in w.table.snapshot()}

    def fresh_view(self) -> set[int]:
        """What every worker of the pool holds, as of now: the tables read, then every event the
        workers have written applied (queued or still in the pipes). A worker announces a NAK
        before it frees the table entry, so a job in no table here is in the ledger by the time
        this returns."""
        held = self.held_anywhere()
        self.parent.apply_posted()
        for w in [*self.living(), *self.dead]:
            self.apply_events(w, w.read_events())
        return held

    def renak_unproven(self, nak_confirmed: float) -> str:
        """What is missing to prove no live process holds the redelivery of a job whose NAK the
        server had read by `nak_confirmed` ("" when nothing is): Deaths.renak_unseen."""
        if self.peers.alone(time.monotonic()) is not True:
            return "another supervisor may hold it"
        if self.in_transit.replicated():
            return "the consumer is replicated: a redelivery may wait for its raft commit"
        reading = self.in_transit.waiting_since(nak_confirmed)
        if reading is None:
            return "no ConsumerInfo since shows a pull request waiting: it may not be redelivered yet"
        if not self.links_all_fresh_since(reading.answered + SLACK):
            return "a worker has not shown what it holds since (a stalled loop or link may hold it unread)"
        return ""

    def links_all_fresh_since(self, t: float) -> bool:
        """Every live worker that can hold a delivery had a PONG from NATS for a PING it sent after
        `t`: each has read and recorded every message the server sent it before then. A worker
        still STARTING has no subscription yet, so nothing can reach it (its init may take long).
        A pool's consumer hands its jobs to its own workers only: the others' links prove nothing."""
        return all(w.table.server_seen() > t for w in self.living()
                   if w.status is None and w.table.header(slots.STATE) != slots.STARTING)

    def watch_deaths(self) -> None:
        now = time.monotonic()
        rate = self.restarts.rate
        if not rate.storm(now, max(1, self.pool.target)) or now - self.last_storm_log < STORM_LOG_EVERY:
            return
        self.last_storm_log = now
        text = f"{rate.describe(now)}: restarts continue at full speed; find out why they die"
        self.alert("worker_deaths", text)
        log.warning("%s", text)

    # ------------------------------------------------------------ a reload

    def apply_config(self, cfg: Config, change: Any, code: Code | None) -> None:
        """Take a reloaded config: new workers get it; the old ones are replaced one at a time
        (like a recycle: the replacement first) when something they read at fork time changed."""
        self.cfg = self.pool.cfg = self.in_transit.cfg = self.deaths.cfg = self.watch.cfg = cfg
        if code is not None:                       # handler, init, middleware: reloaded together
            self.handler, self.init, self.middleware = code
        self.restarts.configure(cfg.restart.backoff_initial, cfg.restart.backoff_max, cfg.restart.boot_failures_to_halt)
        self.ledger.ack_wait, self.ledger.backoff = cfg.consumer.ack_wait, cfg.consumer.backoff
        self.ledger.poison_after = cfg.restart.poison_after_crashes
        self.revive()
        self.autoscale.reload(cfg)                 # before scale: a changed workers.count pauses it again
        if change.replace_workers:
            for w in self.pool.slots.values():
                w.recycle_reason = w.recycle_reason or "config reloaded"
        if change.scale_to is not None:
            self.parent.scale(change.scale_to, "reload: workers.count", self.name)
