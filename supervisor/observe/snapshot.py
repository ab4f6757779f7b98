"""A frozen picture of a running supervisor: the one door between the parent and its views.

The parent builds it on its own loop (`Supervisor.snapshot`, from the arbiter, the monitor, the
fleet task and the slot tables), and every view reads it and nothing else: `/status`, `/metrics`,
`/healthz`, the dashboard (which draws `/status`), the fleet heartbeat and the process title. So
each view is a function of a value, unit-tested with a literal Snapshot, and no view can change
or even reach the arbiter. The mappings inside are copies: read them, never write them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from supervisor.config import Config
from supervisor.core.lag import LagReport


@dataclass(frozen=True)
class Counters:
    """Jobs settled by outcome (a duplicate: acked without running, [idempotency])."""
    ack: int = 0
    nak: int = 0
    term: int = 0
    duplicate: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"ack": self.ack, "nak": self.nak, "term": self.term, "duplicate": self.duplicate}


@dataclass(frozen=True)
class JobView:
    """One job a worker holds."""
    stream_seq: int
    delivery: int
    state: str              # held (pulled, not started) | parked (waiting for its key's turn) | running
                            # | acked (ack sent, not yet fenced)
    age_s: float            # since it was held; a running job: since it started
    timer_age_s: float      # how long its AckWait timer has run (since it was held or last pinged)
    reply: str              # its $JS.ACK reply subject


@dataclass(frozen=True)
class WorkerView:
    slot: int                # its slot in its pool
    pid: int
    state: str              # starting | ready | draining
    retiring: bool
    counters: Counters      # this worker's own, from its table
    started: int            # jobs it started
    restarts: int           # of its slot
    rss_bytes: int
    heartbeat_age_s: float | None
    uptime_s: float
    jobs: tuple[JobView, ...] = ()
    pool: str = ""          # its pool's name, with [pools.*] ("" without: one pool)
    settling: int = 0       # jobs acked, NAKed or TERMed whose fence has not yet proven the server read it


@dataclass(frozen=True)
class PoolView:
    target: int
    ready: int
    retiring: int
    workers: tuple[WorkerView, ...]
    capacity: int                          # jobs the pool can hold at once (half its table entries)
    jobs: Counters                         # since start: exited workers' and the living's
    duration_buckets: tuple[int, ...]      # per slots.DURATION_BUCKETS bound, then +Inf (not cumulative)
    duration_sum: float
    slowest_job_s: float
    restarts: int
    worker_deaths: int
    pings: int                             # +WPI sent for long jobs
    busy: bool                             # a live, beating worker runs a job within its job_timeout

    @property
    def alive(self) -> int:
        return len(self.workers)


@dataclass(frozen=True)
class NatsView:
    connected: bool
    server: str | None                     # HOST:PORT of the server the parent is connected to
    embedded: bool
    servers: tuple[str, ...]               # configured, credentials redacted


@dataclass(frozen=True)
class ConsumerView:
    stream: str
    name: str
    values: Mapping[str, Any]              # every polled ConsumerInfo key; None until the first poll
    poll_age_s: float | None
    source: str                            # "self", or the fleet poller whose sample this is
    samples_skipped: int                   # answers the leader-move guard kept out
    error: str


@dataclass(frozen=True)
class LimitView:
    """One [limits.NAME]: its settings, what the fleet holds (from the limits bucket), and what
    this supervisor's workers hold and wait for (their slot tables)."""
    name: str
    concurrency: int                       # 0: no cap
    rate: float                            # starts per second; 0: none
    subjects: tuple[str, ...]
    in_use: int | None                     # slots held across the fleet (None: not read yet)
    starts: int | None                     # starts within the rate's window, across the fleet
    waiting: int                           # this supervisor's jobs waiting for it now
    held_here: int                         # slots this supervisor's workers hold now
    taken: int                             # times they took it, since start
    wait_s: float                          # seconds their jobs spent waiting for it, since start


@dataclass(frozen=True)
class KeyWait:
    """A key whose jobs wait here, parked until they are the first of it in the stream."""
    key: str
    head_seq: int | None                   # the first job of it the stream last said it stores (None: not asked yet)
    waiting: int                           # its jobs parked here
    since_s: float                         # the longest of them has waited this long


@dataclass(frozen=True)
class OrderingView:
    """[ordering]: jobs parked in this supervisor's workers (their slot tables), and the jobs each
    key has in the stream (the monitor's count: supervisor/nats/ordering.py)."""
    key: str                               # ordering.key, "subject:N"
    parked: int                            # jobs parked now
    waiting_keys: int                      # distinct keys among them
    blocked: tuple[KeyWait, ...]           # the keys whose jobs waited longest, longest first
    checks: int                            # times the stream was asked, since start
    waited_s: float                        # seconds jobs spent parked, since start (those no longer parked)
    backlog: Mapping[str, Any]             # {"keys", "jobs", "top": [{"key", "jobs"}]} (+ "note"); {} before a count
    backlog_age_s: float | None


@dataclass(frozen=True)
class Alert:
    kind: str
    message: str
    t: float = 0.0                         # wall clock when raised
    pool: str = ""                         # the pool it is about, with [pools.*]


@dataclass(frozen=True)
class PoolSnapshot:
    """One pool ([pools.NAME], or `default`): everything that belongs to its consumer."""
    name: str
    cfg: Config                            # the pool's effective config (config/pools.py)
    pool: PoolView
    consumer: ConsumerView
    lag: LagReport | None
    autoscale: Mapping[str, Any]
    crosscheck: Mapping[str, Any]
    ledger: Mapping[str, int]
    outstanding: tuple[Mapping[str, Any], ...]
    peers: Mapping[str, Any]
    advisories: Mapping[str, int]
    halted: str = ""                       # why it stopped at boot (a crash loop); "" while it runs
    ordering: OrderingView | None = None   # [ordering] on in this pool


@dataclass(frozen=True)
class Snapshot:
    """With several pools the top-level pool, jobs, ledger, crosscheck, outstanding and
    advisories are every pool's together (sums; lists joined, each entry naming its pool), and
    consumer, lag, autoscale, peers and ordering the first pool's; `pools` holds each pool's own."""
    at: float                              # monotonic time it was taken
    version: str
    pid: int
    uptime_s: float
    state: str                             # starting | running | draining | stopping
    stopping: bool
    cfg: Config
    nats: NatsView
    pool: PoolView
    consumer: ConsumerView
    lag: LagReport | None
    autoscale: Mapping[str, Any]
    crosscheck: Mapping[str, Any]
    loop: Mapping[str, Any]                # failures of the loop's steps (parent/loopsteps.py)
    ledger: Mapping[str, int]              # the crash ledger's counts
    outstanding: tuple[Mapping[str, Any], ...]   # jobs held at a death not yet seen acked
    peers: Mapping[str, Any]
    advisories: Mapping[str, int]
    fleet: Mapping[str, Any]
    raised: tuple[Alert, ...] = field(default=())  # alerts the loop raised (deaths, halts, ...)
    limits: tuple[LimitView, ...] = field(default=())   # [limits.NAME], in the config's order
    limits_error: str = ""                 # the limits bucket did not answer the last read
    schedules: Mapping[str, Any] = field(default_factory=dict)   # what start's reconcile did (nats/schedules.py)
    ordering: OrderingView | None = None   # [ordering]: the first pool's (None: off there)
    pools: tuple[PoolSnapshot, ...] = field(default=())          # each pool's own, in the config's order

    @property
    def labelled(self) -> bool:
        """Pools are named (the config has [pools.*]): in /metrics labels, in alerts."""
        return bool(self.cfg.pools)

    def each(self) -> tuple[PoolSnapshot, ...]:
        """Every pool; a snapshot built without them (a view's test) is one pool, its top level."""
        if self.pools:
            return self.pools
        return (PoolSnapshot("default", self.cfg, self.pool, self.consumer, self.lag, self.autoscale, self.crosscheck,
                             self.ledger, self.outstanding, self.peers, self.advisories, ordering=self.ordering),)
