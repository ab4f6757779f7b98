"""The parent: one thread, one asyncio loop, forking and watching the workers.

The loop reads like gunicorn's arbiter:

    restore the worker count -> sleep until woken -> apply what was queued (signals, worker
    events, a reloaded config, monitor readings) -> reap the dead (NAK what they held, write the
    ledger) -> send NAKs a disconnection held back -> inspect the living (heartbeats, job
    timeouts, in-progress pings, drain deadlines) -> recycle -> halt on a boot crash loop ->
    audit (peers, re-NAK, in-transit reconciliation)

One writer: signal handlers, pidfd readers, event-pipe readers, the reload task and the monitor
only queue work (`post`) and set `wakeup`; the loop applies it. The work itself is done in rooms
the loop calls in turn: pool.py (which worker runs in which slot; fork, retire, recycle, restart
delays), deaths.py (the NATS side of a death: NAK, quarantine, held-back NAKs, re-NAK), watch.py
(kill the stuck, +WPI for the healthy), stats.py (counters for /status and /metrics). What to do
is decided by pure pieces with a clock passed in: policy.py, liveness.py, ledger.py, lag.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from supervisor.config import Config
from supervisor.core import liveness
from supervisor.core.ledger import CrashLedger
from supervisor.core.liveness import DRAIN_MARGIN, Limits
from supervisor.core.policy import RestartPolicy
from supervisor.errors import EXIT_HALTED, EXIT_OK
from supervisor.nats import limits
from supervisor.parent.loopsteps import PAUSE, LoopSteps
from supervisor.parent.pool import Pool
from supervisor.parent.process import WorkerProcess
from supervisor.parent.safety.deaths import Deaths
from supervisor.parent.safety.in_transit import SLACK, InTransit
from supervisor.parent.safety.peers import SUSPECT_GRACE, Peers
from supervisor.parent.safety.watch import Watch
from supervisor.parent.scaler import Scaler
from supervisor.parent.stats import Stats
from supervisor.parent.systemd import Notifier
from workers.protocol import slots
from workers.protocol.crashes import CrashBoard
from workers.protocol.events import AcksResent, Event, PauseAsked, Ready, RecycleDue, Redelivered, Settled, Unsent
from workers.protocol.exits import CHILD_EXIT_REASONS, EXIT_CONNECT_FAILED, Kill, KillCause
from workers.runtime.solo import SuspectBoard
from workers.runtime.spec import ChildSpec

log = logging.getLogger("supervisor")

SIGNALS = {signal.SIGTERM: "stop", signal.SIGINT: "interrupt", signal.SIGQUIT: "quit", signal.SIGHUP: "reload",
           signal.SIGTTIN: "increment", signal.SIGTTOU: "decrement"}
REAP_RETRY = 0.05           # a pidfd said "exited" but waitpid did not agree yet: look again this soon
STORM_LOG_EVERY = 60.0      # while workers keep dying fast, say so this often
EXIT_NAK_WAIT = 10.0        # at exit, wait this long at most for NATS to send NAKs held back for the last deaths
EXIT_POLL = 0.05            # ... looking this often whether it is back


class Arbiter:
    """The loop and its queues. Long because it is the one place every input arrives (signals,
    posted work, worker events, the dead) and every stop, scale and reload begins; each handler is
    a few lines that hand the work to a room (pool, deaths, watch, stats)."""

    def __init__(self, cfg: Config, nc: Any, handler: Callable, init: Callable | None,
                 connect_worker: Callable[[int], Any], notifier: Notifier | None = None,
                 reload_config: Callable[[], Any] | None = None, server_dies_with_parent: bool = False,
                 middleware: tuple[tuple[str, type], ...] = ()):
        self.cfg = cfg
        self.server_dies_with_parent = server_dies_with_parent   # the embedded server: workers' orphan rule
        self.fleet_key = ""              # our fleet heartbeat's key (set by supervisor.py): an orphan claims there
        self.nc = nc
        self.handler, self.init = handler, init
        self.middleware = middleware             # workers.middleware: (entry, class), checked by supervisor.py
        self.connect_worker = connect_worker
        self.notifier = notifier
        self.reload_config = reload_config
        self.restarts = RestartPolicy(cfg.restart.backoff_initial, cfg.restart.backoff_max,
                                      cfg.restart.boot_failures_to_halt)
        self.ledger = CrashLedger(cfg.consumer.ack_wait, cfg.restart.poison_after_crashes, cfg.consumer.backoff)
        self.in_transit = InTransit(cfg, nc, self.ledger)
        self.peers = Peers(nc, cfg.stream.name, cfg.consumer.name, self.ledger, self.post, self.in_transit)
        self.alerts: collections.deque = collections.deque(maxlen=50)
        self.steps = LoopSteps(self.alert)
        self.suspects = SuspectBoard()      # jobs on poison probation, run alone by every worker (workers/runtime/solo.py)
        self.crashes = CrashBoard()         # the death each redelivery comes back from (workers/protocol/crashes.py)
        self.deaths = Deaths(cfg, nc, self.ledger, self.peers, self.alert, self.suspects, self.crashes)
        self.stats = Stats(self.living)
        self.pool = Pool(cfg, self.fork, self.restarts, self.stats, self.alert)
        self.watch = Watch(cfg, nc, self.ledger, self.deaths, self.stats, self.alert)
        self.signals: collections.deque[int] = collections.deque()
        self.posted: collections.deque[Callable[[], Any]] = collections.deque()
        self.dead: collections.deque[WorkerProcess] = collections.deque()
        self.tasks: set[asyncio.Task] = set()
        self.wakeup = asyncio.Event()
        self.state = "starting"
        self.stopping: str | None = None                  # None | "drain" | "quit"
        self.exit_code = EXIT_OK
        self.halt_message = ""
        self.started = time.monotonic()
        self.last_storm_log = 0.0
        self.ever_all_ready = False
        self.loop = asyncio.get_running_loop()          # made inside it (app.py): pidfd readers and signals live there
        self.autoscale = Scaler(self)

    # ================================================================ the loop

    async def run(self) -> int:
        for sig in SIGNALS:
            self.loop.add_signal_handler(sig, self.queue_signal, sig)
        await self.peers.start()
        log.info("supervising %d worker(s) on %s/%s, handler %s", self.pool.target, self.cfg.stream.name,
                 self.cfg.consumer.name, self.cfg.workers.handler)
        self.check_all_ready()                 # workers.count = 0 is ready at once
        while not await self.tick():
            pass
        with self.steps.guard("held_back_naks"):
            await self.send_last_naks()
        for sig in SIGNALS:
            self.loop.remove_signal_handler(sig)
        for task in self.tasks:
            task.cancel()
        self.state = "stopping"
        await self.peers.goodbye()             # every worker has exited: we hold nothing now
        return self.exit_code

    async def tick(self) -> bool:
        """One pass of the loop, each step isolated (loopsteps.py): a step that raises is logged,
        counted and alerted, and the others still run. True once a stop has no worker left."""
        step = self.steps.guard
        if not self.stopping:
            with step("restore_count"):
                self.pool.restore_count(time.monotonic())
        await self.sleep()
        with step("signals"):
            self.dispatch_signals()
        with step("posted"):
            self.apply_posted()
        with step("reap"):
            await self.reap()
        if self.stopping and not self.living():
            return True
        with step("held_back_naks"):
            await self.deaths.send_held_back()
        with step("nats_back"):
            if self.nc and self.nc.is_connected:
                self.pool.nats_back(time.monotonic())
        with step("inspect"):
            await self.watch.inspect(self.living())
        with step("watchdog"):
            if self.ever_all_ready and self.notifier and self.pool.ready_count() > 0:
                self.notifier.watchdog()     # only while a worker serves: systemd restarts a pool that cannot
        with step("spread"):
            self.stats.share_spread()          # pull sizing: the fleet's spread of job times
        with step("recycle"):
            self.pool.recycle(bool(self.stopping))
        with step("autoscale"):
            self.autoscale.tick(time.monotonic())
        with step("boot_halt"):
            self.check_boot_failures()
        await self.audit()
        return False

    async def send_last_naks(self) -> None:
        """A stop ends when the last worker is reaped, but NAKs held back for workers that died
        while NATS was away must not die with the process (their jobs would wait for AckWait):
        wait for NATS, at most EXIT_NAK_WAIT and only while one of them is still safe to send,
        then send them. Any signal (a second Ctrl-C, SIGQUIT) ends the wait."""
        deaths = self.deaths
        until = min(time.monotonic() + EXIT_NAK_WAIT, deaths.held_back_useful_until())
        if deaths.held_back and not self.nc.is_connected and time.monotonic() < until:
            log.warning("stopping: waiting up to %.0fs for NATS to send %d NAK(s) held back for dead workers",
                        until - time.monotonic(), len(deaths.held_back),
                        extra={"event": "exit_waiting_for_nats", "count": len(deaths.held_back)})
            if self.notifier:
                self.notifier.extend_timeout(EXIT_NAK_WAIT + DRAIN_MARGIN)
            while not self.nc.is_connected and not self.nc.is_closed and not self.signals \
                    and time.monotonic() < until:
                self.wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wakeup.wait(), EXIT_POLL)
        await deaths.send_held_back()
        if deaths.held_back:
            log.warning("stopping with %d NAK(s) unsent (NATS away): seq %s come back after AckWait",
                        len(deaths.held_back), ", ".join(str(o.seq) for o in deaths.held_back),
                        extra={"event": "held_back_dropped", "seqs": [o.seq for o in deaths.held_back]})

    async def sleep(self) -> None:
        timeout = liveness.inspect_every(Limits.of(self.cfg))
        with self.steps.guard("sleep"):
            timeout = self.sleep_timeout(timeout)
        if self.steps.new_tick():          # a step failed: whatever wants us back at once may be its doing
            timeout = max(timeout, PAUSE)
        try:
            await asyncio.wait_for(self.wakeup.wait(), max(0.0, timeout))
        except TimeoutError:
            pass
        self.wakeup.clear()

    def sleep_timeout(self, timeout: float) -> float:
        due = self.pool.next_restart()
        if due is not None and not self.stopping:
            timeout = min(timeout, due - time.monotonic())
        if self.dead:
            timeout = min(timeout, REAP_RETRY)
        return min(timeout, self.autoscale.due_in(time.monotonic()))

    def living(self) -> list[WorkerProcess]:
        return self.pool.living()

    def post(self, work: Callable[[], Any]) -> None:
        """Queue a change of state for the loop to apply (the one-writer rule)."""
        self.posted.append(work)
        self.wakeup.set()

    def apply_posted(self) -> None:
        while self.posted:
            work = self.posted.popleft()
            with self.steps.guard("posted"):   # one bad closure neither stops the rest nor comes back
                work()

    def spawn_task(self, coro: Any) -> None:
        """A background task the loop keeps a reference to (and cancels at the end)."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # ================================================================ signals

    def queue_signal(self, sig: int) -> None:
        self.signals.append(sig)
        self.wakeup.set()

    def dispatch_signals(self) -> None:
        while self.signals:
            sig = self.signals.popleft()
            log.info("received %s", signal.Signals(sig).name, extra={"event": "signal", "signal": signal.Signals(sig).name})
            with self.steps.guard("signals"):  # the next signal is still handled
                getattr(self, "on_" + SIGNALS[signal.Signals(sig)])()

    def on_stop(self) -> None:
        if not self.stopping:
            self.begin_stop("drain")

    def on_interrupt(self) -> None:
        if self.stopping:                      # a second Ctrl-C: stop now
            self.on_quit()
        else:
            self.begin_stop("drain")

    def on_quit(self) -> None:
        self.begin_stop("quit")

    def on_increment(self) -> None:
        self.scale(self.pool.target + 1, source="SIGTTIN")

    def on_decrement(self) -> None:
        self.scale(max(0, self.pool.target - 1), source="SIGTTOU")

    def on_reload(self) -> None:
        if self.reload_config is None or self.stopping:
            log.warning("reload: nothing to re-read" if not self.stopping else "reload ignored while stopping")
            return
        self.spawn_task(self.reload_config())   # it posts apply_config back to the loop

    def apply_config(self, cfg: Config, change: Any, code: tuple[Callable, Callable | None, tuple] | None) -> None:
        """Take a reloaded config: new workers get it; the old ones are replaced one at a time
        (like a recycle: the replacement first) when something they read at fork time changed."""
        self.cfg = self.pool.cfg = self.in_transit.cfg = self.deaths.cfg = self.watch.cfg = cfg
        if code is not None:                       # handler, init, middleware: reloaded together
            self.handler, self.init, self.middleware = code
        self.restarts.configure(cfg.restart.backoff_initial, cfg.restart.backoff_max, cfg.restart.boot_failures_to_halt)
        self.ledger.ack_wait, self.ledger.backoff = cfg.consumer.ack_wait, cfg.consumer.backoff
        self.ledger.poison_after = cfg.restart.poison_after_crashes
        self.autoscale.reload(cfg)                 # before scale_to: a changed workers.count pauses it again
        if change.replace_workers:
            for w in self.pool.slots.values():
                w.recycle_reason = w.recycle_reason or "config reloaded"
        if change.scale_to is not None:
            self.scale(change.scale_to, source="reload: workers.count")
        self.wakeup.set()

    def begin_stop(self, mode: str) -> None:
        self.stopping = mode
        self.state = "draining" if mode == "drain" else "stopping"
        # Each worker drains under the graceful_timeout it was forked with (a SIGHUP may have changed the key).
        grace = max([w.graceful_timeout for w in self.living()], default=self.cfg.workers.graceful_timeout)
        if self.notifier:
            self.notifier.stopping()
            if mode == "drain":    # ask systemd for the drain's worth of time, whatever TimeoutStopSec says
                self.notifier.extend_timeout(grace + 2 * DRAIN_MARGIN)
        log.info("%s %d worker(s)%s", "draining" if mode == "drain" else "killing", len(self.living()),
                 f" (graceful_timeout {grace:g}s)" if mode == "drain" else "",
                 extra={"event": "stop_begun", "mode": mode, "workers": len(self.living())})
        for w in self.living():
            if mode == "quit":
                w.kill = Kill(KillCause.QUIT, "SIGQUIT: stop at once")
                w.send(signal.SIGKILL)
            else:                  # retiring ones too: a shutdown NAKs what they have not started
                self.pool.drain(w, signal.SIGTERM)

    def scale(self, n: int, source: str) -> None:
        """Set the worker count. Any source but the autoscaler is a person, whose count autoscaling
        then leaves alone for a while (scaler.py)."""
        if self.stopping:
            return
        if source != "autoscale":
            self.autoscale.manual(n, source)
        log.info("scaling from %d to %d worker(s)", self.pool.target, n,
                 extra={"event": "scaling", "from": self.pool.target, "to": n, "source": source})
        self.pool.target = n
        self.wakeup.set()

    # ================================================================ starting workers

    def fork(self, w: WorkerProcess) -> None:
        try:
            w.spawn(self.loop, self.child_spec, self.on_exit, self.on_events)
        except OSError:
            w.close(self.loop)
            raise

    def child_spec(self, w: WorkerProcess, events_fd: int) -> ChildSpec:
        return ChildSpec(slot=w.slot, parent_pid=os.getpid(), table=w.table, events_fd=events_fd, cfg=self.cfg,
                         handler=self.handler, init=self.init, middleware=self.middleware,
                         connect=lambda: self.connect_worker(w.slot),
                         job_limit=w.job_limit, suspects=self.suspects, crashes=self.crashes,
                         graceful_timeout=w.graceful_timeout,
                         server_dies_with_parent=self.server_dies_with_parent, fleet_key=self.fleet_key)

    # ================================================================ events from workers

    def on_exit(self, w: WorkerProcess) -> None:
        self.loop.remove_reader(w.pidfd)
        self.dead.append(w)
        self.wakeup.set()

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
                self.check_all_ready()
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
                self.spawn_task(self.pause(seconds, reason, f"worker {w.slot} (pid {w.pid}), job seq={seq}"))

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

    def check_all_ready(self) -> None:
        """The first time every worker is ready: state running, READY=1 to systemd."""
        if not self.ever_all_ready and not self.stopping and self.pool.ready_count() >= self.pool.target:
            self.ever_all_ready = True
            self.state = "running"
            if self.notifier:
                self.notifier.ready(self.status_line())

    # ================================================================ reaping

    async def reap(self) -> None:
        if self.stopping == "quit" and not all(w.reap() for w in self.living()):
            return       # SIGQUIT: NAK once every worker is dead, or a NAK may hand a job to a dying one
        for _ in range(len(self.dead)):
            w = self.dead.popleft()
            reaped = False
            with self.steps.guard("reap"):
                reaped = w.reap()
            if not reaped:
                self.dead.append(w)             # exited but not waitable yet: next tick (sleep() hurries)
                continue
            await self.reap_one(w)

    async def reap_one(self, w: WorkerProcess) -> None:
        """Settle a dead worker's jobs and free its slot. Each part is isolated: whatever fails
        (a NATS error in the NAKs above all), the worker is still forgotten and its slot restarted,
        or the pool would shrink by one for good."""
        step = self.steps.guard
        with step("reap"):
            self.apply_events(w, w.read_events())      # whatever it said before dying
        clean = self.exited_cleanly(w)
        cause = w.kill.text if w.kill else w.describe_exit()
        code = w.exit_code()
        if not clean and code in CHILD_EXIT_REASONS:
            cause += f": {CHILD_EXIT_REASONS[code]}"
        with step("reap"):
            if not clean:
                self.in_transit.death(time.monotonic(), w.table.header(slots.CREDITS), f"worker {w.slot} (pid {w.pid})",
                                      w.table.server_seen(), {e.stream_seq for e in w.table.snapshot()})
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
                self.pool.plan_restart(w, cause, finished, bool(self.stopping), nats_down)

    def release_limits(self, w: WorkerProcess, clean: bool) -> None:
        """A dead worker's limit slots go back now, not after their TTL: any death but a clean
        exit that gave them back itself (its table says it holds none)."""
        caps = [k for k, name in enumerate(w.limit_names) if name in self.cfg.limits and self.cfg.limits[name].concurrency]
        if not caps or (clean and not any(w.table.limit(k)[0] for k in caps)):
            return
        self.spawn_task(self.release_slots(w.pid, w.slot))

    async def release_slots(self, pid: int, slot: int) -> None:
        try:
            await limits.release_worker(self.nc, self.cfg, pid, slot)
        except Exception as exc:          # they free themselves within LEASE_TTL
            log.warning("worker %d (pid %d): its limit slots were not released (%s); they free themselves within "
                        "%ds", slot, pid, exc, limits.LEASE_TTL, extra={"event": "limit_release_failed"})

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
        w.close(self.loop)

    def check_boot_failures(self) -> None:
        if self.restarts.halted and not self.stopping:
            boot = self.restarts.boot
            message = (f"halting: {boot.count} workers in a row died before becoming ready "
                       f"(restart.boot_failures_to_halt={boot.limit}); last: {boot.last_reason}")
            log.error(message, extra={"event": "halting", "deaths": boot.count})
            self.halt_message = message
            self.alert("halted", message)
            self.exit_code = EXIT_HALTED
            self.begin_stop("drain")

    # ================================================================ inspecting the living

    async def audit(self) -> None:
        """Share our NAKs with peer supervisors; count redeliveries nobody explained; NAK once more
        a dead worker's job nobody has seen again; find what was in transit to a dead worker;
        say so while workers keep dying fast."""
        step, now = self.steps.guard, time.monotonic
        with step("audit"):
            await self.peers.flush()
        with step("audit"):
            await self.deaths.renak_unseen(self.fresh_view, self.renak_unproven)
        with step("audit"):
            await self.in_transit.step(now(), self.fresh_view, self.links_all_fresh_since, self.peers.alone(now()),
                                       self.peers.echo_at or 0.0)
        with step("audit"):
            for r in self.ledger.confirm_suspects(now(), SUSPECT_GRACE):
                log.warning("job seq=%d redelivered (delivery %d) and nothing explains it: AckWait (%gs) shorter "
                            "than the job, or held by a process outside any supervisor's ledger", r.seq, r.delivery,
                            self.deaths.ack_wait(r.delivery - 1),
                            extra={"event": "unexplained_redelivery", "seq": r.seq, "delivery": r.delivery})
        with step("audit"):
            self.watch_deaths()
        with step("audit"):
            self.suspects.show(self.ledger.on_probation())     # settled suspects leave the board

    def held_anywhere(self) -> set[int]:
        """Stream sequences in any worker's table, the dead not yet reaped included."""
        return {e.stream_seq for w in [*self.living(), *self.dead] for e in w.table.snapshot()}

    def fresh_view(self) -> set[int]:
        """What every worker holds, as of now: the tables read, then every event the workers have
        written applied (queued or still in the pipes). A worker announces a NAK before it frees
        the table entry, so a job in no table here is in the ledger by the time this returns."""
        held = self.held_anywhere()
        self.apply_posted()
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
        still STARTING has no subscription yet, so nothing can reach it (its init may take long)."""
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

    # ================================================================ helpers

    def alert(self, kind: str, message: str) -> None:
        self.alerts.append({"kind": kind, "message": message, "t": time.time()})

    def status_line(self) -> str:
        return f"{self.pool.ready_count()}/{self.pool.target} workers ready"
