"""Unit tests for supervisor/core/autoscale.py on simulated workloads, with a fake clock.

A tiny simulator stands in for the world: a queue with an arrival pattern, N workers that take
STARTUP seconds to become ready, and a service model (free work, a pool of K connections, CPU-bound
work on 2 cores). Its ConsumerInfo numbers go through the real LagAnalyzer, as the monitor's do,
and every `interval` the policy decides from the same inputs the supervisor gives it. Each test
states the target the policy settles on, how fast, and how often it changed direction.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest

from supervisor.core.autoscale import (
    MEASURE_JOBS,
    MEASURE_MAX_SAMPLES,
    PROBE_MAX_S,
    Autoscaler,
    Decision,
    Inputs,
    Params,
    limit_binds,
)
from supervisor.core.lag import LagAnalyzer, Sample

DT = 0.05               # simulation step (s)
STARTUP = 0.3           # fork to ready (s)
MONITOR = 0.5           # ConsumerInfo poll period (s)


# ---------------------------------------------------------------- service models

@dataclass(frozen=True)
class Service:
    """How n busy workers perform: jobs/s together, seconds per job (waits included), the box's
    CPU they use, and the fraction of their time they are on or queued for a CPU."""
    name: str
    rate: Callable[[int], float]
    job_time: Callable[[int], float]
    box_cpu: Callable[[int], float]
    worker_cpu: float | None


def free(job: float = 0.1, cores: int = 2) -> Service:
    """Sleep-like jobs with no shared limit: throughput linear in n."""
    return Service("free", lambda n: n / job, lambda n: job, lambda n: min(1.0, 0.01 * n / cores), 0.02)


def pool(k: int, job: float = 0.1, cores: int = 2) -> Service:
    """Each job holds one of k connections for `job` seconds; workers beyond k wait for one."""
    return Service(f"pool of {k}", lambda n: min(n, k) / job, lambda n: job * max(1.0, n / k),
                   lambda n: min(1.0, 0.01 * n / cores), 0.02)


def cpu_bound(cores: int = 2, job: float = 0.05) -> Service:
    """Each job burns `job` CPU seconds: n workers share the cores."""
    return Service(f"CPU-bound on {cores} cores", lambda n: min(n, cores) / job,
                   lambda n: job * max(1.0, n / cores), lambda n: min(1.0, n / cores), 1.0)


# ---------------------------------------------------------------- arrival patterns

def backlog(n: int, at: float = 0.0) -> Callable[[float, float], float]:
    return lambda t, dt: n if at <= t < at + dt else 0.0


def steady(per_s: float, until: float = math.inf) -> Callable[[float, float], float]:
    return lambda t, dt: per_s * dt if t < until else 0.0


def bursts(n: int, every: float, first: float = 5.0, count: int = 1000) -> Callable[[float, float], float]:
    def arrive(t: float, dt: float) -> float:
        k = round((t - first) / every)
        return n if 0 <= k < count and abs(t - (first + k * every)) < dt / 2 else 0.0
    return arrive


# ---------------------------------------------------------------- the simulator

@dataclass
class Sim:
    service: Service
    arrivals: Callable[[float, float], float]
    params: Params
    workers: int = 1
    cores: int = 2
    noise: float = 0.0            # relative sd of the service rate per step
    background_cpu: float = 0.0   # a neighbour's CPU use
    seed: int = 1
    t: float = 0.0
    work: float = 0.0             # stored + in flight
    acked: float = 0.0
    starting: list[float] = field(default_factory=list)      # ready times of starting workers
    ready: int = 0
    history: list[tuple[float, int]] = field(default_factory=list)
    decisions: list[tuple[float, Decision]] = field(default_factory=list)
    emptied_at: float | None = None

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.policy = Autoscaler(self.params)
        self.lag = LagAnalyzer(60.0, 30.0, MONITOR)
        self.starting = [STARTUP] * self.workers
        self.history.append((0.0, self.workers))
        self.acc = {"acked": 0.0, "busy": 0.0, "cpu": 0.0, "wcpu": 0.0, "time": 0.0}

    def busy_now(self) -> int:
        return min(self.ready, math.ceil(self.work - 1e-9))

    def step(self) -> None:
        self.work += self.arrivals(self.t, DT)
        self.ready += sum(1 for r in self.starting if r <= self.t)
        self.starting = [r for r in self.starting if r > self.t]
        busy = self.busy_now()
        done = 0.0
        if busy:
            factor = max(0.0, 1.0 + self.noise * self.rng.gauss(0.0, 1.0))
            done = min(self.work, self.service.rate(busy) * DT * factor)
        self.work -= done
        self.acked += done
        a = self.acc
        a["acked"] += done
        a["busy"] += busy * DT
        a["cpu"] += min(1.0, self.background_cpu + self.service.box_cpu(busy)) * DT
        a["wcpu"] += (self.service.worker_cpu or 0.0) * busy * DT
        a["time"] += DT
        if self.work < 0.5 and self.emptied_at is None and self.acked > 0:
            self.emptied_at = self.t
        elif self.work >= 0.5:
            self.emptied_at = None
        self.t = round(self.t + DT, 6)

    def consumer_info(self) -> tuple[int, int]:
        work = round(self.work)
        in_flight = min(work, self.ready)
        return work - in_flight, in_flight

    def poll(self) -> None:
        pending, in_flight = self.consumer_info()
        acked = int(self.acked)
        self.lag.add(Sample(self.t, pending, in_flight, 0, acked + in_flight, acked, acked, False))
        self.polled = (self.t, pending, in_flight)

    def inputs(self) -> Inputs:
        a, n = self.acc, self.target
        polled_at, pending, in_flight = self.polled
        report = self.lag.report(self.t)
        span = a["time"] or 1.0
        busy = a["busy"] / span
        finished = a["acked"]
        x = Inputs(now=self.t, workers=n, ready=self.ready, concurrency=1, lag_state=report.state,
                   pending=pending, in_flight=in_flight, polled_at=polled_at, completed=finished / span,
                   job_time=self.service.job_time(max(1, round(busy))) if finished else None, busy=busy,
                   running=self.busy_now(), cpu=a["cpu"] / span,
                   worker_cpu=(a["wcpu"] / (n * span) if n else 0.0) if self.service.worker_cpu is not None else None,
                   cores=self.cores)
        self.acc = dict.fromkeys(a, 0.0)
        return x

    @property
    def target(self) -> int:
        return self.history[-1][1]

    def scale(self, n: int) -> None:
        old = self.target
        if n > old:
            self.starting += [self.t + STARTUP] * (n - old)
        for _ in range(old - n):           # drop starting workers first, then ready ones
            if self.starting:
                self.starting.pop()
            else:
                self.ready -= 1
        self.history.append((self.t, n))

    def run(self, until: float) -> Sim:
        next_poll, next_decision = self.t, self.t + self.params.interval
        while self.t < until:
            self.step()
            if self.t >= next_poll:
                self.poll()
                next_poll += MONITOR
            if self.t >= next_decision - 1e-9:
                d = self.policy.decide(self.inputs())
                self.decisions.append((self.t, d))
                if d.target != self.target:
                    self.scale(d.target)
                next_decision += self.params.interval
        return self

    # ------------------------------------------------------------ what the tests read

    def targets(self) -> list[int]:
        return [n for _, n in self.history]

    def direction_changes(self, until: float = math.inf) -> int:
        steps = [b - a for (_, a), (t, b) in zip(self.history, self.history[1:]) if t <= until]
        signs = [s > 0 for s in steps if s]
        return sum(1 for a, b in zip(signs, signs[1:]) if a != b)

    def first_time(self, pred: Callable[[int], bool], after: float = 0.0) -> float | None:
        """The first time from `after` on at which the target satisfies pred; None: never."""
        if pred([n for t, n in self.history if t <= after][-1]):
            return after
        return next((t for t, n in self.history if t > after and pred(n)), None)

    def first_undo(self) -> float | None:
        """When the target first went down."""
        return next((t for (_, a), (t, b) in zip(self.history, self.history[1:]) if b < a), None)

    def settled(self) -> tuple[int, float]:
        """(final target, when it was first reached for good)."""
        final = self.target
        since = 0.0
        for t, n in self.history:
            if n != final:
                since = None
            elif since is None:
                since = t
        return final, since

    def kinds(self) -> list[str]:
        return [d.kind for _, d in self.decisions]

    def timeline(self) -> str:
        return " ".join(f"{t:.0f}s:{n}" for t, n in self.history)


def params(interval: float = 1.0, lo: int = 1, hi: int = 6) -> Params:
    return Params(min=lo, max=hi, interval=interval)


# ---------------------------------------------------------------- the workloads

def test_free_work_scales_to_max_with_a_backlog_and_back_to_min_after():
    """The issue's first real-server case: 0.1 s jobs, no shared limit, min 1 max 6."""
    sim = Sim(free(), backlog(3000), params()).run(150)
    up = sim.first_time(lambda n: n >= 5)
    assert up is not None and up <= 30, sim.timeline()
    assert max(sim.targets()) == 6, "never above max, but there"
    assert sim.emptied_at is not None
    down = sim.first_time(lambda n: n == 1, after=sim.emptied_at)
    assert down is not None and down - sim.emptied_at <= 60, sim.timeline()
    assert sim.direction_changes() == 1, sim.timeline()       # up, then down: no oscillation
    # Up by doubling steps while each pays (1, 2, 4, then max), down one at a time, and never
    # faster than the dwell.
    changes = list(zip(sim.history, sim.history[1:]))
    assert [n for _, n in sim.history[:4]] == [1, 2, 4, 6], sim.timeline()
    assert all(a - b == 1 for (_, a), (_, b) in changes if b < a)
    assert all(t2 - t1 >= sim.params.step_s - 1e-6 for (t1, _), (t2, _) in changes[1:])


def test_free_work_at_a_steady_rate_settles_where_it_keeps_up():
    """35 jobs/s of 0.1 s jobs needs 3.5 workers: settles at 4 or 5 and stays, never oscillating."""
    sim = Sim(free(), steady(35.0), params(hi=8)).run(300)
    final, since = sim.settled()
    assert final in (4, 5), sim.timeline()
    assert since <= 40, sim.timeline()
    assert sim.direction_changes() == 0, sim.timeline()
    assert sim.decisions[-1][1].kind == "steady"


def test_pool_of_two_settles_at_two_and_probes_rarely():
    """0.1 s jobs behind 2 connections: 1 -> 2 paid, so the next step doubles; 4 workers add
    nothing, the step is undone, the plateau remembered; probes past it (one worker) come after
    60 s, then 120 s, then 240 s."""
    sim = Sim(pool(2), backlog(100_000), params()).run(600)
    assert sim.targets()[:4] == [1, 2, 4, 2] and max(sim.targets()) == 4, sim.timeline()
    assert sim.settled()[0] == 2 and sim.first_undo() <= 15, sim.timeline()
    assert sim.first_time(lambda n: n != 2, after=sim.first_undo()) >= 60, "held until the first probe"
    assert sim.direction_changes(until=60) == 1, sim.timeline()
    probes = sum(1 for (_, a), (_, b) in zip(sim.history, sim.history[1:]) if (a, b) == (2, 3))
    assert 2 <= probes <= 3, sim.timeline()
    assert sim.direction_changes() == 1 + 2 * probes, sim.timeline()
    plateau = [d for _, d in sim.decisions if d.kind == "plateau" and d.changes]
    assert plateau and "downstream bottleneck" in plateau[0].reason, plateau[0].reason
    holds = [d for _, d in sim.decisions if d.kind == "plateau" and not d.changes]
    assert holds and "probing again in" in holds[-1].reason
    assert sim.policy.plateau == 2


def test_pool_of_four_settles_at_four():
    sim = Sim(pool(4), backlog(100_000), params(hi=8)).run(60)
    assert sim.settled()[0] == 4, sim.timeline()
    assert sim.targets()[:5] == [1, 2, 4, 8, 4], sim.timeline()


@pytest.mark.parametrize("k", [3, 5, 6])
def test_a_step_of_several_keeps_the_workers_its_gain_paid_for(k):
    """A pool of k: the doubling step past it keeps the workers that added throughput (4 -> 8
    behind 5 or 6 connections gains one or two workers' worth: 5 or 6), and holds there."""
    sim = Sim(pool(k), backlog(100_000), params(hi=8)).run(60)
    assert sim.settled()[0] == k and sim.policy.plateau == k, sim.timeline()
    trimmed = next(d for _, d in sim.decisions if d.kind == "plateau" and d.changes)
    assert ("keeping the" in trimmed.reason) is (trimmed.target > trimmed.workers // 2), trimmed.reason
    assert "probing again in" in trimmed.reason


def test_cpu_bound_on_two_cores_holds_at_the_core_count():
    sim = Sim(cpu_bound(cores=2), backlog(100_000), params()).run(120)
    assert sim.targets() == [1, 2], sim.timeline()
    assert sim.settled()[1] <= 5
    last = sim.decisions[-1][1]
    assert last.kind == "cpu" and "CPUs are full" in last.reason, last


def test_cpu_bound_without_per_worker_cpu_finds_the_plateau_from_the_rate_alone():
    """Where /proc/<pid>/task/*/schedstat is unreadable the rates alone still stop it at 2."""
    service = replace(cpu_bound(cores=2), worker_cpu=None)
    sim = Sim(service, backlog(100_000), params()).run(60)
    assert sim.settled()[0] == 2 and max(sim.targets()) == 4, sim.timeline()
    plateau = next(d for _, d in sim.decisions if d.kind == "plateau")
    assert "CPUs are full" in plateau.reason, plateau.reason


def test_a_busy_neighbour_does_not_stop_free_work_from_scaling():
    """The box's CPUs full of someone else's work: sleeping workers still help, so up they go."""
    sim = Sim(free(), backlog(3000), params(), background_cpu=0.97).run(40)
    assert sim.first_time(lambda n: n >= 5) <= 30, sim.timeline()
    assert "cpu" not in sim.kinds()


def test_the_seed_burst_does_not_scale():
    """40 jobs at once on 2 workers at 0.5 s/job drain in ~10 s: not worth a step (eta_up 12 s)."""
    sim = Sim(free(job=0.5), backlog(40, at=5.0), params(lo=2, hi=8), workers=2).run(60)
    assert sim.targets() == [2], sim.timeline()
    assert sim.emptied_at is not None


def test_repeated_seed_bursts_do_not_ratchet_up():
    sim = Sim(free(job=0.5), bursts(40, every=20.0), params(lo=2, hi=8), workers=2).run(300)
    assert max(sim.targets()) <= 3, sim.timeline()
    assert sim.direction_changes() <= 2 * 1, sim.timeline()


def test_a_big_burst_scales_up_then_back_down_once():
    sim = Sim(free(job=0.5), backlog(400, at=5.0), params(lo=2, hi=8), workers=2).run(200)
    assert max(sim.targets()) >= 4, sim.timeline()
    assert sim.settled()[0] == 2
    assert sim.direction_changes() == 1, sim.timeline()


@pytest.mark.parametrize("seed", range(5))
def test_noisy_service_still_settles_without_flapping(seed):
    """15 % noise per 50 ms step on the service rate (the real box's jitter is of that order)."""
    sim = Sim(pool(2), backlog(100_000), params(), noise=0.15, seed=seed).run(50)
    assert sim.settled()[0] == 2 and max(sim.targets()) == 4, sim.timeline()
    assert sim.direction_changes() == 1, sim.timeline()
    free_sim = Sim(free(), backlog(3000), params(), noise=0.15, seed=seed).run(40)
    assert free_sim.first_time(lambda n: n >= 5) <= 30 and free_sim.direction_changes() == 0, free_sim.timeline()


def test_the_defaults_get_a_free_work_backlog_its_workers_within_30_s():
    """Every [autoscale] key at its default but enabled (1 s decisions, max 8): a backlog that
    needs 5 or more workers has them within 30 s, and the count is back at 1 once it is gone."""
    from supervisor.config import Config

    p = Params.from_config(Config().replace(autoscale={"enabled": True}))
    sim = Sim(free(), backlog(5000), p).run(200)
    up = sim.first_time(lambda n: n >= 5)
    assert up is not None and up <= 30, sim.timeline()
    assert max(sim.targets()) == 8 and sim.direction_changes() == 1, sim.timeline()
    assert sim.emptied_at is not None and sim.settled()[0] == 1, sim.timeline()


def test_an_interval_of_5_s_is_just_slower():
    """interval 5 s (the default): the same shapes, five times slower."""
    p = params(interval=5.0)
    sim = Sim(pool(2), backlog(100_000), p).run(300)
    assert sim.settled()[0] == 2 and sim.direction_changes(until=110) == 1, sim.timeline()
    sim = Sim(free(), backlog(20_000), p).run(300)
    assert sim.first_time(lambda n: n >= 5) <= 5 * 30, sim.timeline()


# ---------------------------------------------------------------- the rules one by one

def test_idle_steps_down_one_at_a_time_with_a_dwell_and_stops_at_min():
    sim = Sim(free(), steady(0.0), params(lo=2), workers=6).run(60)
    assert sim.targets() == [6, 5, 4, 3, 2], sim.timeline()
    times = [t for t, _ in sim.history[1:]]
    assert all(b - a >= sim.params.step_s - 1e-6 for a, b in zip(times, times[1:]))
    assert "idle" in next(d.reason for _, d in sim.decisions if d.kind == "down")
    assert "autoscale.min = 2" in sim.decisions[-1][1].reason


def test_hysteresis_a_load_between_the_thresholds_holds():
    """16 jobs/s of 0.1 s jobs on 3 workers: 53 % busy. Too busy to drop to 2 (80 %), too idle to
    add one (nothing waits): it holds for ten minutes."""
    sim = Sim(free(), steady(16.0), params(hi=8), workers=3).run(600)
    assert sim.targets() == [3], sim.timeline()
    sim = Sim(free(), steady(9.0), params(hi=8), workers=3).run(600)     # 30 %: 2 would be 45 %
    assert sim.targets() == [3, 2], sim.timeline()


@pytest.mark.parametrize("pending, kind", [((0, 0, 0, 0), "down"), ((0, 0, 5, 0), "steady")])
def test_a_step_down_needs_no_waiting_work_at_any_sample(pending, kind):
    """Workers 10 % busy, but 5 jobs waited at one sample: that is not "waiting on nothing"."""
    p = Autoscaler(params())
    for t, waiting in enumerate(pending):
        d = p.decide(x_(now=t, pending=waiting, in_flight=0, busy=0.2, running=0, completed=2.0))
    assert d.kind == kind, d


def test_bounds_apply_at_once():
    sim = Sim(free(), steady(0.0), params(lo=2, hi=4), workers=7)
    sim.run(1.0)
    assert sim.targets() == [7, 4] and sim.decisions[0][1].kind == "bounds"
    assert "autoscale.max = 4" in sim.decisions[0][1].reason
    sim = Sim(free(), steady(0.0), params(lo=2, hi=4), workers=0).run(1.0)
    assert sim.targets() == [0, 2]


def test_scales_from_zero_when_work_arrives():
    sim = Sim(free(), backlog(500, at=10.0), params(lo=0, hi=4), workers=0).run(25)
    assert sim.targets()[:2] == [0, 1] and max(sim.targets()) >= 2, sim.timeline()


def x_(**kw) -> Inputs:
    base = dict(now=0.0, workers=2, ready=2, concurrency=1, lag_state="ok", pending=100, in_flight=2, completed=20.0,
                job_time=0.1, busy=2.0, running=2, cpu=0.1, worker_cpu=0.02, cores=2)
    base.update(kw)
    base.setdefault("polled_at", base["now"])      # a fresh ConsumerInfo per decision
    return Inputs(**base)


def feed(policy: Autoscaler, start: float, n: int, **kw) -> Decision:
    d = None
    for i in range(n):
        d = policy.decide(x_(now=start + i, **kw))
    return d


@pytest.mark.parametrize("rate3, helped", [(20.0, False), (22.4, False), (22.6, True), (30.0, True)])
def test_a_step_pays_at_a_quarter_of_a_worker(rate3, helped):
    """2 workers at 20/s: one more like them adds 10/s, so 3 must reach 22.5/s to count."""
    p = Autoscaler(params())
    d = feed(p, 0, 4)
    assert (d.kind, d.target) == ("up", 3)
    d = feed(p, 4, 4, workers=3, ready=3, completed=rate3, busy=3.0, running=3)
    assert (d.target > 3) is helped and (d.target == 2) is not helped, d
    if not helped:
        assert d.kind == "plateau" and p.plateau == 2


def test_a_backlog_that_ends_during_the_step_is_not_held_against_it():
    p = Autoscaler(params())
    feed(p, 0, 4)
    d = feed(p, 4, 4, workers=3, ready=3, completed=20.0, pending=0, busy=2.0, running=2)
    assert d.kind != "plateau" and p.plateau is None


def test_probe_waits_double_after_each_failure_and_reset_after_a_success():
    p = Autoscaler(params())
    waits = []
    t = 0.0
    for _ in range(8):
        feed(p, t, 4)                                  # at 2, probing or first step: up to 3
        t += 4
        d = feed(p, t, 4, workers=3, ready=3, busy=3.0, running=3)       # 3 adds nothing
        assert d.kind == "plateau" and d.target == 2
        waits.append(p.probe_at - (t + 3))
        t = p.probe_at
    assert waits[:3] == [60.0, 120.0, 240.0] and max(waits) == PROBE_MAX_S
    feed(p, t, 4)
    d = feed(p, t + 4, 4, workers=3, ready=3, completed=30.0, busy=3.0, running=3)
    assert p.plateau is None and d.target == 4 and p.probe_wait == 60.0


@pytest.mark.parametrize("kw, kind, words", [
    (dict(ready=1), "settling", "waiting for 1 of 2"),
    (dict(lag_state="unknown"), "waiting", "no lag analysis"),
    (dict(lag_state="stuck"), "stuck", "lag is stuck"),
    (dict(completed=0.0), "stalled", "acked nothing"),        # once MEASURE_MAX_SAMPLES found no finished job
    (dict(limited="limit db is full (3/3 in use, 4 job(s) here waiting for it)"), "limit",
     "but limit db is full (3/3 in use, 4 job(s) here waiting for it): more workers would only wait"),
])
def test_holds(kw, kind, words):
    p = Autoscaler(params())
    d = feed(p, 0, MEASURE_MAX_SAMPLES + 1, **kw)
    assert d.kind == kind and words in d.reason and d.target == 2, d
    assert feed(p, 40, 8, **kw) == d, "a hold is stable"
    assert feed(Autoscaler(params()), 0, 4).kind == "up", "while the same inputs with a backlog go up"


def test_a_backlog_draining_within_eta_up_holds_and_one_that_is_not_draining_goes_up():
    p = Autoscaler(params())
    for t in range(8):                  # 150 jobs draining at 10/s: gone in ~15 s, eta_up is 12 s
        d = p.decide(x_(now=t, pending=150 - 10 * t))
    assert d.kind == "steady" and "drains in ~8 s" in d.reason, d
    p = Autoscaler(params())
    d = feed(p, 0, 4, pending=80)
    assert d.kind == "up" and "not draining" in d.reason, d     # the same 80 waiting: it never clears


def test_without_a_fresh_consumer_info_a_flat_backlog_is_no_reason():
    """Three decisions on one ConsumerInfo say nothing about the trend: no "not draining"."""
    p = Autoscaler(params())
    d = feed(p, 0, 8, pending=80, polled_at=0.0)
    assert d.kind == "steady" and "no new ConsumerInfo" in d.reason, d


def test_decisions_are_never_more_frequent_than_consumer_info_polls():
    from supervisor.config import Config

    cfg = Config().replace(autoscale={"interval": 0.2, "min": 2, "max": 5}, monitor={"interval": 1.5})
    p = Params.from_config(cfg)
    assert (p.min, p.max, p.interval, p.step_s, p.eta_up) == (2, 5, 1.5, 6.0, 18.0)
    assert Params.from_config(Config()).interval == 1.0


def test_someone_else_changing_the_count_restarts_the_measurement_and_is_not_judged():
    p = Autoscaler(params())
    assert feed(p, 0, 4).target == 3
    d = p.decide(x_(now=4, workers=5, ready=5))
    assert d.kind == "settling" and "0 of 3" in d.reason
    d = feed(p, 5, 4, workers=5, ready=5, completed=20.0)          # 5 workers no faster than 2 ...
    assert d.kind != "plateau" and p.plateau is None                # ... but we did not add them


def test_slow_jobs_are_measured_longer_before_a_step_up():
    """10 s jobs on one worker finish 0.1 a second: three samples hold no rate worth judging. The
    step up waits until the samples hold MEASURE_JOBS jobs, or MEASURE_MAX_SAMPLES were taken."""
    p = Autoscaler(params())
    kw = dict(workers=1, ready=1, completed=0.1, busy=1.0, running=1, job_time=10.0, pending=100)
    d = feed(p, 0, 4, **kw)
    assert d.kind == "settling" and f"of {MEASURE_JOBS} jobs finished" in d.reason, d
    d = feed(p, 4, MEASURE_MAX_SAMPLES - 3, **kw)
    assert (d.kind, d.target) == ("up", 2), d
    # a rate with enough jobs in it goes at once
    assert feed(Autoscaler(params()), 0, 4, workers=1, ready=1, completed=10.0, busy=1.0, running=1).kind == "up"


def test_the_step_up_is_no_larger_than_the_backlog_needs():
    """The doubling is capped by the count that would keep up and drain the backlog within eta_up."""
    p = Autoscaler(params(hi=64))
    d = feed(p, 0, 4, workers=2, ready=2, completed=20.0, busy=2.0, running=2)
    assert (d.kind, d.target) == ("up", 3)
    # 3 paid in full: growth 2. 150 waiting, not draining, 10 jobs/s per worker: keeping up
    # with ~30/s and draining 150 in 12 s takes ceil((30 + 12.5) / 10) = 5 workers: +2.
    d = feed(p, 4, 4, workers=3, ready=3, completed=30.0, busy=3.0, running=3, pending=150)
    assert (d.kind, d.target) == ("up", 5), d
    # 5 paid in full: growth 4, but 150 waiting and 50 jobs/s need ceil((50 + 12.7) / 10) = 7: +2.
    d = feed(p, 8, 4, workers=5, ready=5, completed=50.0, busy=5.0, running=5, pending=150)
    assert (d.kind, d.target) == ("up", 7), d


def test_a_hold_between_steps_up_starts_the_growth_over():
    p = Autoscaler(params(hi=64))
    feed(p, 0, 4)                                                       # 2 -> 3
    feed(p, 4, 4, workers=3, ready=3, completed=30.0, busy=3.0, running=3, pending=0)   # judged? no: drained
    assert p.growth == 1


def test_a_limit_binds_only_when_the_fleet_has_used_it_up_and_jobs_here_need_it():
    full = "limit db is full (3/3 in use, 2 job(s) here waiting for it)"
    assert limit_binds([("db", 3, 3, 0, None, 2, 1)], running=1) == full
    assert limit_binds([("db", 3, 3, 0, None, 0, 2)], running=2) == \
        "limit db is full (3/3 in use, every job running here holds it)"    # a new worker's job would wait
    assert limit_binds([("db", 3, 3, 0, None, 0, 1)], running=2) == ""     # a job here needs none: more may help
    assert limit_binds([("db", 3, 3, 0, None, 0, 0)], running=0) == ""     # full, nothing of ours needs it
    assert limit_binds([("db", 3, 2, 0, None, 2, 2)], running=2) == ""     # a slot is free: waiting is brief
    assert limit_binds([("db", 3, None, 0, None, 2, 2)], running=2) == ""  # not read yet: no claim either way
    assert "rate is used up" in limit_binds([("db", 3, 1, 0, None, 0, 1), ("api", 0, None, 10, 10, 5, 0)], running=1)


def test_a_limit_that_bound_in_any_sample_of_the_measurement_holds_the_count():
    """Between two jobs a slot may read free for an instant: a limit seen binding in any sample of
    the measurement holds, as one seen now does."""
    p = Autoscaler(params(hi=64))
    bound = "limit db is full (2/2 in use, every job running here holds it)"
    feed(p, 0, 2, workers=2, ready=2, completed=20.0, busy=2.0, running=2, pending=150, limited=bound)
    d = feed(p, 2, 2, workers=2, ready=2, completed=20.0, busy=2.0, running=2, pending=150)
    assert (d.kind, d.target) == ("limit", 2) and bound in d.reason, d
