"""Autoscaling policy: more workers only while they help.

Pure and deterministic: no I/O, no clock reads. Every ``autoscale.interval`` the supervisor
hands :meth:`Autoscaler.decide` one :class:`Inputs` (the lag analysis, what the workers finished
over the last interval, how busy the CPUs were) and applies the :class:`Decision` it returns.

The seed post's warning is the whole design: "More workers only helps when the work is the
bottleneck. Check that the database or API behind the workers can take the extra concurrency."
Scaling on lag alone (KEDA's way) piles workers onto a saturated database. We also see what each
step did to the completion rate, so:

- **Up** while undelivered work waits at every sample and either it is not draining (pending
  grows, or stands still) or it would take longer than ``Params.eta_up`` to drain (a backlog
  gone before a step can even be measured is not worth one), and the previous step up paid:
  the completion rate rose by at least HELP_FRACTION of what one more worker as productive as
  the others would add, for each worker added. The first step adds one worker; each step that
  paid for every worker it added doubles the next (1, 2, 4, ...: a backlog that needs 5 workers
  gets them in three steps, not four dwells per worker), never beyond the count that would keep
  up with the arrivals and drain the backlog within ``eta_up`` at the measured rate per worker.
  The trend and the ETA are measured over the policy's own window, between the ConsumerInfo
  polls behind its first and last sample: lag.py's fits span 15-60 s for alerting and would lag
  behind a count that moves every few seconds. Its state still gates: ``unknown`` waits,
  ``stuck`` holds (more workers do not unstick workers).
- **Plateau**: the workers of a step up that did not pay are taken back (the extra workers only
  held jobs): a step of several keeps as many as its gain paid for (4 -> 8 that gained one
  worker's worth goes to 5), one that gained nothing is undone. The count where it stopped
  paying is remembered, and the reason says whether the CPUs were full or the
  bottleneck is downstream (a pool, a database, an API). Another step past it is probed only after
  ``probe_first_s``, doubling after each failed probe up to PROBE_MAX_S.
- **CPUs full**: while the box is at CPU_FULL and the workers spend CPU_BOUND of their time on a
  CPU or queued for one, no step up: it would only take cores from others.
- **Down**, one worker at a time, when nothing waited at any sample and the remaining workers
  would be at most DOWN_UTIL busy (idle, or workers waiting on nothing), never below ``min``.
- **Bounds**: never below ``min``, never above ``max``; a count outside them is moved in at once.

Hysteresis you can read off the numbers: up needs waiting work at every sample of the window and
an ETA beyond ``eta_up``; down needs no waiting work at any sample and utilisation at most
DOWN_UTIL after the step. Between the two the count holds. And every change is followed by a
dwell: the samples taken while new workers start are dropped (SETTLE_SAMPLES), then
MEASURE_SAMPLES samples are averaged before the next decision, so one noisy interval never moves
the count, and each step is judged on a settled rate. A rate judged on few jobs is noise: a step
up is neither taken nor judged until the rate's samples hold MEASURE_JOBS finished jobs (the
rate then spans as many recent samples as that takes, up to MEASURE_MAX_SAMPLES), so slow jobs
are measured longer, not more coarsely.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from supervisor.config import Config

# --- tuning (module constants; the config exposes only enabled/min/max/interval) ---------------

#: Samples dropped after every worker of a new count is ready: the interval they cover includes
#: the fork and first fetch, so its rate belongs to neither count.
SETTLE_SAMPLES = 1
#: Samples averaged per measurement. Three intervals of a 10 jobs/s queue hold ~30 completions:
#: the rate is good to a few %, well inside HELP_FRACTION.
MEASURE_SAMPLES = 3
#: A rate that judges or starts a step up spans the recent samples that hold this many finished
#: jobs (at least MEASURE_SAMPLES of them, at most MEASURE_MAX_SAMPLES: slow jobs are measured
#: longer; past the cap the policy goes by what it has).
MEASURE_JOBS = 30
MEASURE_MAX_SAMPLES = 30
#: A step up paid when the rate rose by at least this fraction of what the added workers would
#: add at the current per-worker rate. Free work gains ~100 %, a saturated pool or full CPUs ~0 %;
#: a quarter sits far from both and from the few % of measurement noise.
HELP_FRACTION = 0.25
#: Scale up for a backlog only when it would outlast this many measured steps (and this long):
#: one that drains before a step is even measured (the seed's 40-job burst) is not worth one.
ETA_UP_STEPS = 3
ETA_UP_MIN_S = 10.0
#: Scale down only when the workers left would be at most this busy (jobs in service / slots).
DOWN_UTIL = 0.5
#: The box's CPUs count as full at this fraction busy ...
CPU_FULL = 0.9
#: ... and the workers as CPU-bound when they spend this fraction of their time running on a CPU
#: or queued for one. Box CPU alone cannot tell our CPU-bound workers filling the cores from a
#: neighbour filling them while our workers sleep on I/O (more of those would still help).
CPU_BOUND = 0.5
#: The first probe past a plateau waits this long (or three steps, if longer); each failed probe
#: doubles the wait, up to PROBE_MAX_S.
PROBE_FIRST_S = 60.0
PROBE_MAX_S = 1800.0
#: A count set by hand (signal, POST /scale, `supervisor scale`, a reload changing workers.count)
#: is honoured this long before autoscaling resumes (a SIGHUP resumes it at once).
MANUAL_PAUSE_S = 600.0

#: Decision kinds: up, down, bounds (changes); plateau (a step undone, then the holds after it);
#: settling, waiting, steady, max, cpu, stuck, stalled (holds).
KINDS = ("up", "down", "bounds", "plateau", "settling", "waiting", "steady", "max", "cpu", "stuck", "stalled", "limit",
         "budget")


@dataclass(frozen=True)
class Params:
    min: int
    max: int
    interval: float
    settle_samples: int = SETTLE_SAMPLES
    measure_samples: int = MEASURE_SAMPLES
    help_fraction: float = HELP_FRACTION
    down_util: float = DOWN_UTIL
    cpu_full: float = CPU_FULL
    cpu_bound: float = CPU_BOUND

    @classmethod
    def from_config(cls, cfg: Config) -> Params:
        """From the config's [autoscale] section. Decisions need fresh ConsumerInfo, so they are
        never more frequent than monitor.interval polls."""
        a = cfg.autoscale
        return cls(min=a.min, max=a.max, interval=max(a.interval, cfg.monitor.interval))

    @property
    def step_s(self) -> float:
        """The dwell: the least time from one change to the next decision that may move again."""
        return (self.settle_samples + self.measure_samples) * self.interval

    @property
    def eta_up(self) -> float:
        return max(ETA_UP_MIN_S, ETA_UP_STEPS * self.step_s)

    @property
    def probe_first_s(self) -> float:
        return max(PROBE_FIRST_S, 3 * self.step_s)


@dataclass(frozen=True)
class Inputs:
    """What the supervisor saw over the last interval, at time ``now``."""
    now: float
    workers: int                # the current target
    ready: int                  # workers ready now
    concurrency: int            # jobs one worker runs at once
    lag_state: str              # unknown | ok | growing | stuck (lag.py)
    pending: int                # num_pending: stored, not yet delivered
    in_flight: int              # num_ack_pending
    polled_at: float | None     # when that ConsumerInfo answered (monotonic)
    completed: float            # jobs/s acked by our workers over the last interval
    job_time: float | None      # mean handler time of the jobs finished in the interval
    busy: float                 # jobs in service on average over the interval (Little's law)
    running: int                # jobs running at this instant
    cpu: float                  # fraction of the box's cores busy over the interval
    worker_cpu: float | None    # fraction of the workers' time on a CPU or queued for one
    cores: int
    limited: str = ""           # why a [limits.NAME] would keep more workers waiting ("" = none does)
    cap: int | None = None      # [autoscale] budget: this pool's share of it now (None: no budget) ...
    capped: str = ""            # ... and why it is no more (share() says)

    @property
    def work(self) -> int:
        return self.pending + self.in_flight


@dataclass(frozen=True)
class Decision:
    workers: int                # the count it was decided at
    target: int
    kind: str                   # see KINDS
    reason: str                 # one human line

    @property
    def changes(self) -> bool:
        return self.target != self.workers


@dataclass(frozen=True)
class Measurement:
    """MEASURE_SAMPLES samples at one count, averaged."""
    workers: int
    rate: float                 # jobs/s acked
    busy: float                 # jobs in service
    running_max: int
    job_time: float | None
    cpu: float
    worker_cpu: float | None
    backlog: bool               # undelivered work at every sample
    any_pending: bool           # undelivered work at some sample
    work: int                   # pending + in flight at the last sample
    work_slope: float | None    # jobs/s between the first and last poll: < 0 draining; None: one poll
    jobs: float = 0.0           # jobs finished in the samples `rate` spans
    limited: str = ""           # the last sample's reason a limit bound, if one did in any sample

    @property
    def eta(self) -> float | None:
        """Seconds until the work is gone at the window's net drain; None: not draining (or unknown)."""
        if self.work == 0:
            return 0.0
        return self.work / -self.work_slope if self.work_slope is not None and self.work_slope < 0 else None

    @classmethod
    def of(cls, xs: list[Inputs], interval: float = 1.0, longer: list[Inputs] | None = None) -> Measurement:
        """`xs` averaged; the rate (and job time) over `longer` instead when given: the recent
        samples it takes to hold MEASURE_JOBS finished jobs."""
        m = cls.over(xs, interval)
        if longer is None or len(longer) <= len(xs):
            return m
        wide = cls.over(longer, interval)
        return replace(m, rate=wide.rate, job_time=wide.job_time, jobs=wide.jobs)

    @classmethod
    def over(cls, xs: list[Inputs], interval: float) -> Measurement:
        n = len(xs)
        polled = (xs[-1].polled_at or 0.0) - (xs[0].polled_at or 0.0)
        times = [x.job_time for x in xs if x.job_time is not None]
        wcpu = [x.worker_cpu for x in xs if x.worker_cpu is not None]
        return cls(workers=xs[-1].workers, rate=sum(x.completed for x in xs) / n,
                   busy=sum(x.busy for x in xs) / n, running_max=max(x.running for x in xs),
                   job_time=sum(times) / len(times) if times else None, cpu=sum(x.cpu for x in xs) / n,
                   worker_cpu=sum(wcpu) / len(wcpu) if wcpu else None,
                   backlog=all(x.pending > 0 for x in xs), any_pending=any(x.pending > 0 for x in xs),
                   work=xs[-1].work, work_slope=(xs[-1].work - xs[0].work) / polled if polled > 0 else None,
                   jobs=sum(x.completed for x in xs) * interval,
                   limited=next((x.limited for x in reversed(xs) if x.limited), ""))

    def cpus_full(self, p: Params) -> bool:
        return self.cpu >= p.cpu_full and self.worker_cpu is not None and self.worker_cpu >= p.cpu_bound


class Autoscaler:
    """The policy's memory: the current count's samples, the last step up, the plateau."""

    def __init__(self, params: Params):
        self.params = params
        self.target: int | None = None          # what we last asked for (or found)
        self.changed_at: float | None = None    # when we last changed it ...
        self.last_change: Decision | None = None    # ... and why
        self.window: deque[Inputs] = deque(maxlen=MEASURE_MAX_SAMPLES)
        self.skip = params.settle_samples
        self.growth = 1                             # workers the next step up adds
        self.baseline: Measurement | None = None    # the count before the last step up, measured
        self.plateau: int | None = None             # the count past which a step did not pay
        self.plateau_note = ""                      # what that step did, and why
        self.probe_at: float | None = None
        self.probe_wait = params.probe_first_s
        self.last: Decision | None = None
        self.paid = 1.0                             # what the last step up paid, per worker it added (0..1)
        self.gain = 0.0                             # budget: the work one more worker would add here ...
        self.util: float | None = None              # ... and how busy its workers are, 0..1 (None: unmeasured)

    # ------------------------------------------------------------ the one entry point

    def decide(self, x: Inputs) -> Decision:
        p = self.params
        if x.workers != self.target:       # first call, or someone else set the count
            self.restart(x.workers)
            self.baseline = None           # their step is not ours to judge
            self.growth = 1
        bounded = min(max(x.workers, p.min), p.max)
        if bounded != x.workers:
            which = f"autoscale.min = {p.min}" if bounded > x.workers else f"autoscale.max = {p.max}"
            return self.change(x, bounded, "bounds", f"{x.workers} worker(s) is outside {which}")
        if x.cap is not None and x.workers > max(x.cap, p.min):
            return self.change(x, max(x.cap, p.min), "budget", x.capped or f"the budget leaves this pool {x.cap}")
        self.observe(x)
        if len(self.window) < p.measure_samples:
            return self.hold(x, "settling", self.settling_reason(x))
        m = self.measure()
        if m.jobs < MEASURE_JOBS and len(self.window) < MEASURE_MAX_SAMPLES and x.workers > 0 \
                and (self.baseline is not None or self.wants_more(x, m)):
            return self.hold(x, "settling", f"measuring {x.workers} worker(s): {m.jobs:.0f} of {MEASURE_JOBS} "
                                            f"jobs finished so far, too few to judge a rate by")
        return self.judge_step(x, m) or self.rules(x, m)

    # ------------------------------------------------------------ measuring

    def restart(self, workers: int) -> None:
        """A new count: its samples start over (the settle samples dropped first)."""
        self.target = workers
        self.window.clear()
        self.skip = self.params.settle_samples

    def observe(self, x: Inputs) -> None:
        # A worker starting (a step, a crash's restart, a recycle's replacement): this interval's
        # rate is not this count's. Skipped, not a reason to start over: a fleet that recycles
        # every few seconds (workers.max_jobs) must still be measurable.
        if x.ready < x.workers:
            return
        if self.skip > 0:
            self.skip -= 1
        else:
            self.window.append(x)

    def measure(self) -> Measurement:
        """The last measure_samples samples; their rate over as many recent samples as it takes
        to hold MEASURE_JOBS finished jobs (all the window, at most)."""
        xs, k, interval = list(self.window), self.params.measure_samples, self.params.interval
        wide = k
        while wide < len(xs) and sum(x.completed for x in xs[-wide:]) * interval < MEASURE_JOBS:
            wide += 1
        return Measurement.of(xs[-k:], interval, xs[-wide:])

    def settling_reason(self, x: Inputs) -> str:
        if x.ready < x.workers:
            return f"waiting for {x.workers - x.ready} of {x.workers} worker(s) to be ready"
        return f"measuring {x.workers} worker(s): {len(self.window)} of {self.params.measure_samples} samples"

    # ------------------------------------------------------------ judging the last step up

    def judge_step(self, x: Inputs, m: Measurement) -> Decision | None:
        """Once per step up, on its first full measurement: did it pay, for each worker it added?
        Keep the workers its gain paid for (at least HELP_FRACTION of a worker each, the first
        ones counted first); take back the rest."""
        b, self.baseline = self.baseline, None
        if b is None or not (b.backlog and m.backlog) or b.rate <= 0.0 or b.workers <= 0:
            return None                    # no backlog on both sides: the rates say nothing
        added = m.workers - b.workers
        per_worker = b.rate / b.workers
        gain = m.rate - b.rate
        keep = max(0, min(added, math.floor(gain / per_worker + 1.0 - self.params.help_fraction)))
        self.paid = max(0.0, min(1.0, gain / (per_worker * added))) if added > 0 else 1.0
        if keep == added:
            self.growth = 2 * added        # it paid in full: the next step may be twice as large
            if self.plateau is not None and m.workers > self.plateau:
                self.plateau, self.probe_at = None, None          # the bottleneck moved
                self.probe_wait = self.params.probe_first_s
            return None
        back = b.workers + keep
        self.plateau, self.growth = back, 1
        self.probe_at = x.now + self.probe_wait
        wait, self.probe_wait = self.probe_wait, min(2 * self.probe_wait, PROBE_MAX_S)
        like = "one more worker" if added == 1 else f"{added} more workers"
        self.plateau_note = (f"{b.workers} -> {m.workers} workers moved jobs/s {b.rate:.1f} -> {m.rate:.1f} "
                             f"({gain / b.rate:+.0%}, where {like} like the others would add "
                             f"{added / b.workers:+.0%}){self.job_time_note(b, m)}: {self.bottleneck(m)}")
        kept = f"keeping the {keep} it paid for, {back}" if keep else f"back to {back}"
        return self.change(x, back, "plateau", f"{self.plateau_note}; {kept}, probing again in {wait:.0f} s")

    def bottleneck(self, m: Measurement) -> str:
        p = self.params
        if m.cpu >= p.cpu_full and (m.worker_cpu is None or m.worker_cpu >= p.cpu_bound):
            return f"the CPUs are full (box {m.cpu:.0%} busy)"
        return f"a downstream bottleneck (box CPU {m.cpu:.0%})"

    @staticmethod
    def job_time_note(b: Measurement, m: Measurement) -> str:
        if b.job_time and m.job_time:
            return f", jobs took {b.job_time * 1000:.0f} -> {m.job_time * 1000:.0f} ms"
        return ""

    # ------------------------------------------------------------ the rules

    def rules(self, x: Inputs, m: Measurement) -> Decision:
        p, n = self.params, x.workers
        if x.lag_state == "unknown":
            return self.hold(x, "waiting", "no lag analysis yet (waiting for ConsumerInfo)")
        if x.lag_state == "stuck" and n > 0:
            return self.hold(x, "stuck", "lag is stuck: more workers cannot fix workers that do not finish")
        want = self.wants_more(x, m)
        if want:
            if n > 0 and m.rate <= 0.0:
                return self.hold(x, "stalled", f"{want}, but {n} worker(s) acked nothing: "
                                               f"more would not either")
            if n >= p.max:
                return self.hold(x, "max", f"{want}; at autoscale.max = {p.max}")
            limited = x.limited or m.limited       # any sample: a slot between two jobs may read free
            if limited:
                return self.hold(x, "limit", f"{want}, but {limited}: more workers would only wait for it")
            if x.cap is not None and n >= x.cap:
                return self.hold(x, "budget", f"{want}, but {x.capped or f'the budget leaves this pool {x.cap}'}")
            if m.cpus_full(p):
                return self.hold(x, "cpu", f"{want}, but the CPUs are full: box {m.cpu:.0%} busy and workers "
                                           f"{m.worker_cpu:.0%} of their time on or queued for a CPU "
                                           f"({x.cores} cores); more would only share them")
            if self.plateau is not None and n >= self.plateau:
                if self.probe_at is not None and x.now < self.probe_at:
                    return self.hold(x, "plateau", f"holding at the plateau of {self.plateau}: "
                                                   f"{self.plateau_note}. {want[0].upper()}{want[1:]}; "
                                                   f"probing again in {self.probe_at - x.now:.0f} s")
                want += f"; probing past the plateau at {self.plateau}"
                self.growth = 1
            step = min(self.step_size(x, m), p.max - n, (x.cap - n) if x.cap is not None else p.max)
            self.baseline = m
            return self.change(x, n + step, "up", f"{want} ({m.rate:.1f} jobs/s at {n}; +{step})")
        shed = self.can_shed(x, m)
        if shed and n > p.min:
            return self.change(x, n - 1, "down", shed)
        return self.hold(x, "steady", self.steady_reason(x, m, shed))

    def step_size(self, x: Inputs, m: Measurement) -> int:
        """Workers to add: `growth`, but no more than would keep up with the arrivals and drain
        the backlog within eta_up at the measured rate per worker (at least one)."""
        n = x.workers
        if n == 0 or m.rate <= 0.0 or m.work_slope is None:
            return 1
        arrivals = max(0.0, m.rate + m.work_slope)         # what finished plus what the work grew by
        needed = math.ceil((arrivals + m.work / self.params.eta_up) / (m.rate / n))
        return max(1, min(self.growth, needed - n))

    def wants_more(self, x: Inputs, m: Measurement) -> str:
        """Why one more worker would help ("" when it would not): work waits at every sample
        and is not draining, or would outlast eta_up at the window's net drain. Measured over
        the policy's own window: lag.py's trends span 15-60 s for alerting, and lag behind a
        count that changes every few seconds."""
        if not m.backlog or m.work_slope is None:
            return ""
        if m.eta is None:
            return f"{x.pending} waiting and not draining ({m.work_slope:+.1f}/s)"
        if m.eta > self.params.eta_up:
            return f"backlog of {m.work} would take ~{m.eta:.1f} s (> {self.params.eta_up:g} s)"
        return ""

    def can_shed(self, x: Inputs, m: Measurement) -> str:
        """Why one worker fewer would do ("" when it would not): nothing waited at any sample
        and the workers left would be at most down_util busy."""
        n, slots = x.workers, max(1, x.concurrency)
        if n == 0 or m.any_pending:
            return ""
        left = (n - 1) * slots
        if m.busy > self.params.down_util * left or m.running_max > left:
            return ""
        if m.busy < 0.05 and m.running_max == 0:
            return f"idle: nothing pending, nothing running at {n} worker(s)"
        return (f"nothing pending and {m.busy:.1f} job(s) in service at {n} worker(s): "
                f"{n - 1} would be at most {self.params.down_util:.0%} busy")

    def steady_reason(self, x: Inputs, m: Measurement, shed: str) -> str:
        n = x.workers
        if shed:
            return f"{shed}; at autoscale.min = {self.params.min}"
        if m.backlog and m.work_slope is None:
            return f"{x.pending} waiting; no new ConsumerInfo in the window to tell whether it drains"
        if m.backlog and m.eta is not None:
            return (f"backlog of {m.work} drains in ~{m.eta:.0f} s at {n} worker(s) "
                    f"(another is worth it beyond {self.params.eta_up:g} s)")
        util = m.busy / max(1, n * max(1, x.concurrency))
        return f"{n} worker(s) {util:.0%} busy, {m.rate:.1f} jobs/s, keeping up"

    # ------------------------------------------------------------ outcomes

    def change(self, x: Inputs, target: int, kind: str, reason: str) -> Decision:
        if kind != "up":
            self.growth = 1
        self.restart(target)
        self.last = self.last_change = Decision(x.workers, target, kind, reason)
        self.changed_at = x.now
        self.wanting(kind, up=kind == "up")
        return self.last

    def hold(self, x: Inputs, kind: str, reason: str) -> Decision:
        if kind != "settling":
            self.growth = 1                # growing needs one step up after another
        self.last = Decision(x.workers, x.workers, kind, reason)
        self.wanting(kind, up=kind == "budget")
        return self.last

    def cut(self, now: float, workers: int, cap: int, reason: str) -> Decision:
        """The budget leaves this pool fewer workers than it has (another pool's backlog needs
        them): down to its share at once, before any pool grows, so the pools together never
        have more than the budget."""
        target = max(cap, self.params.min)
        self.restart(target)
        self.growth = 1
        self.last = self.last_change = Decision(workers, target, "budget", reason)
        self.changed_at = now
        return self.last

    def wanting(self, kind: str, up: bool) -> None:
        """Whether one more worker would do work here (for sharing a budget): after a step up, or
        held back by the budget, what the last step paid; settling and bounds change nothing."""
        if up:
            self.gain = self.paid
        elif kind not in ("settling", "bounds", "budget"):
            self.gain = 0.0

    def claim(self, name: str, workers: int, concurrency: int, fixed: bool = False) -> Claim:
        """This pool's part in sharing the budget (`share`): what its measured work says."""
        m = self.measure() if self.window else None
        if m is not None and m.workers > 0:     # a count just changed is as busy as the last measured, until measured
            self.util = min(1.0, m.busy / (m.workers * max(1, concurrency)))
        eta = math.inf if m is None or m.eta is None else m.eta
        return Claim(name, workers, self.params.min, self.gain, workers * (1.0 if self.util is None else self.util),
                     eta, fixed)


# ---------------------------------------------------------------- [autoscale] budget: one count for every pool

@dataclass(frozen=True)
class Claim:
    """One pool's part in sharing `autoscale.budget`, in work: the worker-seconds of handler time
    per second a worker does there, measured, so that a pool of slow jobs weighs as much as one
    of fast jobs (in jobs/s the fast one would always win)."""
    name: str
    workers: int        # its count now
    floor: int          # autoscale.min: never fewer
    gain: float         # the work one more worker would add (its last step's pay; 0: it wants none, or it would not help)
    busy: float         # the work its workers do now, in workers (jobs in service / concurrency)
    eta: float          # seconds its backlog takes to drain (inf: not draining, or unmeasured): breaks ties
    fixed: bool = False     # a count set by hand, or autoscaling off: taken from the budget as it is

    def worth(self, k: int) -> float:
        """The work its k-th worker (1-based) does or would do: an existing one, its part of
        `busy` (the busiest first); a new one, `gain`."""
        return max(0.0, min(1.0, self.busy - (k - 1))) if k <= self.workers else self.gain


def share(budget: int, claims: list[Claim]) -> dict[str, tuple[int, str]]:
    """Each pool's share of the budget: (most workers it may have, why no more). Pure.

    Every pool keeps its floor; a pool whose count is fixed keeps its count. The rest of the
    budget goes one worker at a time to the pool where that worker does the most work: an
    existing worker counts what it does now (`Claim.worth`) plus HELP_FRACTION, a new one what a
    new one would add (`gain`): a worker moves only for a quarter of a worker's work more than
    it does where it is (what a step up must pay too), so measurement noise never moves one back
    and forth. On equal work, an existing worker stays, then the pool whose backlog would take
    longer to drain gets it. So a busy pool keeps its workers, an idle pool's
    extra workers go where a backlog waits, and come back when the backlog does."""
    out = {c.name: c.workers if c.fixed else min(c.floor, budget) for c in claims}
    left = budget - sum(out.values())
    open_ = [c for c in claims if not c.fixed]
    while left > 0 and open_:
        def worth(c: Claim) -> tuple[float, int, float]:
            existing = out[c.name] < c.workers
            return c.worth(out[c.name] + 1) + (HELP_FRACTION if existing else 0.0), int(existing), c.eta
        best = max(open_, key=worth)
        if worth(best)[0] <= 0 and not worth(best)[1]:
            break                           # nobody's next worker is known to do anything ...
        out[best.name] += 1
        left -= 1
    waiting = [c for c in open_ if c.eta > 0]
    if left > 0 and waiting:                # ... the rest may go to the longest backlog, if its own policy wants it
        out[max(waiting, key=lambda c: c.eta).name] += left
    return {c.name: (out[c.name], why_capped(budget, c, out)) for c in claims}


def why_capped(budget: int, c: Claim, out: dict[str, int]) -> str:
    others = ", ".join(f"{name} {n}" for name, n in out.items() if name != c.name)
    return (f"autoscale.budget = {budget} is shared: {c.name} {out[c.name]}, {others} (a worker goes where it does "
            "the most work)")


def limit_binds(rows: list[tuple[str, int, int | None, int, int | None, int, int]], running: int) -> str:
    """Why a fleet-wide limit keeps more workers from helping, or "": it is used up across the
    fleet, and the jobs here need it: some wait for it, or (a cap) every job running here holds
    it, so the next job a new worker would take is one more waiting for it. (Jobs that need no
    limit running beside them: more workers may help those, so no claim.) Each row: (name,
    concurrency, slots in use fleet-wide, starts its rate allows per window, starts in the window
    now, jobs of ours waiting for it, slots jobs of ours hold); `running`: jobs running here."""
    for name, concurrency, in_use, window, starts, waiting, held in rows:
        full = bool(concurrency) and in_use is not None and in_use >= concurrency
        if full and waiting > 0:
            return f"limit {name} is full ({in_use}/{concurrency} in use, {waiting} job(s) here waiting for it)"
        if full and running > 0 and held >= running:
            return f"limit {name} is full ({in_use}/{concurrency} in use, every job running here holds it)"
        if waiting > 0 and window and starts is not None and starts >= window:
            return f"limit {name}'s rate is used up ({starts} starts in its window, {waiting} job(s) here waiting)"
    return ""
