"""The pool's counters: what exited workers did (carried over when they are reaped) plus what the
living's shared-memory tables say now. /status, /metrics, the monitor and the autoscaler read
these; nothing here decides anything."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

from supervisor.core import liveness
from supervisor.parent.process import WorkerProcess
from workers.protocol import slots
from workers.runtime.pulls import residual


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
    limit_taken: dict[str, int] = dataclasses.field(default_factory=dict)      # [limits.NAME]: times taken ...
    limit_waited: dict[str, float] = dataclasses.field(default_factory=dict)   # ... and seconds waited
    order_checks: int = 0           # [ordering]: the stream asked ...
    order_waited: float = 0.0       # ... and seconds jobs waited parked


class Stats:
    def __init__(self, living: Callable[[], list[WorkerProcess]]):
        self.living = living
        self.totals = Totals()
        self.slot_restarts: collections.Counter = collections.Counter()

    def carry(self, w: WorkerProcess) -> None:
        """A worker is gone: keep what its table counted before the table is unmapped."""
        t = w.table
        self.totals.acked += t.header(slots.ACKED_N)
        self.totals.naked += t.header(slots.NAKED_N)
        self.totals.termed += t.header(slots.TERMED_N)
        self.totals.duplicates += t.header(slots.DUPLICATE_N)
        buckets, total = t.histogram()
        self.totals.buckets = [a + b for a, b in zip(self.totals.buckets, buckets)]
        self.totals.duration_sum += total
        self.totals.max_duration = max(self.totals.max_duration, t.max_duration())
        self.totals.order_checks += t.header(slots.ORDER_CHECKS)
        self.totals.order_waited += t.header_seconds(slots.ORDER_WAITED)
        for k, name in enumerate(w.limit_names):
            _, _, taken, waited = t.limit(k)
            self.totals.limit_taken[name] = self.totals.limit_taken.get(name, 0) + taken
            self.totals.limit_waited[name] = self.totals.limit_waited.get(name, 0.0) + waited

    def restarted(self, slot: int) -> None:
        self.totals.restarts += 1
        self.slot_restarts[slot] += 1

    def worker_counters(self) -> dict[str, int]:
        """Jobs acked/naked/termed (and acked as duplicates without running) since start: exited
        workers' totals plus the living's tables."""
        live = self.living()
        return {"ack": self.totals.acked + sum(w.table.header(slots.ACKED_N) for w in live),
                "nak": self.totals.naked + sum(w.table.header(slots.NAKED_N) for w in live),
                "term": self.totals.termed + sum(w.table.header(slots.TERMED_N) for w in live),
                "duplicate": self.totals.duplicates + sum(w.table.header(slots.DUPLICATE_N) for w in live)}

    def share_spread(self) -> float:
        """Pull sizing's fleet-wide view (workers/runtime/pulls.py): every living worker's recent
        job times pooled into one residual, written back to each. A worker that has not met a
        long job yet then stops buffering short jobs ahead of its first one, like the rest."""
        live = self.living()
        sums = [w.table.spread() for w in live]
        fleet = residual(sum(a for a, _, _ in sums), sum(b for _, b, _ in sums))
        seen = sum(n for _, _, n in sums)
        for w in live:
            w.table.set_fleet_spread(fleet, seen)
        return fleet

    def limits(self) -> dict[str, dict[str, float]]:
        """Per limit, this supervisor's workers: slots held and jobs waiting now; times taken and
        seconds waited since start (exited workers' too)."""
        out: dict[str, dict[str, float]] = {}
        for name in set(self.totals.limit_taken) | set(self.totals.limit_waited):
            out[name] = {"held": 0, "waiting": 0, "taken": self.totals.limit_taken.get(name, 0),
                         "wait_s": self.totals.limit_waited.get(name, 0.0)}
        for w in self.living():
            for k, name in enumerate(w.limit_names):
                held, waiting, taken, waited = w.table.limit(k)
                row = out.setdefault(name, {"held": 0, "waiting": 0, "taken": 0, "wait_s": 0.0})
                row["held"] += held
                row["waiting"] += waiting
                row["taken"] += taken
                row["wait_s"] += waited
        return out

    def ordering(self) -> tuple[int, float]:
        """[ordering]: (times the stream was asked, seconds jobs waited parked) since start."""
        live = self.living()
        return (self.totals.order_checks + sum(w.table.header(slots.ORDER_CHECKS) for w in live),
                self.totals.order_waited + sum(w.table.header_seconds(slots.ORDER_WAITED) for w in live))

    def slowest_job(self) -> float:
        return max([self.totals.max_duration, *(w.table.max_duration() for w in self.living())])

    def duration_histogram(self) -> tuple[list[int], float]:
        counts, total = list(self.totals.buckets), self.totals.duration_sum
        for w in self.living():
            buckets, s = w.table.histogram()
            counts = [a + b for a, b in zip(counts, buckets)]
            total += s
        return counts, total

    def progress_beat(self, job_timeout: float) -> float | None:
        """The last heartbeat of a live, beating worker running a job within its job_timeout
        (legitimate progress on a long job), or None when no worker shows any."""
        now, latest = time.monotonic(), None
        for w in self.living():
            beat = w.table.heartbeat()
            if w.status is None and liveness.beat_fresh(now, beat) and w.table.running_since(
                    now - job_timeout if job_timeout else 0.0):
                latest = beat if latest is None else max(latest, beat)
        return latest
