"""Randomized runs: a configuration and a fault schedule drawn from one seed.

    python -m chaos --random --seed N [--minutes M]        one run; replays exactly that draw
    python -m chaos --random --seeds A-B [--minutes M]     runs A, A+1, ... B one after the other

The fixed scenarios (chaos/scenarios.py) test one feature at a time; this mode tests the
combinations (the `max_jobs` + idempotency wedge needed two). `draw(seed, minutes)` is a pure
function of its arguments: it returns the supervisor configuration, the job mix and rate, and
a schedule of faults with every parameter already decided (which worker a fault hits is a
drawn fraction into the list of candidates at that moment: the draw is the same on every
replay, the pid it lands on is not). Only timing varies between replays.

The space is two tables, so a new feature adds a row, not a code path:

- SETTINGS: one row per config key (or runner knob, `chaos.*`), drawn in table order; each
  says what it needs from the rows before it (`needs`), how it is drawn, and whether a SIGHUP
  may change it later (`hup`).
- FAULTS: one row per fault; each says what configuration it needs, its weight, how its
  parameters are drawn, and how it acts. A fault records what it touched (chaos/facts.py
  Fault: the worker pids, the proxy's connections, the supervisor) and whether a wait it
  causes is the supervisor's to prevent, which is what the one checker (chaos/checker.py)
  judges the run by.

Every connection goes through chaos/proxy.py, link faults or not: it names who was handed each
delivery (the process and the connection), which is how the checker judges a delivery that
never started.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil
import tomli_w
from harness import SupervisorProc, run_cli, wait_until
from natsauth import free_port
from otlp import Receiver

from workers.protocol.limitkeys import LEASE_TTL, RENEW_EVERY, rate_window

from .checker import VERDICTS, runs_by_seq
from .core import Result, run_with
from .facts import Fault
from .rig import SIDE, SIDE_SUBJECT, SUBJECT, ChaosNats, Run, named_before_kill

Cfg = dict[str, Any]             # "section.key" (a supervisor key) or "chaos.knob" -> value


def always(_: Cfg) -> bool:
    return True


def weighted(rng: random.Random, choices: list[tuple[Any, float]]) -> Any:
    return rng.choices([c for c, _ in choices], [w for _, w in choices])[0]


# ================================================================ the settings

@dataclass(frozen=True)
class Setting:
    key: str
    draw: Callable[[random.Random, Cfg], Any]
    needs: Callable[[Cfg], bool] = always
    hup: bool = False            # a SIGHUP fault may redraw it (a LIVE or REPLACE key)
    # Drawn from a generator of its own (seeded by the seed's and its key): a row added later
    # leaves every other row's draw, the jobs and the schedule of older seeds as they were
    # while it draws its "off" value.
    own: bool = False
    # A row added after seeds were recorded: drawn from the seed's second generator, so every row
    # before it draws as it did and a recorded seed keeps its configuration and its faults.
    later: bool = False


def fleet(c: Cfg) -> bool:
    return c["chaos.supervisors"] > 1


SETTINGS: list[Setting] = [
    Setting("chaos.supervisors", lambda r, c: weighted(r, [(1, 3), (2, 1)])),    # 2: a fleet on one consumer
    Setting("chaos.handler", lambda r, c: r.choice(["sync", "async"])),
    Setting("consumer.ack_wait", lambda r, c: weighted(r, [(30.0, 3), (15.0, 1)])),
    Setting("workers.count", lambda r, c: r.randint(1, 4)),
    Setting("workers.concurrency", lambda r, c: weighted(r, [(1, 3), (2, 1), (3, 1), (4, 1)]), hup=True),
    Setting("workers.batch", lambda r, c: r.choice([4, 16, 64, 256]), hup=True),
    Setting("workers.max_jobs", lambda r, c: weighted(r, [(0, 1), (r.randint(3, 40), 1)]), hup=True),
    Setting("workers.max_jobs_jitter", lambda r, c: r.randint(0, 5), needs=lambda c: c["workers.max_jobs"] > 0,
            hup=True),
    Setting("workers.max_rss_mb", lambda r, c: weighted(r, [(0, 3), (r.randint(90, 160), 1)]), hup=True),
    Setting("workers.graceful_timeout", lambda r, c: r.choice([1.0, 5.0, 10.0]), hup=True),
    Setting("workers.heartbeat_timeout", lambda r, c: round(r.uniform(2.0, 5.0), 1), hup=True),
    Setting("workers.double_ack", lambda r, c: r.random() < 0.3, hup=True),
    Setting("workers.retry_backoff", lambda r, c: sorted(round(r.uniform(0.05, 1.0), 2) for _ in range(3)), hup=True),
    Setting("idempotency.enabled", lambda r, c: r.random() < 0.3),
    # A publisher retrying after the stream's duplicate window: the same key stored again.
    Setting("chaos.republish", lambda r, c: weighted(r, [(0.0, 1), (round(r.uniform(0.01, 0.05), 3), 1)]),
            needs=lambda c: c["idempotency.enabled"]),
    Setting("stream.duplicate_window", lambda r, c: 1.0, needs=lambda c: c["chaos.republish"] > 0),
    Setting("autoscale.enabled", lambda r, c: r.random() < 0.25),
    Setting("autoscale.min", lambda r, c: max(1, c["workers.count"] - 1), needs=lambda c: c["autoscale.enabled"]),
    Setting("autoscale.max", lambda r, c: c["workers.count"] + r.randint(1, 2), needs=lambda c: c["autoscale.enabled"]),
    Setting("autoscale.interval", lambda r, c: 1.0, needs=lambda c: c["autoscale.enabled"]),
    Setting("fleet.heartbeat", lambda r, c: r.choice([0.5, 1.0, 2.0]), needs=fleet),
    Setting("fleet.release_lost", lambda r, c: r.random() < 0.7, needs=fleet),
    # The job mix: shares of each kind of job (the rest are short sleeps).
    Setting("chaos.long", lambda r, c: weighted(r, [(0.0, 1), (round(r.uniform(0.01, 0.08), 3), 2)])),
    Setting("chaos.beyond_ackwait", lambda r, c: r.random() < 0.3,          # a few jobs outlive AckWait (+WPI)
            needs=lambda c: c["chaos.long"] > 0 and c["consumer.ack_wait"] <= 15),
    Setting("chaos.fail", lambda r, c: weighted(r, [(0.0, 1), (round(r.uniform(0.01, 0.1), 3), 1)])),
    Setting("chaos.retry", lambda r, c: weighted(r, [(0.0, 1), (round(r.uniform(0.01, 0.1), 3), 1)])),
    Setting("chaos.cpu", lambda r, c: weighted(r, [(0.0, 1), (round(r.uniform(0.05, 0.3), 3), 1)])),
    Setting("chaos.grow", lambda r, c: round(r.uniform(0.02, 0.1), 3), needs=lambda c: c["workers.max_rss_mb"] > 0),
    # Delayed and recurring jobs (NATS message schedules): a share of the jobs published with a
    # delay (`publish --delay`), and a [schedules.tick] firing every N seconds.
    Setting("chaos.delayed", lambda r, c: weighted(r, [(0.0, 1), (round(r.uniform(0.05, 0.2), 3), 1)]), later=True),
    Setting("chaos.delay", lambda r, c: round(r.uniform(0.5, 4.0), 2), needs=lambda c: c["chaos.delayed"] > 0,
            later=True),
    Setting("chaos.tick", lambda r, c: weighted(r, [(0, 1), (r.choice([1, 2, 3]), 1)]), later=True),
    # A span per delivery (issue 29), to a collector that is up (an OTLP receiver of the run's) or down.
    Setting("tracing.enabled", lambda r, c: r.random() < 0.3, later=True),
    Setting("chaos.collector", lambda r, c: weighted(r, [("up", 3), ("down", 1)]), needs=lambda c: c["tracing.enabled"],
            later=True),
    Setting("chaos.utilization", lambda r, c: round(r.uniform(0.15, 0.4), 2)),
    Setting("chaos.fault_every", lambda r, c: round(r.uniform(3.0, 9.0), 1)),     # mean seconds between faults
    # Issue 24's job policies. A rule for the jobs that fail on purpose, with a jittered backoff
    # of its own (its attempts stay consumer.max_deliver's: a faulted job may spend many);
    # a soft limit, async handlers only (a sync job sleeps in C, out of its reach), that
    # interrupts the first run of some long jobs; a middleware whose hooks hop between the
    # handler's thread and the loop. None of them may cost a job or explain a redelivery wrongly.
    Setting("retry.rules", lambda r, c: weighted(r, [([], 1), (retry_rules(r), 1)]), hup=True, later=True),
    Setting("workers.soft_timeout", lambda r, c: weighted(r, [(0.0, 1), (round(r.uniform(1.0, 3.0), 1), 1)]),
            needs=lambda c: c["chaos.handler"] == "async", hup=True, later=True),
    Setting("workers.middleware", lambda r, c: weighted(r, [([], 2), (["chaos.handlers:Hops"], 1)]), hup=True,
            later=True),
    # [limits.chaos] over every job (issue 26): a fleet-wide cap, a rate, or both; pauses.
    Setting("chaos.limit", lambda r, c: weighted(r, [(0, 3), (r.randint(1, max(1, slots_of(c) // 2)), 1)]),
            own=True),
    Setting("chaos.limit_rate", lambda r, c: weighted(r, [(0.0, 4), (float(r.choice([5, 10, 20])), 1)]), own=True),
    Setting("chaos.pause", lambda r, c: r.random() < 0.3, own=True),
    # [ordering] (issue 27): jobs on `jobs.chaos.<key>` over this many keys, ordered per key
    # (key = "subject:3"); the checker's `reorder_unexplained` must stay 0.
    Setting("chaos.keys", lambda r, c: weighted(r, [(0, 2), (r.choice([3, 8, 20, 50]), 1)]), own=True),
    # Pools (issue 28): the drawn configuration is pool `a` (its jobs, every fault), and pool `b`
    # beside it on a subject of its own, with short jobs of its own and no fault aimed at it.
    Setting("chaos.pools", lambda r, c: r.random() < 0.2, own=True),
    Setting("chaos.pool_b", lambda r, c: r.randint(1, 2), needs=lambda c: c["chaos.pools"], own=True),
    # [retry]'s copies for later (issue 24; with pools, each pool's own: issue 28): a delay past
    # republish_after re-publishes the job (a new sequence, its key kept) and acks it. 60 s (the
    # default) leaves every delay a NAK; 0.5 makes copies of `retry1` jobs and of failures whose
    # drawn backoff is longer. Drawn beside idempotency (the guard folds a copy by its key) and
    # pools as they fall.
    Setting("retry.republish_after", lambda r, c: weighted(r, [(60.0, 2), (0.5, 1)]), own=True,
            needs=lambda c: c["chaos.retry"] > 0 or c["chaos.fail"] > 0),
]

SIDE_SHARE = 0.25           # with pools: a job for pool b (`b|SECONDS`, rig.py SIDE) a quarter of the time
POOL_CONSUMERS = {"main": "workers-a", "side": "workers-b"}


def retry_rules(r: random.Random) -> list[dict[str, Any]]:
    return [{"on": ["chaos.handlers:Failed"], "base": round(r.uniform(0.05, 0.3), 2), "max": 1.0,
             "jitter": round(r.uniform(0.0, 0.5), 2)}]


# Runner knobs that are not drawn, and what a key not drawn falls back to.
DEFAULTS: Cfg = {"chaos.limit": 0, "chaos.limit_rate": 0.0, "chaos.pause": False, "chaos.keys": 0,
                 "chaos.pools": False, "chaos.pool_b": 0,
                 "chaos.delayed": 0.0, "chaos.delay": 0.0, "chaos.tick": 0, "workers.soft_timeout": 0.0,
                 "workers.max_jobs_jitter": 0, "autoscale.enabled": False, "chaos.beyond_ackwait": False,
                 "tracing.enabled": False, "chaos.collector": "up",
                 "chaos.grow": 0.0, "chaos.republish": 0.0, "fleet.heartbeat": 2.0, "fleet.release_lost": True}


def draw_config(rng: random.Random, later: random.Random | None = None) -> Cfg:
    c: Cfg = dict(DEFAULTS)
    base = "-".join(map(str, rng.getstate()[1][:4]))        # the seed's, without drawing from it
    for s in SETTINGS:
        if s.needs(c):
            c[s.key] = s.draw(random.Random(f"{base}:{s.key}") if s.own else (later or rng) if s.later else rng, c)
    return c


def sections(c: Cfg) -> dict[str, dict[str, Any]]:
    """The supervisor's config sections from the drawn keys (chaos.* knobs left out)."""
    out: dict[str, dict[str, Any]] = {}
    for dotted, value in c.items():
        section, name = dotted.split(".")
        if section != "chaos":
            out.setdefault(section, {})[name] = value
    out["workers"]["handler"] = "chaos.handlers:journal_async" if c["chaos.handler"] == "async" else \
        "chaos.handlers:journal"
    if c["chaos.limit"] or c["chaos.limit_rate"]:
        out["limits"] = {"chaos": {"concurrency": c["chaos.limit"], "rate": c["chaos.limit_rate"],
                                   "subjects": ["jobs.>"]}}
    keyed = bool(c["chaos.keys"])
    if c["chaos.tick"]:                  # with pools and keys pool a takes `jobs.chaos.>`: the tick is a key there
        tick = f"{SUBJECT}.tick" if keyed and c["chaos.pools"] else SUBJECT
        out["schedules"] = {"tick": {"every": float(c["chaos.tick"]), "subject": tick, "data": "tick:0.01"}}
    if c["chaos.pools"]:                 # [ordering] drawn: pool a's own (b's `jobs.b` has no third token)
        a = {"filter_subject": f"{SUBJECT}.>", "ordering_key": "subject:3"} if keyed else {"filter_subject": SUBJECT}
        out["pools"] = {"a": a, "b": {"filter_subject": SIDE_SUBJECT, "count": c["chaos.pool_b"]}}
    elif keyed:                          # the ticks' `jobs.chaos` has no third token: they run unordered
        out["ordering"] = {"key": "subject:3"}
    return out


def side_jobs(jobs: list[str], c: Cfg, rng: random.Random) -> list[str]:
    """With pools: a share of the plain jobs go to pool b instead, as short sleeps (`b|SECONDS`)."""
    if not c["chaos.pools"]:
        return jobs
    return [f"{SIDE}{rng.uniform(0.005, 0.05):.3f}" if "=" not in j and not j.startswith("~")
            and rng.random() < SIDE_SHARE else j for j in jobs]


# ================================================================ the jobs

def job_action(rng: random.Random, c: Cfg) -> tuple[str, float]:
    """(payload actions, seconds of work) of one job; later deliveries run short."""
    x = rng.random()
    for share, make in [
        ("chaos.fail", lambda: (f"fail:{'fail:' if rng.random() < 0.3 else ''}0.02", 0.02)),
        ("chaos.retry", lambda: (f"retry{rng.choice([0.0, 0.2, 1.0]):g}:0.02", 0.02)),
        ("chaos.long", lambda: long_job(rng, c)),
        ("chaos.grow", lambda: (f"grow{rng.choice([4, 8, 16])}", 0.01)),
        ("chaos.cpu", lambda: (f"{rng.uniform(0.002, 0.02):.3f}cpu", 0.01)),
    ]:
        if x < c[share]:
            return make()
        x -= c[share]
    s = rng.uniform(0.005, 0.15)
    return f"{s:.3f}", s


def long_job(rng: random.Random, c: Cfg) -> tuple[str, float]:
    if c["chaos.beyond_ackwait"] and rng.random() < 0.2:
        s = c["consumer.ack_wait"] * 1.2
    else:
        s = rng.uniform(1.0, 6.0)
    return f"{s:.2f}:0.5", s


def republished(jobs: list[str], rate: float, c: Cfg, rng: random.Random) -> list[str]:
    """Some jobs replaced by an earlier job's key published again (`jN=0.01`), twice the
    duplicate window later, so the stream stores it a second time."""
    if not c["chaos.republish"]:
        return jobs
    gap = int(2 * c["stream.duplicate_window"] * rate) + 1
    out: list[str] = []
    for i, j in enumerate(jobs):
        again = i >= gap and "=" not in out[i - gap] and rng.random() < c["chaos.republish"]
        out.append(f"j{i - gap}=0.01" if again else j)
    return out


def delayed(jobs: list[str], c: Cfg, rng: random.Random) -> list[str]:
    """A share of the jobs published as delayed jobs (`~SECONDS~ACTIONS`: a message schedule each,
    due SECONDS after it is stored); never a `jN=` (its first copy may be late). A delayed job's
    own key may be published again, on its own subject, before it fires (seed 940)."""
    if not c["chaos.delayed"]:
        return jobs
    return [f"~{c['chaos.delay']}~{j}" if "=" not in j and rng.random() < c["chaos.delayed"] else j for j in jobs]


def kind_of(actions: str) -> str:
    """fail, retry, grow, cpu, long (1 s or more), short, again (a key published again), or delayed."""
    if "=" in actions:
        return "again"
    if actions.startswith("~"):
        return "delayed"
    if actions.startswith(SIDE):
        return "pool b"
    first = actions.split(":")[0]
    word = first.strip("0123456789.")
    return word or ("long" if float(first) >= 1.0 else "short")


def slots_of(c: Cfg) -> int:
    """Jobs the smallest pool the schedule can leave runs at once (within the drawn limit, and
    [ordering]'s keys: one job of a key at a time)."""
    pool = max(1, c["workers.count"] - 1) * c["workers.concurrency"] * c["chaos.supervisors"]
    pool = min(pool, c["chaos.limit"]) if c.get("chaos.limit") else pool
    return min(pool, c["chaos.keys"]) if c.get("chaos.keys") else pool


def rate_for(c: Cfg, mean_s: float) -> float:
    """Jobs/s: the drawn share of what the smallest pool the schedule can leave would drain (and
    of the drawn limit's rate)."""
    rate = c["chaos.utilization"] * slots_of(c) / max(mean_s, 0.005)
    if c.get("chaos.limit_rate"):
        rate = min(rate, 1.5 * c["chaos.utilization"] * c["chaos.limit_rate"])
    return round(min(40.0, max(2.0, rate)), 1)


def spaced(jobs: list[tuple[str, float]], rate: float, slots: int) -> list[str]:
    """Long jobs (1 s or more) made short where they would fill more than half the slots at
    once: queueing must stay far below AckWait, or a late first run looks like an expiry."""
    out, running = [], []                  # end times (in publish seconds) of the long jobs kept
    for i, (actions, seconds) in enumerate(jobs):
        now = i / rate
        running = [end for end in running if end > now]
        if seconds >= 1.0 and len(running) >= max(1, slots // 2):
            actions = "0.05"
        elif seconds >= 1.0:
            running.append(now + seconds)
        out.append(actions)
    return out


# ================================================================ the faults

@dataclass(frozen=True)
class FaultKind:
    name: str
    weight: float
    act: Callable[[Act, dict], None]
    params: Callable[[random.Random, Cfg], dict] = lambda r, c: {}
    needs: Callable[[Cfg], bool] = always
    # Outside the supervisor's control with these parameters: its ledger cannot explain every
    # redelivery it causes (a dead link's lost ack looks like AckWait too short).
    outside: Callable[[Cfg, dict], bool] = lambda c, p: False
    # What it acts on: steps on the same thing take turns, others overlap ("": nothing shared).
    holds: Callable[[dict], str] = lambda p: ""


@dataclass
class Step:
    at: float                     # seconds after the load began
    fault: str
    params: dict


@dataclass
class Plan:
    seed: int
    minutes: float
    config: Cfg
    jobs: list[str]
    rate: float
    load_s: float
    schedule: list[Step] = field(default_factory=list)
    subjects: list[str] = field(default_factory=list)     # [ordering]: job i's subject (its key's)

    def describe(self) -> str:
        """The draw, for a failure's report (and to read what a seed means)."""
        drawn = {s.key for s in SETTINGS if s.needs(self.config)}
        keys = " ".join(f"{k}={v}" for k, v in sorted(self.config.items()) if k in drawn)
        mix: dict[str, int] = {}
        for j in self.jobs:
            mix[kind_of(j)] = mix.get(kind_of(j), 0) + 1
        steps = "; ".join(f"+{s.at:.1f}s {s.fault} {json.dumps(s.params, sort_keys=True)}" for s in self.schedule)
        return (f"seed {self.seed} ({self.minutes:g} min): {keys}\n  load: {len(self.jobs)} jobs at {self.rate:g}/s "
                f"over {self.load_s:.0f}s, mix {json.dumps(mix, sort_keys=True)}\n  schedule: {steps or '(none)'}")


def draw(seed: int, minutes: float) -> Plan:
    """The whole run from the seed: a pure function (no clock, no environment)."""
    rng = random.Random(seed)
    c = draw_config(rng, random.Random(f"later:{seed}"))
    load_s = max(10.0, minutes * 60 * 0.75)
    jobs_rng = random.Random(rng.random())
    sample = [job_action(random.Random(jobs_rng.random()), c) for _ in range(200)]
    rate = rate_for(c, sum(s for _, s in sample) / len(sample))
    n = int(rate * load_s)
    jobs = republished(spaced([job_action(jobs_rng, c) for _ in range(n)], rate, slots_of(c)), rate, c, jobs_rng)
    jobs = delayed(jobs, c, random.Random(f"delayed:{seed}"))
    jobs = side_jobs(jobs, c, random.Random(f"pools:{seed}"))
    plan = Plan(seed, minutes, c, jobs, rate, load_s)
    if c["chaos.keys"]:
        keys = random.Random(f"keys:{seed}")
        plan.subjects = [f"{SUBJECT}.k{keys.randrange(c['chaos.keys'])}" for _ in jobs]
    kinds = [k for k in FAULTS if k.needs(c)]
    t = 0.1 * load_s
    while True:
        t += rng.expovariate(1 / c["chaos.fault_every"])
        if t > 0.9 * load_s:
            break
        kind = rng.choices(kinds, [k.weight for k in kinds])[0]
        params = {"sup": rng.randrange(c["chaos.supervisors"]), **kind.params(rng, c)}
        plan.schedule.append(Step(round(t, 2), kind.name, params))
    return plan


class Act:
    """What a fault's action works with: the run, the plan, the server, the supervisors."""

    def __init__(self, run: Run, plan: Plan, server: ChaosNats, urls: list[str]):
        self.run, self.plan, self.server, self.urls = run, plan, server, urls
        self.orphans: set[int] = set()                  # workers of a SIGKILLed parent
        self.graceful_min = plan.config["workers.graceful_timeout"]

    def sup(self, params: dict) -> SupervisorProc:
        return self.run.sups[params["sup"] % len(self.run.sups)]

    @property
    def pools(self) -> bool:
        return bool(self.plan.config["chaos.pools"])

    def workers_of(self, status: dict | None) -> list[dict]:
        """The workers a fault may act on: every one, or with pools pool a's (faults in one pool)."""
        s = status or {"workers": {"list": []}}
        return (s.get("pools", {}).get("a", {}).get("workers", {}) if self.pools else s["workers"]).get("list", [])

    def live(self, sup: SupervisorProc) -> bool:
        return sup.proc is not None and sup.proc.poll() is None

    def name(self, sup: SupervisorProc) -> str:
        return str(sup.config["nats"]["name"])

    def slots(self, sup: SupervisorProc) -> dict[int, int]:
        return {w["slot"]: w["pid"] for w in self.workers_of(sup.try_status())}

    def victim(self, sup: SupervisorProc, pick: float, running: bool = True) -> int | None:
        """A worker of `sup` (with pools, of pool a): the drawn fraction into those running a job
        (or into all of them)."""
        pids: list[int] = []
        deadline = time.monotonic() + 5.0
        while running and not pids and time.monotonic() < deadline and self.live(sup):
            pids = sorted({r.pid for r in self.run.running(sup)} & self.targets(sup))
            time.sleep(0.005)
        pids = pids or sorted(self.targets(sup))
        return pids[int(pick * len(pids))] if pids else None

    def targets(self, sup: SupervisorProc) -> set[int]:
        return {w["pid"] for w in self.workers_of(sup.try_status())} if self.pools else sup.worker_pids()

    def in_fleet(self) -> bool:
        return len(self.run.sups) > 1

    def link(self, mode: str, pattern: str) -> None:
        """cut, stall or heal the connections named by `pattern`; a heal waits until the
        connections the fault left for dead are closed (until then the server may still hand
        them jobs: what they carried reaches it at the heal)."""
        proxy = self.run.proxy
        assert proxy is not None, "a link fault without the proxy"
        self.run.bg.call(getattr(proxy, mode)(pattern))
        if mode == "heal":
            with contextlib.suppress(AssertionError):
                wait_until(lambda: self.run.bg.call(proxy.count(pattern)) <= 1, 5, "stale connections closed")

    def struck(self, f: Fault, pattern: str) -> None:
        """Note in the fault the connections its pattern hit (the proxy's numbers) and the pids
        holding them: every process on a connection of that name, an orphan of the slot too."""
        assert self.run.proxy is not None
        hit = self.run.bg.call(self.run.proxy.struck(pattern, f.t0 - 0.001))
        f.conns = frozenset(c.conn for c in hit)
        if f.pids is not None:
            f.pids = f.pids | {c.pid for c in hit if c.pid}


def op(act: Act, kind: str, sup: SupervisorProc) -> None:
    """A routine operation on a supervisor: logged for context, touches no worker (it must explain
    no run), but it acted on that supervisor (what its workers held unstarted may be its doing)."""
    act.run.fault(f"op: {kind}", time.monotonic(), pids=set(), parent=sup.proc.pid)


def worker_kill(act: Act, p: dict) -> None:
    sup = act.sup(p)
    pid = act.victim(sup, p["pick"])
    if pid is None:
        return
    parent = sup.proc.pid
    orphan = parent_of(pid, parent) != parent             # already re-parented: its supervisor is gone
    time.sleep(p["delay"])                                # a random moment of the job
    f = act.run.fault("worker SIGKILL", time.monotonic(), pids={pid}, **peer_rule(act))
    signal_and_reap(act, pid, signal.SIGKILL)
    f.t1 = died(act, pid)
    if orphan or not alive(parent):
        # Its supervisor was SIGKILLed too (a parent-kill drawn beside it: seed 817): the NAK at a
        # death is the parent's, and no parent was left to send it (nor, for the successor, to name
        # what it held after its last heartbeat). What it ran is lost to AckWait whenever the parent
        # went; what it had not started an orphan NAKs at once, so that is excused only when the
        # parent died while this kill was under way (not already an orphan at the pick).
        f.in_control, f.note = False, "its supervisor was SIGKILLed around it: nothing left to NAK what it held"
        if orphan and f.unstarted_in_control is None:
            f.unstarted_in_control = True


def peer_rule(act: Act) -> dict[str, Any]:
    """With a peer on the consumer the in-transit check stands down (README): what was on the
    wire to a dead worker comes back after AckWait, as documented."""
    if not act.in_fleet():
        return {}
    return {"unstarted_in_control": False, "note": "a peer shares the consumer: in-transit jobs wait for AckWait"}


def worker_stop(act: Act, p: dict) -> None:
    """SIGSTOP, then SIGCONT after the drawn time; longer than heartbeat_timeout, the parent kills it
    (with a peer on the consumer what was on the wire to it then waits for AckWait, as at any
    death: peer_rule; a shorter stop reads it when it goes on)."""
    sup = act.sup(p)
    pid = act.victim(sup, p["pick"])
    if pid is None:
        return
    f = act.run.fault(f"worker SIGSTOP {p['seconds']:g}s", time.monotonic(), pids={pid}, **peer_rule(act))
    with_pid(pid, signal.SIGSTOP)
    time.sleep(p["seconds"])
    with_pid(pid, signal.SIGCONT)
    f.t1 = time.monotonic() if act.run.watcher.alive(pid) else died(act, pid)


def server_outage(kind: str, take: str, restore: str) -> Callable[[Act, dict], None]:
    """The server taken away for the drawn seconds (SIGKILL then a restart on its store, or
    SIGSTOP then SIGCONT): outside the supervisor's control."""
    def fault(act: Act, p: dict) -> None:
        t0 = time.monotonic()
        getattr(act.server, take)()
        time.sleep(p["seconds"])
        getattr(act.server, restore)()
        act.run.fault(kind.format(**p), t0, time.monotonic(), in_control=False)
    return fault


def parent_link(mode: str) -> Callable[[Act, dict], None]:
    """The parent's connection cut or stalled through the proxy (workers keep theirs)."""
    def fault(act: Act, p: dict) -> None:
        sup = act.sup(p)
        pattern = f"^{act.name(sup)}$"
        t0, workers = time.monotonic(), sup.worker_pids()
        act.link(mode, pattern)
        time.sleep(p["seconds"])
        act.link("heal", pattern)
        released = releases(act.plan.config, p)
        f = act.run.fault(f"network: the parent's connection {mode} {p['seconds']:g}s", t0, time.monotonic(),
                          pids=workers | sup.worker_pids() if released else set(), in_control=not released,
                          note="a peer may declare it lost and release its jobs" if released else "",
                          parent=sup.proc.pid)
        act.struck(f, pattern)
    return fault


def releases(c: Cfg, p: dict) -> bool:
    """A fleet peer takes a parent silent for 3 heartbeats for a lost host and releases its jobs
    while its workers still run them (README: "A partitioned host is not a dead one")."""
    return fleet(c) and c["fleet.release_lost"] and p["seconds"] > 2 * c["fleet.heartbeat"]


def worker_link(mode: str) -> Callable[[Act, dict], None]:
    """A worker's connection cut or stalled: what was on the wire to it, or its acks, may be lost."""
    def fault(act: Act, p: dict) -> None:
        sup = act.sup(p)
        slots = act.slots(sup)
        if not slots:
            return
        slot = sorted(slots)[int(p["pick"] * len(slots))]
        pattern = f"^{act.name(sup)} worker {'a/' if act.pools else ''}{slot}$"
        touched = {slots[slot]}
        f = act.run.fault(f"network: worker {slot}'s connection {mode} {p['seconds']:g}s", time.monotonic(),
                          pids=touched, in_control=False)
        act.link(mode, pattern)
        end = time.monotonic() + p["seconds"]
        while time.monotonic() < end:                     # whoever runs on that slot meanwhile is touched too
            touched |= {pid for s, pid in act.slots(sup).items() if s == slot}
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
        act.link("heal", pattern)
        touched |= {pid for s, pid in act.slots(sup).items() if s == slot}
        f.pids = frozenset(touched)
        f.t1 = time.monotonic()
        act.struck(f, pattern)
    return fault


def parent_kill(act: Act, p: dict) -> None:
    """The parent SIGKILLed and a new one started at once on the same config (what systemd's
    Restart= does), while the old one's workers are left to themselves. Those are touched
    until the last of them is gone."""
    sup = act.sup(p)
    if not act.live(sup):
        return
    pids = sup.worker_pids()
    named_before_kill(act.run, sup)     # what the kill leaves to AckWait, as its /status names it (checker.py)
    f = act.run.fault("parent SIGKILL, then a new supervisor", time.monotonic(), pids=pids, parent=sup.proc.pid,
                      **peer_rule(act))
    sup.proc.kill()
    sup.proc.wait()
    act.orphans |= pids
    sup.start()
    gone = lambda: not [q for q in pids if alive(q)]     # noqa: E731
    try:
        wait_until(gone, act.graceful_min + 10, "the orphaned workers to exit")
    except AssertionError:
        left = sorted(q for q in pids if alive(q))
        act.run.notes.append(f"{act.run.at()}: workers {left} still alive {act.graceful_min + 10:g}s after their "
                             "parent was SIGKILLed")
    f.t1 = time.monotonic()
    wait_serving(act, sup)


def hup(act: Act, p: dict) -> None:
    """SIGHUP after the drawn change to one `hup` setting."""
    sup = act.sup(p)
    if not act.live(sup):
        return
    section, name = p["key"].split(".")
    sup.config[section][name] = p["value"]
    sup.config_path.write_text(tomli_w.dumps(sup.config))
    if p["key"] == "workers.graceful_timeout":
        act.graceful_min = min(act.graceful_min, p["value"])
    op(act, f"SIGHUP ({p['key']}={p['value']})", sup)
    sup.signal(signal.SIGHUP)


def scale(act: Act, p: dict) -> None:
    sup = act.sup(p)
    if not act.live(sup):
        return
    how = p["how"]
    # Never below the pool the load is sized for (rate_for). The parent's target, not its
    # processes: during a recycle the old worker and its replacement are both alive, and
    # counting them let a SIGTTOU take a one-worker pool to none (seed 5, tracing's runs).
    status = sup.try_status()
    if how == "ttou" and (status is None or low(act, status)):
        how = "ttin"
    op(act, {"ttin": "SIGTTIN", "ttou": "SIGTTOU"}.get(how, f"POST /scale?workers={p['n']}"), sup)
    if how == "post":
        pool = "&pool=a" if act.pools else ""
        req = urllib.request.Request(f"http://{sup.http}/scale?workers={p['n']}{pool}", method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 202, r.status
    else:
        sup.signal(signal.SIGTTIN if how == "ttin" else signal.SIGTTOU)


def low(act: Act, status: dict) -> bool:
    """A SIGTTOU would take a pool below what its load is sized for (SIGTTOU acts on every pool)."""
    floor = max(1, act.plan.config["workers.count"] - 1)
    if not act.pools:
        return bool(status["workers"]["target"] <= floor)
    targets = {name: p["workers"]["target"] for name, p in status["pools"].items()}
    return bool(targets.get("a", 0) <= floor or targets.get("b", 0) <= 1)


def pause(act: Act, p: dict) -> None:
    """`supervisor pause --for S` (the server's consumer pause, fleet-wide): nothing is delivered
    meanwhile; it resumes by itself. Touches no worker: it must explain nothing."""
    sup = act.sup(p)
    op(act, f"supervisor pause --for {p['seconds']:g}", sup)
    r = run_cli("pause", "--config", str(sup.config_path), "--for", str(p["seconds"]), "--reason", "chaos",
                *(("--pool", "a") if act.pools else ()))
    if r.returncode != 0:
        act.run.notes.append(f"{act.run.at()}: supervisor pause failed ({r.returncode}): {r.stderr.strip()[:200]}")


def over_limit(run: Run, limit: int) -> list[str]:
    """Moments more than `limit` jobs ran at once by the journal (a run ends at its D or R line,
    or when its worker died), outside the faults that cut a worker off from NATS longer than a
    slot's lease (LEASE_TTL - RENEW_EVERY): its slot then expires while its job runs on
    (README: Protecting what is behind the workers)."""
    lives = run.watcher.lives
    edges: list[tuple[float, int]] = []
    for runs in runs_by_seq(run.tail.poll()).values():
        for r in runs:
            life = lives.get(r.pid)
            end = r.ended if r.ended is not None else life.died if life and life.died else math.inf
            edges += [(r.start, 1), (end, -1)]
    excused = [(f.t0, f.t1) for f in run.faults if "connection" in f.kind and "worker" in f.kind
               and f.t1 - f.t0 > LEASE_TTL - RENEW_EVERY]
    out, now = [], 0
    for t, step in sorted(edges, key=lambda e: (e[0], e[1])):
        now += step
        if now > limit and not any(t0 <= t <= t1 + LEASE_TTL for t0, t1 in excused):
            out.append(f"{run.at(t)}: {now} jobs ran at once (limit {limit})")
    return out


RATE_SLACK = 0.25           # a start's S line comes after its take (the worker's loop, queue, a thread, the GIL)
DELAYING = ("SIGSTOP", "stall", "cut")   # faults after which a start taken before is stamped late


def over_rate(run: Run, rate: float) -> list[str]:
    """Moments the journal's starts (S lines, one per delivery that ran) outran `rate`: more than
    its window's keys (limitkeys.rate_window) within the window less RATE_SLACK. The bound is
    the server's (a start key's TTL); a handler stamps a start after its take, so a stopped
    worker or server, or a stalled or cut link, can bunch stamps of starts taken apart: those
    windows, to one window after the fault, are excused."""
    keys, seconds = rate_window(rate)
    starts = sorted(r.t for r in run.tail.poll() if r.event == "S")
    excused = [(f.t0, f.t1 + seconds) for f in run.faults if any(word in f.kind for word in DELAYING)]
    out, lo = [], 0
    for hi, t in enumerate(starts):
        while t - starts[lo] >= seconds - RATE_SLACK:
            lo += 1
        if hi - lo + 1 > keys and not any(t0 <= t and starts[lo] <= t1 for t0, t1 in excused):
            out.append(f"{run.at(starts[lo])}: {hi - lo + 1} starts within {seconds - RATE_SLACK:g} s "
                       f"(rate {rate:g}: {keys} per {seconds} s)")
    return out


def hup_params(rng: random.Random, c: Cfg) -> dict:
    choices = [s for s in SETTINGS if s.hup and s.needs(c) and not s.key.startswith("chaos.")]
    s = rng.choice(choices)
    for _ in range(10):                                   # a value that differs from the drawn one
        value = s.draw(rng, c)
        if value != c.get(s.key):
            break
    return {"key": s.key, "value": value}


def seconds(lo: float, hi: float) -> Callable[[random.Random, Cfg], dict]:
    return lambda r, c: {"seconds": round(r.uniform(lo, hi), 2)}


def pick_and(extra: Callable[[random.Random, Cfg], dict]) -> Callable[[random.Random, Cfg], dict]:
    return lambda r, c: {"pick": round(r.random(), 4), **extra(r, c)}


def server(p: dict) -> str:
    return "server"


def parent(p: dict) -> str:
    return f"parent {p['sup']}"


def parent_link_of(p: dict) -> str:
    return f"parent link {p['sup']}"


def worker_links_of(p: dict) -> str:
    return f"worker links {p['sup']}"


def others_carry_on(c: Cfg) -> bool:
    """A fault that takes one worker away for long (its link dead for up to 1.3x AckWait) only
    where the others keep the queue short: otherwise every job waits, and a first run later
    than AckWait/2 can no longer be told from an expiry."""
    return c["workers.count"] >= 3 or (c["workers.count"] >= 2 and fleet(c))


def outside(c: Cfg, p: dict) -> bool:
    return True


FAULTS: list[FaultKind] = [
    FaultKind("worker-kill", 4, worker_kill, pick_and(lambda r, c: {"delay": round(r.uniform(0, 0.05), 3)})),
    FaultKind("worker-stop", 2, worker_stop,
              pick_and(lambda r, c: {"seconds": round(r.uniform(0.3, min(1.5 * c["workers.heartbeat_timeout"],
                                                                         0.25 * c["consumer.ack_wait"])), 2)})),
    FaultKind("server-kill", 1, server_outage("nats-server SIGKILL, back {seconds:g}s later", "kill", "start"),
              seconds(0.3, 3.0), outside=outside, holds=server),
    FaultKind("server-stall", 1, server_outage("nats-server SIGSTOP {seconds:g}s", "pause", "resume"),
              seconds(0.5, 5.0), outside=outside, holds=server),
    FaultKind("parent-cut", 1, parent_link("cut"), seconds(1.0, 8.0), outside=releases,
              holds=parent_link_of),
    FaultKind("parent-stall", 1, parent_link("stall"), seconds(1.0, 12.0), outside=releases,
              holds=parent_link_of),
    FaultKind("worker-cut", 1, worker_link("cut"), pick_and(seconds(0.5, 5.0)), outside=outside,
              holds=worker_links_of, needs=others_carry_on),
    FaultKind("worker-stall", 1, worker_link("stall"),
              pick_and(lambda r, c: {"seconds": round(weighted(r, [(r.uniform(1.0, 8.0), 3),
                                                                   (1.3 * c["consumer.ack_wait"], 1)]), 2)}),
              outside=outside, holds=worker_links_of, needs=others_carry_on),
    FaultKind("parent-kill", 1, parent_kill, holds=parent),
    FaultKind("hup", 2, hup, hup_params, holds=parent),
    FaultKind("pause", 1, pause, seconds(0.5, 4.0), holds=lambda p: "pause", needs=lambda c: c["chaos.pause"]),
    FaultKind("scale", 2, scale, lambda r, c: {"how": r.choice(["ttin", "ttou", "post"]),
                                               "n": r.randint(max(1, c["workers.count"] - 1),
                                                              c["workers.count"] + 2)}, holds=parent),
]
KINDS = {k.name: k for k in FAULTS}


# ================================================================ processes

def parent_of(pid: int, default: int) -> int:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return default


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def with_pid(pid: int, sig: int) -> None:
    try:
        psutil.Process(pid).send_signal(sig)
    except psutil.Error:
        pass                                              # it died meanwhile


def signal_and_reap(act: Act, pid: int, sig: int) -> None:
    with_pid(pid, sig)
    wait_until(lambda: not act.run.watcher.alive(pid), 60, f"worker {pid} reaped")


def died(act: Act, pid: int) -> float:
    life = act.run.watcher.lives.get(pid)
    return life.died if life and life.died else time.monotonic()


def wait_serving(act: Act, sup: SupervisorProc, timeout: float = 90.0) -> None:
    """At least one worker and every living one ready (the count may have been scaled)."""
    def ready() -> bool:
        if sup.proc.poll() is not None:
            raise AssertionError(f"the supervisor exited ({sup.proc.returncode}) while starting")
        s = sup.try_status()
        return bool(s) and s["workers"]["ready"] >= 1 and s["workers"]["ready"] == s["workers"]["alive"]
    wait_until(ready, timeout, "the supervisor serving")


# ================================================================ a run

def execute(run: Run, plan: Plan) -> None:
    """Start what the plan needs, put its load on, play its schedule."""
    server = run.start_server()
    run.connect([server.url])
    url = run.start_proxy(server).url
    run.ack_wait = plan.config["consumer.ack_wait"]
    if plan.config["chaos.pools"]:
        run.pools = dict(POOL_CONSUMERS)
    cfg = sections(plan.config)
    cfg["tracing"] = {**cfg.get("tracing", {}), "endpoint": collector(run, plan)}
    for i in range(plan.config["chaos.supervisors"]):
        name = f"chaos-{'ab'[i]}"
        per = {**cfg, "nats": {"name": name}, "fleet": {**cfg.get("fleet", {}), "name": name}}
        run.start_supervisor([url], ready=False, **{s: dict(v) for s, v in per.items()})
    act = Act(run, plan, server, [url])
    for sup in run.sups:
        wait_serving(act, sup)
    run.after_settle.append(lambda: cut_short(run, act))
    run.undo.append(lambda: kill_orphans(act))
    start = time.monotonic()
    if plan.subjects:
        run.publisher.subject_of = plan.subjects.__getitem__
    run.load(len(plan.jobs), plan.rate, lambda i: plan.jobs[i])
    locks: dict[str, threading.Lock] = defaultdict(threading.Lock)
    errors: list[BaseException] = []
    playing = []
    for step in plan.schedule:
        wait = start + step.at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        kind = KINDS[step.fault]
        lock = locks[kind.holds(step.params)] if kind.holds(step.params) else threading.Lock()
        t = threading.Thread(target=play, args=(act, step, start, lock, errors), name=f"chaos-{step.fault}",
                             daemon=True)
        t.start()
        playing.append(t)
    for t in playing:
        t.join(600)
    if errors:
        raise errors[0]


def collector(run: Run, plan: Plan) -> str:
    """[tracing]'s endpoint: an OTLP receiver of the run's when the collector is up, and after the
    settle every span that says "ack" must be a delivery the journal saw done by that pid; when
    it is down, a port nobody listens on (the exporter's failures must cost no job)."""
    if plan.config["chaos.collector"] == "down" or not plan.config.get("tracing.enabled"):
        return f"http://127.0.0.1:{free_port()}"
    receiver = Receiver().start()
    run.undo.append(receiver.stop)

    def check_spans() -> None:
        run.tail.poll()
        done = {(r.pid, r.seq, r.delivery) for r in run.tail.recs if r.event == "D"}
        spans = receiver.consumer_spans()
        wrong = [s for s in spans if s.attributes.get("supervisor.outcome") == "ack" and
                 (s.resource.get("process.pid"), s.attributes["jetstream.stream_seq"],
                  s.attributes["jetstream.delivery"]) not in done]
        run.notes.append(f"tracing: {len(spans)} spans received ({receiver.requests} export requests)")
        if wrong:
            raise AssertionError(f"tracing: {len(wrong)} span(s) say ack for a delivery the journal never saw "
                                 f"done, e.g. {wrong[0].attributes}")
    run.after_settle.append(check_spans)
    return receiver.endpoint


def play(act: Act, step: Step, start: float, lock: threading.Lock, errors: list[BaseException]) -> None:
    """One step, in its own thread: faults on different things overlap (a worker killed while the
    parent's link is cut), faults on the same thing (the server, one parent) take turns."""
    with lock:
        late = time.monotonic() - (start + step.at)
        if late > 10:
            act.run.notes.append(f"{step.fault} at +{step.at:g}s ran {late:.0f}s late (its resource was busy)")
        if not act.live(act.sup(step.params)):
            act.run.notes.append(f"{act.run.at()}: {step.fault} skipped: supervisor {step.params['sup']} "
                                 "is not running")
            return
        try:
            KINDS[step.fault].act(act, step.params)
        except BaseException as exc:      # the run goes on; the error fails it after the check
            errors.append(exc)


def cut_short(run: Run, act: Act) -> None:
    """After the fact: a run that never ended in a worker that exited although nothing of ours
    touched it was cut short by the supervisor. If it had run graceful_timeout (the smallest the
    run ever had) by then, that is the documented graceful_timeout running out at a retire,
    recycle or config roll: the job comes back at once (NAKed), and the run again is explained."""
    from .checker import runs_by_seq
    ends = {(r.pid, r.seq, r.delivery) for r in run.tail.poll() if r.event in "DR"}
    for seq, runs in runs_by_seq(run.tail.recs).items():
        for r in runs:
            if (r.pid, seq, r.delivery) in ends:
                continue
            life = run.watcher.lives.get(r.pid)
            if not life or life.died is None or any(f.touches(r.pid, r.start, life.died) for f in run.faults):
                continue
            if life.died - r.start >= act.graceful_min - 0.05:
                run.fault(f"graceful_timeout ({act.graceful_min:g}s) ran out", r.start, life.died, pids={r.pid})


def kill_orphans(act: Act) -> None:
    for pid in act.orphans:
        with_pid(pid, signal.SIGKILL)


def expectations(plan: Plan) -> dict[str, Any]:
    """Every verdict at its limit, but what faults outside the supervisor's control make it
    unable to explain (its ledger cannot tell a dead link's lost ack from AckWait too short)."""
    outside = any(KINDS[s.fault].outside(plan.config, s.params) for s in plan.schedule)
    return {**VERDICTS, **({"sup_unexplained": None} if outside else {})}


def overridden(plan: Plan, env: dict[str, str]) -> Plan:
    """A replay narrowed by hand: CHAOS_SET="key=json;..." sets drawn keys, CHAOS_DROP="fault,..."
    drops those faults from the schedule (the jobs stay as drawn). Not part of the draw."""
    for item in filter(None, env.get("CHAOS_SET", "").split(";")):
        key, _, value = item.partition("=")
        plan.config[key.strip()] = json.loads(value)
    drop = set(filter(None, env.get("CHAOS_DROP", "").split(",")))
    plan.schedule = [s for s in plan.schedule if s.fault not in drop]
    return plan


def run_random(seed: int, minutes: float, workdir: Any, logs_to: Any = None) -> Result:
    plan = overridden(draw(seed, minutes), dict(os.environ))
    over: list[str] = []                        # more jobs at once than the cap
    fast: list[str] = []                        # more starts in a window than the rate

    def play_plan(run: Run) -> None:
        if plan.config["chaos.limit"]:          # judged from the journal once the run settled
            run.after_settle.append(lambda: over.extend(over_limit(run, plan.config["chaos.limit"])))
        if plan.config["chaos.limit_rate"]:
            run.after_settle.append(lambda: fast.extend(over_rate(run, plan.config["chaos.limit_rate"])))
        execute(run, plan)
    result = run_with(f"random-{seed}", seed, play_plan, expectations(plan), workdir, logs_to=logs_to,
                      plan=plan.describe())
    for name, found in (("over_limit", over), ("over_rate", fast)):
        if found:
            result.failures.append(f"{name}={len(found)} (must be 0): {found[0]}")
            result.passed = False
    return result


def parse_seeds(text: str) -> list[int]:
    """`7`, `1-20` or `3,5,9-12`."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def budget_seeds(first: int, minutes: float, per_run: float) -> range:
    """As many seeds from `first` as `minutes` of wall time holds at `per_run` minutes each."""
    return range(first, first + max(1, math.floor(minutes / per_run)))
