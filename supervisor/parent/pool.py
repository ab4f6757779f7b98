"""The pool: which worker runs in which slot, and a worker's life from fork to forget.

A slot is a worker index 0..target-1 (the shared-memory table is a worker's `table`). A worker is
in exactly one place: `slots` (serving), `retiring` (told to finish and exit: scaled down,
recycled, a stop), or gone. A recycle starts the replacement first and keeps the old worker in
`replacing` until the new one is ready, so capacity never drops. A slot whose worker died waits
in `restart_at` for the delay the restart policy (policy.py) gave it.

The arbiter's loop is the only caller; it forks through `fork` (so the loop's callbacks for a
worker's exit and events stay the arbiter's) and decides when the pool may grow (not while
stopping). The rules about when to retire, kill or recycle are pure, in liveness.py.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable

import psutil

from supervisor.config import Config
from supervisor.core import liveness
from supervisor.core.policy import RestartPolicy, job_limit
from supervisor.parent.process import WorkerProcess, WorkerState
from supervisor.parent.stats import Stats
from workers.protocol import slots
from workers.protocol.slots import SlotTable
from workers.runtime.pulls import BUFFER_REQUESTS

log = logging.getLogger("supervisor")


class Pool:
    def __init__(self, cfg: Config, fork: Callable[[WorkerProcess], None], restarts: RestartPolicy,
                 stats: Stats, alert: Callable[[str, str], None]):
        self.cfg, self.fork, self.restarts, self.stats, self.alert = cfg, fork, restarts, stats, alert
        self.target = cfg.workers.count
        self.slots: dict[int, WorkerProcess] = {}
        self.retiring: list[WorkerProcess] = []
        self.replacing: dict[int, WorkerProcess] = {}     # slot -> old worker awaiting its replacement's ready
        self.restart_at: dict[int, float] = {}             # slot -> when its dead worker's successor may start
        self.waiting_for_nats: set[int] = set()            # slots whose worker could not reach NATS in an outage
        self.last_rss_check = 0.0

    def living(self) -> list[WorkerProcess]:
        return [*self.slots.values(), *self.retiring]

    def ready_count(self) -> int:
        return sum(1 for w in self.slots.values() if w.state == WorkerState.READY)

    def next_restart(self) -> float | None:
        """When the earliest waiting slot may start its worker."""
        due = [t for s, t in self.restart_at.items() if s not in self.slots]
        return min(due) if due else None

    # ---------------------------------------------------------------- growing and shrinking

    def restore_count(self, now: float) -> None:
        """Retire what is above the target, start what is missing below it (unless its slot still
        waits out a restart delay)."""
        for slot in sorted(self.slots, reverse=True):
            if slot >= self.target:
                self.retire(self.slots.pop(slot), "scaled down")
        for slot in [s for s in self.replacing if s >= self.target]:
            self.release_replaced(slot)         # its replacement is gone with the slot: no waiting for it
        for slot in [s for s in self.restart_at if s >= self.target]:
            del self.restart_at[slot]
        for slot in range(self.target):
            if slot not in self.slots and self.restart_at.get(slot, 0.0) <= now:
                self.spawn(slot)

    def nats_back(self, now: float) -> None:
        """NATS is reachable again: slots backing off because their workers could not reach it
        start now, not at the end of a backoff the outage grew."""
        for slot in self.waiting_for_nats:
            if slot in self.restart_at:
                self.restart_at[slot] = min(self.restart_at[slot], now)
        self.waiting_for_nats.clear()

    def spawn(self, slot: int) -> WorkerProcess | None:
        table = SlotTable(self.table_entries(), self.reply_bytes(), len(self.cfg.limits),
                          slots.KEY_BYTES if self.cfg.ordering.key else 0)
        table.set_state(slots.STARTING)        # before the fork: the child may be READY before we return
        w = WorkerProcess(slot, table)
        w.limit_names = tuple(self.cfg.limits)
        w.job_limit = job_limit(self.cfg.workers.max_jobs, self.cfg.workers.max_jobs_jitter)
        w.graceful_timeout = self.cfg.workers.graceful_timeout
        try:
            self.fork(w)
        except OSError as exc:                 # EAGAIN (TasksMax, RLIMIT_NPROC), EMFILE, ENOMEM
            self.spawn_failed(w, exc)
            return None
        table.q[slots.PID] = w.pid
        self.slots[slot] = w
        self.restart_at.pop(slot, None)
        log.debug("worker %d started (pid %d)", slot, w.pid, extra={"event": "worker_started", "slot": slot,
                                                                    "worker_pid": w.pid})
        return w

    def spawn_failed(self, w: WorkerProcess, exc: OSError) -> None:
        """No child: the slot backs off like after a boot crash (a fork that fails keeps failing)."""
        cause = f"cannot fork: {exc.strerror or exc}"
        delay = self.restarts.died(time.monotonic(), w.slot, cause, None, 0)
        self.restart_at[w.slot] = time.monotonic() + delay
        self.alert("spawn_failed", f"worker {w.slot}: {cause}; retrying in {delay:.2f}s")
        log.error("worker %d: %s; retrying in %.2fs", w.slot, cause, delay,
                  extra={"event": "spawn_failed", "slot": w.slot, "cause": cause, "delay": delay})

    def table_entries(self) -> int:
        # Pulled + running (concurrency + the largest buffer), and as many again awaiting ack
        # confirmation. [ordering]: room as well for every job the consumer may have delivered
        # (max_ack_pending), parked until it is the first of its key: a worker whose table were
        # full of parked jobs could not take the redelivery their key waits for
        # (workers/runtime/ordering.py). Pages of unused entries are never touched.
        w, map_ = self.cfg.workers, self.cfg.consumer.max_ack_pending
        parked = map_ if self.cfg.ordering.key else 0
        return 2 * (w.concurrency + min(BUFFER_REQUESTS * w.batch, map_)) + parked

    def reply_bytes(self) -> int:
        return 256 + len(self.cfg.stream.name) + len(self.cfg.consumer.name)

    # ---------------------------------------------------------------- retiring

    def retire(self, w: WorkerProcess, why: str) -> None:
        """Take a worker out for good: it stops pulling, runs what it holds, exits (SIGUSR1)."""
        log.info("worker %d (pid %d): %s; retiring it", w.slot, w.pid, why,
                 extra={"event": "worker_retiring", "slot": w.slot, "worker_pid": w.pid, "reason": why})
        w.retiring = True
        self.retiring.append(w)
        self.drain(w, signal.SIGUSR1)

    def drain(self, w: WorkerProcess, sig: int) -> None:
        """SIGUSR1: retire (finish what it holds). SIGTERM: stop (NAK what has not started). The
        worker's own graceful_timeout, not today's: a SIGHUP that lowered it must not cut the
        grace of a worker forked before it (it is replaced, and drains, under the old one)."""
        deadline = liveness.drain_deadline(time.monotonic(), w.graceful_timeout)
        w.drain_deadline = min(w.drain_deadline or deadline, deadline)
        w.state = WorkerState.DRAINING
        w.send(sig)

    def worker_ready(self, w: WorkerProcess, now: float) -> None:
        if w.state == WorkerState.STARTING:
            w.state = WorkerState.READY
        w.ready_at = now
        self.restarts.ready()
        log.info("worker %d ready (pid %d, %.0f ms)", w.slot, w.pid, 1000 * (now - w.started_at),
                 extra={"event": "worker_ready", "slot": w.slot, "worker_pid": w.pid,
                        "ms": round(1000 * (now - w.started_at))})
        self.release_replaced(w.slot)         # the replacement serves: retire the old one

    def release_replaced(self, slot: int) -> None:
        """The worker a recycle is replacing in `slot` may go now. One that reached max_jobs goes
        once its last job is done too (recycle() sees to it)."""
        old = self.replacing.pop(slot, None)
        if old is not None and not old.last_job_started:
            self.drain(old, signal.SIGUSR1)

    def recycle(self, stopping: bool) -> None:
        """Replace one worker at a time that ran max_jobs or outgrew max_rss_mb: the replacement
        starts first, the old one retires once the new one is ready, so capacity never drops.
        One that reached max_jobs is retired only once its last job is done too (liveness.may_retire)."""
        for w in self.retiring:
            if liveness.may_retire(w.last_job_started, w.drain_deadline is not None,
                                   w in self.replacing.values(), w.table.snapshot()):
                self.drain(w, signal.SIGUSR1)
        if stopping or self.replacing:
            return
        now = time.monotonic()
        check_rss = liveness.rss_check_due(now, self.last_rss_check, self.cfg.workers.max_rss_mb)
        if check_rss:
            self.last_rss_check = now
        for w in list(self.slots.values()):
            if w.state != WorkerState.READY:
                continue
            reason = w.recycle_reason
            if check_rss and not reason:
                reason = liveness.rss_over(rss_of(w), self.cfg.workers.max_rss_mb)
            if reason:
                self.replace(w, reason)
                return

    def replace(self, w: WorkerProcess, reason: str) -> None:
        log.info("recycling worker %d (pid %d): %s", w.slot, w.pid, reason,
                 extra={"event": "worker_recycling", "slot": w.slot, "worker_pid": w.pid, "reason": reason})
        w.retiring = True
        self.retiring.append(w)
        del self.slots[w.slot]
        if self.spawn(w.slot) is not None:
            self.replacing[w.slot] = w
        else:                            # no replacement to wait for: retire it now
            self.drain(w, signal.SIGUSR1)

    # ---------------------------------------------------------------- after a death

    def forget(self, w: WorkerProcess) -> None:
        if self.slots.get(w.slot) is w:
            del self.slots[w.slot]
        if w in self.retiring:
            self.retiring.remove(w)
        if self.replacing.get(w.slot) is w:
            del self.replacing[w.slot]

    def plan_restart(self, w: WorkerProcess, cause: str, jobs_finished: int, stopping: bool,
                     nats_down: bool = False, counts: bool = True) -> None:
        """A worker died (not a clean exit): its slot restarts after the policy's delay. `counts`:
        towards the boot halt, if it never got ready."""
        self.stats.totals.worker_deaths += 1
        if stopping:
            return
        now = time.monotonic()
        ready_for = now - w.ready_at if w.ready_at is not None else None
        delay = self.restarts.died(now, w.slot, cause, ready_for, jobs_finished, nats_down or not counts)
        if w.retiring or w.slot >= self.target:
            return
        self.restart_at[w.slot] = now + delay
        if nats_down:
            self.waiting_for_nats.add(w.slot)
        self.stats.restarted(w.slot)
        log.info("restarting worker %d in %.2fs", w.slot, delay,
                 extra={"event": "worker_restart_planned", "slot": w.slot, "worker_pid": w.pid, "delay": delay})


def rss_of(w: WorkerProcess) -> int:
    try:
        return psutil.Process(w.pid).memory_info().rss
    except psutil.Error:
        return 0
