"""Autoscaling mechanism: measure, ask the policy (autoscale.py), apply through Arbiter.scale().

The arbiter's loop calls :meth:`Scaler.tick` every pass; every ``autoscale.interval`` it turns
the cumulative numbers the supervisor already keeps into one interval's worth of
:class:`~supervisor.autoscale.Inputs`, asks the policy, and scales. Nothing here runs on a task
or a callback of its own: the loop stays the one writer of the worker count.

Where each input comes from:
- jobs acked and their handler time: the workers' shared-memory counters and duration sums
  (exited workers' totals included), differenced per interval; jobs in service on average is
  the handler time finished per second (Little's law), jobs running now is read off the tables;
- the lag state and the consumer's pending / ack-pending: the monitor (lag.py, ConsumerInfo);
- the box's CPU: psutil.cpu_times() differenced here (not cpu_percent(): its baseline is
  module-global, so any other caller in the process would shorten our interval);
- the workers' CPU: /proc/<pid>/task/*/schedstat, time on a CPU plus time queued for one, per
  thread (a sync handler runs in a thread). Queued time counts because a CPU-bound worker on a
  busy box spends it waiting for a core, not sleeping on I/O; unreadable (not Linux): None,
  and the policy goes by the rates alone.

A count set by hand (SIGTTIN/SIGTTOU, POST /scale, `supervisor scale`, a reload that changes
workers.count) wins: autoscaling pauses for MANUAL_PAUSE_S, or until a SIGHUP, and says so.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Protocol

import psutil

from supervisor.config import Config
from supervisor.core.autoscale import MANUAL_PAUSE_S, Autoscaler, Claim, Decision, Inputs, Params, limit_binds
from supervisor.core.lag import LagAnalyzer
from supervisor.parent.pool import Pool
from supervisor.parent.stats import Stats
from workers.protocol import slots
from workers.protocol.limitkeys import rate_window

log = logging.getLogger("supervisor.autoscale")


class Host(Protocol):
    """What the autoscaler reads of its pool (parent/crew.py), and the one thing it asks of it."""
    cfg: Config
    pool: Pool
    stats: Stats

    @property
    def stopping(self) -> str | None: ...

    def scale(self, n: int, source: str) -> None: ...


class LagSource(Protocol):
    """What it reads of the monitor (parent/tasks/monitor.py): the consumer's numbers and lag state."""
    consumer: dict[str, Any] | None
    polled_at: float | None
    analyzer: LagAnalyzer

    @property
    def limits(self) -> dict[str, dict[str, int]]: ...    # [limits.NAME] in use fleet-wide


@dataclass(frozen=True)
class Reading:
    """One interval's worth of the workers' and the box's numbers."""
    completed: float            # jobs/s acked
    job_time: float | None      # mean handler seconds of the jobs finished
    busy: float                 # jobs in service on average
    cpu: float                  # fraction of the box's cores busy
    worker_cpu: float | None    # fraction of the workers' time on or queued for a CPU


class Meter:
    """Cumulative counters in, per-interval rates out. The first call only sets the baseline."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.acked = self.finished = 0
        self.handler_s = 0.0
        self.cpu = box_cpu()
        self.sched: dict[int, int] = {}

    def read(self, now: float, arb: Host) -> Reading | None:
        acked = arb.stats.worker_counters()["ack"]
        counts, handler_s = arb.stats.duration_histogram()
        finished = sum(counts)
        cpu = box_cpu()
        sched = {w.pid: n for w in arb.pool.slots.values() if (n := sched_ns(w.pid)) is not None}
        prev_at, prev = self.at, (self.acked, self.finished, self.handler_s, self.cpu, self.sched)
        self.at, self.acked, self.finished, self.handler_s, self.cpu, self.sched = \
            now, acked, finished, handler_s, cpu, sched
        if prev_at is None or now <= prev_at:
            return None
        dt = now - prev_at
        p_acked, p_finished, p_handler_s, p_cpu, p_sched = prev
        jobs, spent = finished - p_finished, max(0.0, handler_s - p_handler_s)
        busy_cpu, total_cpu = cpu[0] - p_cpu[0], cpu[1] - p_cpu[1]
        on_cpu = [max(0, n - p_sched[pid]) for pid, n in sched.items() if pid in p_sched]
        return Reading(completed=max(0, acked - p_acked) / dt, job_time=spent / jobs if jobs > 0 else None,
                       busy=spent / dt, cpu=min(1.0, max(0.0, busy_cpu / total_cpu)) if total_cpu > 0 else 0.0,
                       # a worker's loop thread adds a little to its handler thread's 100 %
                       worker_cpu=min(1.0, sum(on_cpu) / 1e9 / (len(on_cpu) * dt)) if on_cpu else None)


def box_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole box since boot."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    # guest time is already counted in user on Linux
    total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    return total - idle, total


def sched_ns(pid: int) -> int | None:
    """Nanoseconds a process's threads have spent on a CPU or runnable and waiting for one."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                run, wait = f.read().split()[:2]
        except (OSError, ValueError):
            continue             # a thread that just exited
        total += int(run) + int(wait)
    return total


class Scaler:
    def __init__(self, arb: Host):
        self.arb = arb
        self.monitor: LagSource | None = None    # set once the monitor exists (parent/supervisor.py)
        self.policy = Autoscaler(Params.from_config(arb.cfg))
        self.meter = Meter()
        self.cores = psutil.cpu_count() or os.cpu_count() or 1
        self.due = 0.0
        self.paused_until: float | None = None
        self.pause_reason = ""
        self.logged_kind = ""
        self.cap: int | None = None      # [autoscale] budget: this pool's share (the arbiter's budget step sets it) ...
        self.capped = ""                 # ... and why no more

    @property
    def enabled(self) -> bool:
        return self.arb.cfg.autoscale.enabled

    def due_in(self, now: float) -> float:
        """Seconds until the next decision (the loop sleeps no longer)."""
        return max(0.0, self.due - now) if self.enabled and not self.arb.stopping else float("inf")

    # ------------------------------------------------------------ the loop's hook

    def tick(self, now: float) -> None:
        if not self.enabled or self.arb.stopping or now < self.due:
            return
        self.due = now + self.policy.params.interval
        reading = self.meter.read(now, self.arb)     # also while paused: each reading spans one interval
        if self.paused_until is not None:
            if now < self.paused_until:
                return
            self.resume(f"{MANUAL_PAUSE_S / 60:g} min after the manual scale")
        if reading is None:
            return
        self.apply(self.policy.decide(self.inputs(now, reading)))

    def inputs(self, now: float, r: Reading) -> Inputs:
        arb, mon = self.arb, self.monitor
        consumer = (mon.consumer if mon else None) or {}
        lag_state = mon.analyzer.report(now).state if mon and consumer else "unknown"
        running = sum(1 for w in arb.pool.living() for e in w.table.snapshot() if e.state == slots.RUNNING)
        return Inputs(now=now, workers=arb.pool.target, ready=arb.pool.ready_count(),
                      concurrency=arb.cfg.workers.concurrency,
                      lag_state=lag_state, pending=consumer.get("num_pending", 0),
                      in_flight=consumer.get("num_ack_pending", 0), polled_at=mon.polled_at if mon else None,
                      completed=r.completed, job_time=r.job_time,
                      busy=r.busy, running=running, cpu=r.cpu, worker_cpu=r.worker_cpu, cores=self.cores,
                      limited=self.limited(running), cap=self.cap, capped=self.capped)

    def limited(self, running: int) -> str:
        """A limit the fleet uses up while our jobs need it (core/autoscale.py limit_binds)."""
        cfg, here = self.arb.cfg, self.arb.stats.limits()
        fleet = self.monitor.limits if self.monitor else {}
        return limit_binds([(name, lim.concurrency, fleet.get(name, {}).get("in_use"),
                             rate_window(lim.rate)[0] if lim.rate else 0, fleet.get(name, {}).get("starts"),
                             int(here.get(name, {}).get("waiting", 0)), int(here.get(name, {}).get("held", 0)))
                            for name, lim in cfg.limits.items()], running)

    def apply(self, d: Decision) -> None:
        extra = {"event": "autoscale", "kind": d.kind, "workers": d.workers, "target": d.target, "reason": d.reason}
        if d.changes:
            log.info("autoscale: %d -> %d worker(s) (%s): %s", d.workers, d.target, d.kind, d.reason, extra=extra)
            self.arb.scale(d.target, source="autoscale")
        elif d.kind != self.logged_kind and d.kind != "settling":
            log.info("autoscale: holding at %d worker(s) (%s): %s", d.workers, d.kind, d.reason, extra=extra)
        if d.kind != "settling":
            self.logged_kind = d.kind

    # ------------------------------------------------------------ [autoscale] budget

    def claim(self, name: str) -> Claim:
        """This pool's part in sharing the budget (core/autoscale.py share); its count is fixed
        while set by hand, or with autoscaling off."""
        return self.policy.claim(name, self.arb.pool.target, self.arb.cfg.workers.concurrency,
                                 fixed=not self.enabled or self.paused_until is not None)

    def share(self, cap: int | None, why: str) -> None:
        """The budget's share for this pool (None: no budget); above it, down to it at once."""
        self.cap, self.capped = cap, why
        if cap is not None and self.enabled and self.paused_until is None and self.arb.pool.target > cap \
                and not self.arb.stopping:
            self.apply(self.policy.cut(time.monotonic(), self.arb.pool.target, cap, why))

    # ------------------------------------------------------------ people

    def manual(self, n: int, source: str, over_budget: int = 0) -> None:
        """Someone set the count: honour it for MANUAL_PAUSE_S (or until a SIGHUP), past
        `[autoscale] budget` too (`over_budget`: by how many workers the pools are then): the
        budget binds autoscaling, not a person; once autoscaling resumes, the pool is cut to
        its share."""
        if not self.enabled:
            return
        self.paused_until = time.monotonic() + MANUAL_PAUSE_S
        self.pause_reason = f"paused after a manual scale to {n} ({source})"
        if over_budget > 0:
            self.pause_reason += (f"; the pools are {over_budget} worker(s) over autoscale.budget = "
                                  f"{self.arb.cfg.autoscale.budget} until it resumes")
        self.logged_kind = ""
        (log.warning if over_budget > 0 else log.info)(
            "autoscale: %s; resumes in %g min or at SIGHUP", self.pause_reason, MANUAL_PAUSE_S / 60,
            extra={"event": "autoscale_paused", "target": n, "over_budget": max(0, over_budget)})

    def resume(self, why: str) -> None:
        self.paused_until = None
        self.pause_reason = ""
        log.info("autoscale: resumes (%s)", why, extra={"event": "autoscale_resumed", "why": why})

    def reload(self, cfg: Config) -> None:
        """SIGHUP: new bounds and interval; a pause ends; turning autoscaling off returns the
        count to workers.count (the arbiter's config is already the new one)."""
        was = self.policy.params
        self.policy.params = Params.from_config(cfg)
        if self.paused_until is not None:
            self.resume("SIGHUP")
        if cfg.autoscale.enabled:
            self.due = min(self.due, time.monotonic() + self.policy.params.interval)
        elif self.policy.target is not None:           # it was on: the configured count again
            self.policy = Autoscaler(self.policy.params)
            if self.arb.pool.target != cfg.workers.count:
                self.arb.scale(cfg.workers.count, source="reload")
        if was != self.policy.params:
            log.info("autoscale: min %d, max %d, every %g s", cfg.autoscale.min, cfg.autoscale.max,
                     self.policy.params.interval)

    # ------------------------------------------------------------ /status

    def status(self, now: float) -> dict[str, Any]:
        a, p, d = self.arb.cfg.autoscale, self.policy, self.policy.last
        paused_until = self.paused_until if self.enabled else None
        block: dict[str, Any] = {"enabled": a.enabled, "target": self.arb.pool.target, "min": a.min, "max": a.max,
                                 "interval": p.params.interval}
        if not a.enabled:
            block.update(kind="disabled", reason="autoscale.enabled = false: the count is workers.count, or "
                                                 "what was set by hand")
        elif paused_until is not None:
            block.update(kind="paused", reason=f"{self.pause_reason}; resumes in "
                                               f"{paused_until - now:.0f} s or at SIGHUP")
        elif d is None:
            block.update(kind="starting", reason="first decision after one interval's measurement")
        else:
            block.update(kind=d.kind, reason=d.reason)
        block["last_change_s"] = None if p.changed_at is None else round(now - p.changed_at, 3)
        c = p.last_change
        block["last_change"] = None if c is None else f"{c.workers} -> {c.target} ({c.kind}): {c.reason}"
        block["plateau"] = p.plateau
        block["next_probe_s"] = None if p.probe_at is None else round(max(0.0, p.probe_at - now), 1)
        block["resumes_in_s"] = round(paused_until - now, 1) if paused_until is not None else None
        block["dwell_s"] = p.params.step_s
        if a.budget:
            block["budget"], block["cap"] = a.budget, self.cap
        return block
