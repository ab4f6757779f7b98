"""The parent: one thread, one asyncio loop, forking and watching the workers.

The loop reads like gunicorn's arbiter:

    restore the worker count -> sleep until woken -> apply what was queued (signals, worker
    events, a reloaded config, monitor readings) -> reap the dead (NAK what they held, write the
    ledger) -> send NAKs a disconnection held back -> inspect the living (heartbeats, job
    timeouts, in-progress pings, drain deadlines) -> recycle -> halt on a boot crash loop ->
    audit (peers, re-NAK, in-transit reconciliation)

One writer: signal handlers, pidfd readers, event-pipe readers, the reload task and the monitor
only queue work (`post`) and set `wakeup`; the loop applies it. What to do is decided by small
pure pieces (policy.py, ledger.py); this file is the glue.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import signal
import time
from typing import Any, Callable

import psutil

from workers import Job
from workers import slots
from workers.runtime import CHILD_EXIT_REASONS, ChildSpec, dead_letter
from workers.slots import SlotTable

from . import liveness
from .config import Config
from .errors import EXIT_HALTED, EXIT_OK
from .ledger import CrashLedger
from .liveness import DRAIN_MARGIN, Limits
from .peers import SUSPECT_GRACE, Peers
from .policy import RestartPolicy, ack_wait_for, job_limit, nak_is_safe
from .process import WorkerProcess
from .reconcile import InTransit
from .scaler import Scaler

log = logging.getLogger("supervisor")

SIGNALS = {signal.SIGTERM: "stop", signal.SIGINT: "interrupt", signal.SIGQUIT: "quit", signal.SIGHUP: "reload",
           signal.SIGTTIN: "increment", signal.SIGTTOU: "decrement"}
REAP_RETRY = 0.05           # a pidfd said "exited" but waitpid did not agree yet: look again this soon
STORM_LOG_EVERY = 60.0      # while workers keep dying fast, say so this often


@dataclasses.dataclass
class Totals:
    """Counters carried over from workers that have exited (the live ones are read from their tables)."""
    acked: int = 0
    naked: int = 0
    termed: int = 0
    duplicates: int = 0
    restarts: int = 0
    worker_deaths: int = 0
    pings: int = 0
    buckets: list = dataclasses.field(default_factory=lambda: [0] * (len(slots.DURATION_BUCKETS) + 1))
    duration_sum: float = 0.0
    max_duration: float = 0.0


@dataclasses.dataclass
class SentNak:
    """A dead worker's job we NAKed, until some supervisor sees it again (renak_unseen)."""
    reply: str
    delivery: int
    sent_at: float
    confirmed_at: float | None = None     # when a fence proved the server had read it


@dataclasses.dataclass
class HeldBack:
    """A NAK for a dead worker's job that could not be sent (NATS disconnected): sent on reconnect
    if its AckWait still allows it."""
    seq: int
    delivery: int
    reply: str
    timer_started: float


class Arbiter:
    def __init__(self, cfg: Config, nc: Any, handler: Callable, init: Callable | None,
                 connect_worker: Callable[[int], Any], notifier: Any = None,
                 reload_config: Callable[[], Any] | None = None):
        self.cfg = cfg
        self.nc = nc
        self.handler, self.init = handler, init
        self.connect_worker = connect_worker
        self.notifier = notifier
        self.reload_config = reload_config
        self.target = cfg.workers.count
        self.slots: dict[int, WorkerProcess] = {}
        self.retiring: list[WorkerProcess] = []
        self.restarts = RestartPolicy(cfg.restart.backoff_initial, cfg.restart.backoff_max,
                                      cfg.restart.boot_failures_to_halt)
        self.slot_restarts: collections.Counter = collections.Counter()
        self.restart_at: dict[int, float] = {}
        self.replacing: dict[int, WorkerProcess] = {}     # slot -> old worker awaiting its replacement's ready
        self.ledger = CrashLedger(cfg.consumer.ack_wait, cfg.restart.poison_after_crashes, cfg.consumer.backoff)
        self.peers = Peers(nc, cfg.stream.name, cfg.consumer.name, self.ledger, self.post)
        self.in_transit = InTransit(cfg, nc, self.ledger)
        self.totals = Totals()
        self.alerts: collections.deque = collections.deque(maxlen=50)
        self.pings: dict[tuple[int, int], float] = {}
        self.renak: dict[int, SentNak] = {}                  # a dead worker's job NAKed, by stream seq
        self.held_back: list[HeldBack] = []
        self.stale_links: set[int] = set()                  # pids whose NATS connection looks dead
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
        self.last_rss_check = 0.0
        self.last_storm_log = 0.0
        self.ever_all_ready = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.autoscale = Scaler(self)

    # ================================================================ the loop

    async def run(self) -> int:
        self.loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            self.loop.add_signal_handler(sig, self.queue_signal, sig)
        await self.peers.start()
        log.info("supervising %d worker(s) on %s/%s, handler %s", self.target, self.cfg.stream.name,
                 self.cfg.consumer.name, self.cfg.workers.handler)
        self.check_all_ready()                 # workers.count = 0 is ready at once
        while True:
            self.restore_count()
            await self.sleep()
            self.dispatch_signals()
            self.apply_posted()
            await self.reap()
            if self.stopping and not self.living():
                break
            await self.send_held_back()
            await self.inspect_workers()
            self.recycle()
            self.autoscale.tick(time.monotonic())
            self.check_boot_failures()
            await self.audit()
        for sig in SIGNALS:
            self.loop.remove_signal_handler(sig)
        for task in self.tasks:
            task.cancel()
        self.state = "stopping"
        return self.exit_code

    async def sleep(self) -> None:
        timeout = liveness.inspect_every(Limits.of(self.cfg))
        due = [t for s, t in self.restart_at.items() if s not in self.slots]
        if due and not self.stopping:
            timeout = min(timeout, min(due) - time.monotonic())
        if self.dead:
            timeout = min(timeout, REAP_RETRY)
        timeout = min(timeout, self.autoscale.due_in(time.monotonic()))
        try:
            await asyncio.wait_for(self.wakeup.wait(), max(0.0, timeout))
        except asyncio.TimeoutError:
            pass
        self.wakeup.clear()

    def living(self) -> list[WorkerProcess]:
        return [*self.slots.values(), *self.retiring]

    def post(self, work: Callable[[], Any]) -> None:
        """Queue a change of state for the loop to apply (the one-writer rule)."""
        self.posted.append(work)
        self.wakeup.set()

    def apply_posted(self) -> None:
        while self.posted:
            self.posted.popleft()()

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
            getattr(self, "on_" + SIGNALS[sig])()

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
        self.scale(self.target + 1, source="SIGTTIN")

    def on_decrement(self) -> None:
        self.scale(max(0, self.target - 1), source="SIGTTOU")

    def on_reload(self) -> None:
        if self.reload_config is None or self.stopping:
            log.warning("reload: nothing to re-read" if not self.stopping else "reload ignored while stopping")
            return
        self.spawn_task(self.reload_config())   # it posts apply_config back to the loop

    def apply_config(self, cfg: Config, change: Any, handler: Callable | None, init: Callable | None) -> None:
        """Take a reloaded config: new workers get it; the old ones are replaced one at a time
        (like a recycle: the replacement first) when something they read at fork time changed."""
        self.cfg = cfg
        if handler is not None:
            self.handler, self.init = handler, init
        self.restarts.configure(cfg.restart.backoff_initial, cfg.restart.backoff_max, cfg.restart.boot_failures_to_halt)
        self.ledger.ack_wait, self.ledger.backoff = cfg.consumer.ack_wait, cfg.consumer.backoff
        self.ledger.poison_after = cfg.restart.poison_after_crashes
        self.in_transit.cfg = cfg
        self.autoscale.reload(cfg)                 # before scale_to: a changed workers.count pauses it again
        if change.replace_workers:
            for w in self.slots.values():
                w.recycle_reason = w.recycle_reason or "config reloaded"
        if change.scale_to is not None:
            self.scale(change.scale_to, source="reload: workers.count")
        self.wakeup.set()

    def begin_stop(self, mode: str) -> None:
        self.stopping = mode
        self.state = "draining" if mode == "drain" else "stopping"
        grace = self.cfg.workers.graceful_timeout
        if self.notifier:
            self.notifier.stopping()
            if mode == "drain":    # ask systemd for the drain's worth of time, whatever TimeoutStopSec says
                self.notifier.extend_timeout(grace + 2 * DRAIN_MARGIN)
        log.info("%s %d worker(s)%s", "draining" if mode == "drain" else "killing", len(self.living()),
                 f" (graceful_timeout {grace:g}s)" if mode == "drain" else "",
                 extra={"event": "stop_begun", "mode": mode, "workers": len(self.living())})
        for w in self.living():
            if mode == "quit":
                w.kill_reason = "SIGQUIT: stop at once"
                w.send(signal.SIGKILL)
            else:                  # retiring ones too: a shutdown NAKs what they have not started
                self.drain(w, signal.SIGTERM)

    def scale(self, n: int, source: str) -> None:
        """Set the worker count. Any source but the autoscaler is a person, whose count autoscaling
        then leaves alone for a while (scaler.py)."""
        if self.stopping:
            return
        if source != "autoscale":
            self.autoscale.manual(n, source)
        log.info("scaling from %d to %d worker(s)", self.target, n,
                 extra={"event": "scaling", "from": self.target, "to": n, "source": source})
        self.target = n
        self.wakeup.set()

    # ================================================================ starting workers

    def restore_count(self) -> None:
        if self.stopping:
            return
        for slot in sorted(self.slots, reverse=True):
            if slot >= self.target:
                self.retire(self.slots.pop(slot), "scaled down")
        for slot in [s for s in self.replacing if s >= self.target]:
            self.release_replaced(slot)         # its replacement is gone with the slot: no waiting for it
        for slot in [s for s in self.restart_at if s >= self.target]:
            del self.restart_at[slot]
        now = time.monotonic()
        for slot in range(self.target):
            if slot not in self.slots and self.restart_at.get(slot, 0.0) <= now:
                self.spawn(slot)

    def spawn(self, slot: int) -> WorkerProcess | None:
        table = SlotTable(self.table_entries(), self.reply_bytes())
        table.set_state(slots.STARTING)        # before the fork: the child may be READY before we return
        w = WorkerProcess(slot, table)
        w.job_limit = job_limit(self.cfg.workers.max_jobs, self.cfg.workers.max_jobs_jitter)
        try:
            w.spawn(self.loop, self.child_spec, self.on_exit, self.on_events)
        except OSError as exc:                 # EAGAIN (TasksMax, RLIMIT_NPROC), EMFILE, ENOMEM
            w.close(self.loop)
            self.spawn_failed(slot, exc)
            return None
        table.q[slots.PID] = w.pid
        self.slots[slot] = w
        self.restart_at.pop(slot, None)
        log.debug("worker %d started (pid %d)", slot, w.pid, extra={"event": "worker_started", "slot": slot,
                                                                    "worker_pid": w.pid})
        return w

    def spawn_failed(self, slot: int, exc: OSError) -> None:
        cause = f"cannot fork: {exc.strerror or exc}"
        delay = self.restarts.died(time.monotonic(), slot, cause, None, 0)
        self.restart_at[slot] = time.monotonic() + delay
        self.alert("spawn_failed", f"worker {slot}: {cause}; retrying in {delay:.2f}s")
        log.error("worker %d: %s; retrying in %.2fs", slot, cause, delay,
                  extra={"event": "spawn_failed", "slot": slot, "cause": cause, "delay": delay})

    def table_entries(self) -> int:
        # Pulled + running (concurrency + one batch), and as many again awaiting ack confirmation.
        return 2 * (self.cfg.workers.concurrency + self.cfg.workers.batch)

    def reply_bytes(self) -> int:
        return 256 + len(self.cfg.stream.name) + len(self.cfg.consumer.name)

    def child_spec(self, w: WorkerProcess, events_fd: int) -> ChildSpec:
        return ChildSpec(slot=w.slot, parent_pid=os.getpid(), table=w.table, events_fd=events_fd, cfg=self.cfg,
                         handler=self.handler, init=self.init, connect=lambda: self.connect_worker(w.slot),
                         job_limit=w.job_limit)

    def retire(self, w: WorkerProcess, why: str) -> None:
        """Take a worker out for good: it stops pulling, runs what it holds, exits (SIGUSR1)."""
        log.info("worker %d (pid %d): %s; retiring it", w.slot, w.pid, why,
                 extra={"event": "worker_retiring", "slot": w.slot, "worker_pid": w.pid, "reason": why})
        w.retiring = True
        self.retiring.append(w)
        self.drain(w, signal.SIGUSR1)

    def drain(self, w: WorkerProcess, sig: int) -> None:
        """SIGUSR1: retire (finish what it holds). SIGTERM: stop (NAK what has not started)."""
        deadline = liveness.drain_deadline(time.monotonic(), self.cfg.workers.graceful_timeout)
        w.drain_deadline = min(w.drain_deadline or deadline, deadline)
        w.state = "draining"
        w.send(sig)

    # ================================================================ events from workers

    def on_exit(self, w: WorkerProcess) -> None:
        self.loop.remove_reader(w.pidfd)
        self.dead.append(w)
        self.wakeup.set()

    def on_events(self, w: WorkerProcess) -> None:
        events = w.read_events()
        if events:
            self.post(lambda: self.apply_events(w, events))

    def apply_events(self, w: WorkerProcess, events: list[dict]) -> None:
        for event in events:
            self.apply_event(w, event)

    def apply_event(self, w: WorkerProcess, event: dict) -> None:
        kind, now = event.get("ev"), time.monotonic()
        if kind == "ready":
            self.worker_ready(w, now)
        elif kind == "redelivered":
            seq, delivery = int(event["seq"]), int(event["delivery"])
            why = self.ledger.redelivered(now, seq, delivery)
            self.peers.seen(seq, delivery)
            log.info("job seq=%d redelivered (delivery %d) to worker %d: %s", seq, delivery, w.slot,
                     why or "no explanation yet", extra={"event": "redelivered", "seq": seq, "delivery": delivery,
                                                         "slot": w.slot, "worker_pid": w.pid, "why": why})
        elif kind == "settled":
            seq, delivery, outcome = int(event["seq"]), int(event["delivery"]), event["outcome"]
            self.ledger.settled(now, seq, delivery, outcome)
            if outcome == "nak":
                self.peers.announce(seq, f"NAKed by a worker at delivery {delivery}")
            elif delivery > 1:
                self.peers.settled(seq, delivery, outcome)
        elif kind == "recycle_due":        # its last job has started: start its replacement
            w.recycle_reason = f"ran {event['jobs']} jobs (workers.max_jobs)"
            w.last_job_started = True

    def worker_ready(self, w: WorkerProcess, now: float) -> None:
        if w.state == "starting":
            w.state = "ready"
        w.ready_at = now
        self.restarts.ready()
        log.info("worker %d ready (pid %d, %.0f ms)", w.slot, w.pid, 1000 * (now - w.started_at),
                 extra={"event": "worker_ready", "slot": w.slot, "worker_pid": w.pid,
                        "ms": round(1000 * (now - w.started_at))})
        self.release_replaced(w.slot)         # the replacement serves: retire the old one
        self.check_all_ready()

    def release_replaced(self, slot: int) -> None:
        """The worker a recycle is replacing in `slot` may go now. One that reached max_jobs goes
        once its last job is done too (recycle() sees to it)."""
        old = self.replacing.pop(slot, None)
        if old is not None and not old.last_job_started:
            self.drain(old, signal.SIGUSR1)

    def check_all_ready(self) -> None:
        """The first time every worker is ready: state running, READY=1 to systemd."""
        if not self.ever_all_ready and not self.stopping and self.ready_count() >= self.target:
            self.ever_all_ready = True
            self.state = "running"
            if self.notifier:
                self.notifier.ready(self.status_line())

    def ready_count(self) -> int:
        return sum(1 for w in self.slots.values() if w.state == "ready")

    # ================================================================ reaping

    async def reap(self) -> None:
        if self.stopping == "quit" and not all(w.reap() for w in self.living()):
            return       # SIGQUIT: NAK once every worker is dead, or a NAK may hand a job to a dying one
        for _ in range(len(self.dead)):
            w = self.dead.popleft()
            if not w.reap():
                self.dead.append(w)             # exited but not waitable yet: next tick (sleep() hurries)
                continue
            self.apply_events(w, w.read_events())      # whatever it said before dying
            clean = self.exited_cleanly(w)
            cause = w.kill_reason or w.describe_exit()
            if not clean and w.exit_code() in CHILD_EXIT_REASONS:
                cause += f": {CHILD_EXIT_REASONS[w.exit_code()]}"
            await self.settle_held_jobs(w, cause, clean)
            self.carry_totals(w)
            finished = w.jobs_finished          # read before forget() unmaps its table
            self.forget(w)
            if not clean:
                self.plan_restart(w, cause, finished)

    @staticmethod
    def exited_cleanly(w: WorkerProcess) -> bool:
        """Exit 0 after a drain; or killed by the SIGTERM/SIGUSR1 we sent before it had installed
        its handlers (a worker told to stop while still booting): neither is a crash."""
        if w.kill_reason:
            return False
        if w.exit_code() == 0:
            return True
        asked = w.drain_deadline is not None and w.ready_at is None
        return asked and w.signalled_by() in (signal.SIGTERM, signal.SIGUSR1)

    async def settle_held_jobs(self, w: WorkerProcess, cause: str, clean: bool) -> None:
        """NAK what a dead worker held, at once, so it is redelivered in milliseconds, not AckWait.
        A worker that exited cleanly has settled and fenced everything: anything left (HELD,
        RUNNING, an ACKED entry in doubt) is a backstop NAK."""
        now = time.monotonic()
        entries = w.table.snapshot()
        nak = [self.nak_guard(w, e, now) for e in entries]
        if not clean:
            held = [(e.stream_seq, e.delivery, slots.ENTRY_STATES[e.state], n) for e, n in zip(entries, nak)]
            self.ledger.record_death(now, w.slot, w.pid, cause, held, in_transit=w.table.header(slots.CREDITS),
                                     job_to_blame=not w.kill_reason.startswith(("SIGQUIT", "killed: still draining")))
            self.in_transit.death(now, w.table.header(slots.CREDITS), f"worker {w.slot} (pid {w.pid})")
        for e, n in zip(entries, nak):
            if n:     # peers first: the redelivery our NAK causes may land on another host
                self.peers.announce(e.stream_seq, f"held by worker {w.slot} (pid {w.pid}) at its death ({cause})")
        await self.peers.flush()
        for e, n in zip(entries, nak):
            if not n:
                continue
            if not clean and e.state == slots.RUNNING and self.ledger.is_poison(e.stream_seq):
                await self.quarantine(e)
            else:
                await self.nak(HeldBack(e.stream_seq, e.delivery, e.reply, self.timer_started(w, e)))
        if any(nak):
            await self.flush()
        if clean:
            log.info("worker %d (pid %d) drained and exited", w.slot, w.pid,
                     extra={"event": "worker_exited", "slot": w.slot, "worker_pid": w.pid,
                            "naked": [e.stream_seq for e, n in zip(entries, nak) if n]})
        else:
            seqs = ", ".join(f"seq {e.stream_seq}" for e in entries) or "nothing"
            log.warning("worker %d (pid %d) died: %s; held %s%s", w.slot, w.pid, cause, seqs,
                        f"; NAKed {sum(nak)} for immediate redelivery" if any(nak) else "",
                        extra={"event": "worker_died", "slot": w.slot, "worker_pid": w.pid, "cause": cause,
                               "held": [e.stream_seq for e in entries],
                               "naked": [e.stream_seq for e, n in zip(entries, nak) if n]})

    def timer_started(self, w: WorkerProcess, e: slots.Entry) -> float:
        """When the server's AckWait timer for this delivery last started: held, or our last +WPI."""
        return max(e.t_held, self.pings.get((w.pid, e.stream_seq), 0.0))

    def nak_guard(self, w: WorkerProcess, e: slots.Entry, now: float) -> bool:
        """NAK unsettled jobs, and acked ones whose ack may be lost (a NAK after an ack is a no-op);
        never one whose AckWait has (nearly) run out: it may be redelivered to someone else already."""
        if e.state not in (slots.HELD, slots.RUNNING, slots.ACKED) or not e.reply:
            return False
        return nak_is_safe(now, self.timer_started(w, e), self.ack_wait(e.delivery))

    def ack_wait(self, delivery: int) -> float:
        return ack_wait_for(self.cfg.consumer.ack_wait, self.cfg.consumer.backoff, delivery)

    async def nak(self, order: HeldBack) -> None:
        """NAK now, or, while NATS is disconnected, as soon as it is back (if still safe then)."""
        if not self.nc.is_connected:
            self.held_back.append(order)
            return
        log.debug("NAK seq=%d (delivery %d) via %s", order.seq, order.delivery, order.reply)
        await self.nc.publish(order.reply, b"-NAK")
        self.renak[order.seq] = SentNak(order.reply, order.delivery, time.monotonic())

    async def send_held_back(self) -> None:
        if not self.held_back or not self.nc.is_connected:
            return
        now, orders, self.held_back = time.monotonic(), self.held_back, []
        sent = 0
        for order in orders:
            if nak_is_safe(now, order.timer_started, self.ack_wait(order.delivery)):
                await self.nak(order)
                sent += 1
            else:
                log.warning("job seq=%d of a dead worker: NATS was down until its AckWait ran out; the server "
                            "redelivers it", order.seq, extra={"event": "held_back_expired", "seq": order.seq})
        if sent:
            log.info("NATS is back: sent %d NAK(s) held back while disconnected", sent,
                     extra={"event": "held_back_sent", "count": sent})
            await self.flush()

    async def quarantine(self, e: slots.Entry) -> None:
        """A job held at poison_after_crashes worker deaths: dead-letter it with the evidence, TERM it."""
        deaths = self.ledger.quarantine(e.stream_seq)
        evidence = "; ".join(f"pid {d.pid} {d.cause}" for d in deaths)
        reason = f"poison: held at {len(deaths)} worker deaths ({evidence})"
        try:
            raw = await self.nc.jetstream().get_msg(self.cfg.stream.name, e.stream_seq)
            headers = dict(raw.headers or {})
            job = Job(data=raw.data or b"", subject=raw.subject or "", headers=headers, stream_seq=e.stream_seq,
                      delivery=e.delivery, msg_id=headers.get("Nats-Msg-Id"))
            await dead_letter(self.nc, self.cfg, job, reason, {"Supervisor-Dead-Letter-Deaths": evidence})
            await self.nc.publish(e.reply, b"+TERM " + reason.encode()[:300])
        except Exception as exc:
            log.error("cannot quarantine poison job seq=%d (%s); NAKing it instead", e.stream_seq, exc)
            await self.nc.publish(e.reply, b"-NAK")
            return
        self.alert("poison", f"job seq={e.stream_seq} quarantined to {self.cfg.restart.dead_letter_subject}: {reason}")

    def carry_totals(self, w: WorkerProcess) -> None:
        t = w.table
        self.totals.acked += t.header(slots.ACKED_N)
        self.totals.naked += t.header(slots.NAKED_N)
        self.totals.termed += t.header(slots.TERMED_N)
        self.totals.duplicates += t.header(slots.DUPLICATE_N)
        buckets, total = t.histogram()
        self.totals.buckets = [a + b for a, b in zip(self.totals.buckets, buckets)]
        self.totals.duration_sum += total
        self.totals.max_duration = max(self.totals.max_duration, t.max_duration())

    def forget(self, w: WorkerProcess) -> None:
        if self.slots.get(w.slot) is w:
            del self.slots[w.slot]
        if w in self.retiring:
            self.retiring.remove(w)
        if self.replacing.get(w.slot) is w:
            del self.replacing[w.slot]
        self.pings = {k: v for k, v in self.pings.items() if k[0] != w.pid}
        self.stale_links.discard(w.pid)
        w.close(self.loop)

    def plan_restart(self, w: WorkerProcess, cause: str, jobs_finished: int) -> None:
        self.totals.worker_deaths += 1
        if self.stopping:
            return
        now = time.monotonic()
        ready_for = now - w.ready_at if w.ready_at is not None else None
        delay = self.restarts.died(now, w.slot, cause, ready_for, jobs_finished)
        if w.retiring or w.slot >= self.target:
            return
        self.restart_at[w.slot] = now + delay
        self.totals.restarts += 1
        self.slot_restarts[w.slot] += 1
        log.info("restarting worker %d in %.2fs", w.slot, delay,
                 extra={"event": "worker_restart_planned", "slot": w.slot, "worker_pid": w.pid, "delay": delay})

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

    async def inspect_workers(self) -> None:
        now, lim = time.monotonic(), Limits.of(self.cfg)
        pings, held = [], set()
        for w in self.living():
            entries = w.table.snapshot()
            held.update((w.pid, e.stream_seq) for e in entries)   # a dying worker's pings still date its jobs
            if w.status is not None or w.kill_reason:
                continue
            reason = liveness.why_kill(now, lim, w.table.heartbeat(), w.started_at, entries, w.drain_deadline)
            if reason:
                self.kill(w, reason)
                continue
            pings += self.due_pings(w, entries, now)
        self.pings = {k: t for k, t in self.pings.items() if k in held}    # settled jobs need no memory
        for w, e in pings:
            await self.nc.publish(e.reply, b"+WPI")
            self.pings[(w.pid, e.stream_seq)] = now
        self.totals.pings += len(pings)
        if self.ever_all_ready and self.notifier and self.ready_count() > 0:
            self.notifier.watchdog()

    def kill(self, w: WorkerProcess, reason: str) -> None:
        log.warning("killing worker %d (pid %d): %s", w.slot, w.pid, reason,
                    extra={"event": "worker_killed", "slot": w.slot, "worker_pid": w.pid, "reason": reason})
        w.kill_reason = f"killed: {reason}"
        w.send(signal.SIGKILL)

    def due_pings(self, w: WorkerProcess, entries: list[slots.Entry], now: float) -> list:
        """+WPI for jobs a live, beating worker still holds, before their AckWait runs out.
        A worker that has stopped beating, or whose NATS connection has gone quiet, gets none:
        its jobs must be free to come back (its ack could not reach the server anyway)."""
        if not self.cfg.workers.progress_pings or not liveness.beat_fresh(now, w.table.heartbeat()):
            return []
        held = [e for e in entries if e.state in liveness.UNSETTLED and e.reply]
        if not self.link_fresh(w, held, now):
            return []
        return [(w, e) for e in liveness.pings_due(now, held, lambda e: self.timer_started(w, e), self.ack_wait)]

    def link_fresh(self, w: WorkerProcess, held: list[slots.Entry], now: float) -> bool:
        """Did the worker hear from NATS lately? Say so once when it stops, and explain in advance
        the redeliveries of what it holds: the server will hand them to someone else."""
        quiet = now - w.table.server_seen()
        if liveness.link_fresh(now, w.table.server_seen()):
            if w.pid in self.stale_links:
                self.stale_links.discard(w.pid)
                log.info("worker %d (pid %d): NATS answers again", w.slot, w.pid)
            return True
        if w.pid not in self.stale_links and w.ready_at is not None:
            self.stale_links.add(w.pid)
            why = f"held by worker {w.slot} (pid {w.pid}) whose NATS connection went quiet"
            for e in held:
                self.ledger.expect(e.stream_seq, why, e.delivery)
            self.alert("stale_connection", f"worker {w.slot} (pid {w.pid}) has had no answer from NATS for "
                                           f"{quiet:.0f}s; its {len(held)} job(s) are left to AckWait")
            log.warning("worker %d (pid %d): no answer from NATS for %.0fs; no more +WPI for its %d job(s)",
                        w.slot, w.pid, quiet, len(held))
        return False

    def recycle(self) -> None:
        """Replace one worker at a time that ran max_jobs or outgrew max_rss_mb: the replacement
        starts first, the old one retires once the new one is ready, so capacity never drops.
        One that reached max_jobs is retired only once its last job is done too: a retirement
        signalled mid-job would let graceful_timeout cut the job short, and its redelivery would
        reach a fresh worker's limit the same way, forever."""
        for w in self.retiring:
            if liveness.may_retire(w.last_job_started, w.drain_deadline is not None,
                                   w in self.replacing.values(), w.table.snapshot()):
                self.drain(w, signal.SIGUSR1)
        if self.stopping or self.replacing:
            return
        now = time.monotonic()
        check_rss = liveness.rss_check_due(now, self.last_rss_check, self.cfg.workers.max_rss_mb)
        if check_rss:
            self.last_rss_check = now
        for w in list(self.slots.values()):
            if w.state != "ready":
                continue
            reason = w.recycle_reason
            if check_rss and not reason:
                reason = liveness.rss_over(self.rss_of(w), self.cfg.workers.max_rss_mb)
            if reason:
                log.info("recycling worker %d (pid %d): %s", w.slot, w.pid, reason,
                         extra={"event": "worker_recycling", "slot": w.slot, "worker_pid": w.pid, "reason": reason})
                w.retiring = True
                self.retiring.append(w)
                del self.slots[w.slot]
                if self.spawn(w.slot) is not None:
                    self.replacing[w.slot] = w
                else:                            # no replacement to wait for: retire it now
                    self.drain(w, signal.SIGUSR1)
                return

    @staticmethod
    def rss_of(w: WorkerProcess) -> int:
        try:
            return psutil.Process(w.pid).memory_info().rss
        except psutil.Error:
            return 0

    async def audit(self) -> None:
        """Share our NAKs with peer supervisors; count redeliveries nobody explained; NAK once more
        a dead worker's job nobody has seen again; find what was in transit to a dead worker;
        say so while workers keep dying fast."""
        await self.peers.flush()
        await self.renak_unseen()
        await self.in_transit.step(time.monotonic(), self.held_anywhere, self.links_all_fresh_since,
                                   self.peers.alone(time.monotonic()))
        for r in self.ledger.confirm_suspects(time.monotonic(), SUSPECT_GRACE):
            log.warning("job seq=%d redelivered (delivery %d) and nothing explains it: AckWait (%gs) shorter than "
                        "the job, or held by a process outside any supervisor's ledger", r.seq, r.delivery,
                        self.ack_wait(r.delivery - 1),
                        extra={"event": "unexplained_redelivery", "seq": r.seq, "delivery": r.delivery})
        self.watch_deaths()

    def held_anywhere(self) -> set[int]:
        """Stream sequences in any worker's table, the dead not yet reaped included."""
        return {e.stream_seq for w in [*self.living(), *self.dead] for e in w.table.snapshot()}

    def links_all_fresh_since(self, t: float) -> bool:
        """Every live worker had a PONG from NATS for a PING it sent after `t`: each has read and
        recorded every message the server sent it before then."""
        return all(w.table.server_seen() > t for w in self.living() if w.status is None)

    def watch_deaths(self) -> None:
        now = time.monotonic()
        rate = self.restarts.rate
        if not rate.storm(now, max(1, self.target)) or now - self.last_storm_log < STORM_LOG_EVERY:
            return
        self.last_storm_log = now
        text = f"{rate.describe(now)}: restarts continue at full speed; find out why they die"
        self.alert("worker_deaths", text)
        log.warning("%s", text)

    async def renak_unseen(self) -> None:
        """A NAKed job can be handed straight to another dead worker's pull request when something
        else keeps that inbox alive (a `nats sub '>'` or '_INBOX.>' tap does): it would then wait
        for AckWait. One more NAK, liveness.RENAK_AFTER after a fence proved the first one arrived (two
        NAKs stuck in one stalled socket would arrive together and run the job twice), but only
        when that is safe: no supervisor has seen the job again, no worker of ours holds it, and
        its AckWait is far from over. A NAK
        matches by stream sequence, so a job redelivered to a consumer outside any supervisor
        would be NAKed too: every process bound to the consumer must be a supervisor's worker."""
        if not self.renak:
            return
        if any(n.confirmed_at is None for n in self.renak.values()) and self.nc.is_connected:
            await self.flush()                  # a NAK counts from when the server surely read it
        now, held = time.monotonic(), None
        for seq, n in list(self.renak.items()):
            if not self.ledger.awaiting_redelivery(seq, n.delivery):
                del self.renak[seq]
            elif liveness.renak_due(now, n.confirmed_at):
                del self.renak[seq]
                held = self.held_anywhere() if held is None else held
                if seq in held or not nak_is_safe(now, n.sent_at, self.ack_wait(n.delivery)) \
                        or not self.nc.is_connected:
                    continue
                log.warning("job seq=%d not seen again %.0fs after its NAK: NAKing it once more (is something "
                            "subscribed to '>' or '_INBOX.>'? it keeps dead pull requests alive)", seq,
                            now - n.sent_at, extra={"event": "renak", "seq": seq, "delivery": n.delivery})
                await self.nc.publish(n.reply, b"-NAK")

    # ================================================================ helpers

    async def flush(self) -> None:
        """Fence what we published (NAKs): on success, every NAK sent so far has arrived."""
        try:
            await self.nc.fence(timeout=2)
        except Exception as exc:
            log.warning("flushing NAKs to NATS failed: %s", exc or type(exc).__name__)
            return
        now = time.monotonic()
        for n in self.renak.values():
            if n.confirmed_at is None:
                n.confirmed_at = now

    def alert(self, kind: str, message: str) -> None:
        self.alerts.append({"kind": kind, "message": message, "t": time.time()})

    def status_line(self) -> str:
        return f"{self.ready_count()}/{self.target} workers ready"

    def slowest_job(self) -> float:
        return max([self.totals.max_duration, *(w.table.max_duration() for w in self.living())])

    def duration_histogram(self) -> tuple[list[int], float]:
        counts, total = list(self.totals.buckets), self.totals.duration_sum
        for w in self.living():
            buckets, s = w.table.histogram()
            counts = [a + b for a, b in zip(counts, buckets)]
            total += s
        return counts, total

    def progress_beat(self) -> float | None:
        """The last heartbeat of a live, beating worker running a job within its job_timeout
        (legitimate progress on a long job), or None when no worker shows any."""
        now, limit, latest = time.monotonic(), self.cfg.workers.job_timeout, None
        for w in self.living():
            beat = w.table.heartbeat()
            if w.status is None and liveness.beat_fresh(now, beat):
                if any(e.state == slots.RUNNING and (not limit or now - e.t_started < limit)
                       for e in w.table.snapshot()):
                    latest = beat if latest is None else max(latest, beat)
        return latest

    def worker_counters(self) -> dict[str, int]:
        """Jobs acked/naked/termed (and acked as duplicates without running) since start: exited
        workers' totals plus the living's tables."""
        live = self.living()
        return {"ack": self.totals.acked + sum(w.table.header(slots.ACKED_N) for w in live),
                "nak": self.totals.naked + sum(w.table.header(slots.NAKED_N) for w in live),
                "term": self.totals.termed + sum(w.table.header(slots.TERMED_N) for w in live),
                "duplicate": self.totals.duplicates + sum(w.table.header(slots.DUPLICATE_N) for w in live)}
