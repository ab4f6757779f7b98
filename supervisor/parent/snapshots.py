"""Taking the Snapshot (observe/snapshot.py): the one place that reads the parent's rooms (the
pool and its slot tables, the ledger, the peers, the autoscaler, the monitor, the fleet task)
for the views. Called on the parent's loop, so what it reads is never half-changed."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from supervisor import __version__
from supervisor.config.secrets import redact_url
from supervisor.nats.consumer import POLLED_KEYS
from supervisor.observe.snapshot import (
    Alert,
    ConsumerView,
    Counters,
    JobView,
    KeyWait,
    LimitView,
    NatsView,
    OrderingView,
    PoolView,
    Snapshot,
    WorkerView,
)
from supervisor.parent.arbiter import Arbiter
from supervisor.parent.pool import rss_of
from supervisor.parent.process import WorkerProcess, WorkerState
from supervisor.parent.tasks.fleet import Fleet
from supervisor.parent.tasks.monitor import Monitor
from workers.protocol import slots

HELD_STATES = (slots.HELD, slots.RUNNING, slots.ACKED)
BLOCKED_SHOWN = 10          # [ordering]: keys listed in /status `ordering.blocked`


def take(arbiter: Arbiter, monitor: Monitor | None, fleet: Fleet | None, nc: Any, embedded: bool,
         schedules: Mapping[str, Any] | None = None) -> Snapshot:
    now = time.monotonic()
    cfg, ledger = arbiter.cfg, arbiter.ledger
    return Snapshot(
        at=now, version=__version__, pid=os.getpid(), uptime_s=now - arbiter.started, state=arbiter.state,
        stopping=bool(arbiter.stopping), cfg=cfg, nats=nats_view(nc, cfg.nats.servers, embedded),
        pool=pool_view(arbiter, now), consumer=consumer_view(monitor, cfg.stream.name, cfg.consumer.name),
        lag=monitor.analyzer.report(now) if monitor else None,
        autoscale=arbiter.autoscale.status(now), crosscheck=ledger.crosscheck(now), loop=arbiter.steps.status(),
        ledger=dict(ledger.counts),
        outstanding=tuple(ledger.outstanding(now)),
        peers={"alone": bool(arbiter.peers.alone(now)), "heard": sorted(arbiter.peers.heard),
               "gone": sorted(arbiter.peers.gone), "in_transit_checks": dict(arbiter.in_transit.stats)},
        advisories=dict(monitor.advisories) if monitor else {},
        fleet=fleet.status() if fleet else {"name": cfg.fleet.name, "peers": None},
        raised=(*(Alert(a["kind"], a["message"], a["t"]) for a in arbiter.alerts),
                *(Alert(a["kind"], a["message"]) for a in (fleet.alerts() if fleet else ()))),
        limits=limit_views(arbiter, monitor), limits_error=monitor.limits_error if monitor else "",
        schedules=dict(schedules or {}), ordering=ordering_view(arbiter, monitor, now))


def ordering_view(arbiter: Arbiter, monitor: Monitor | None, now: float) -> OrderingView | None:
    """[ordering]: the parked jobs of every living worker, grouped by key, longest waiting first."""
    if not arbiter.cfg.ordering.key:
        return None
    keys: dict[str, list[slots.Entry]] = {}
    for w in arbiter.pool.living():
        for e in w.table.snapshot():
            if e.key and e.state == slots.HELD:
                keys.setdefault(e.key, []).append(e)
    blocked = sorted((KeyWait(key, max(e.waiting_for for e in es) or None, len(es), now - min(e.t_held for e in es))
                      for key, es in keys.items()), key=lambda k: -k.since_s)
    checks, waited = arbiter.stats.ordering()
    return OrderingView(key=arbiter.cfg.ordering.key, parked=sum(len(es) for es in keys.values()),
                        waiting_keys=len(keys), blocked=tuple(blocked[:BLOCKED_SHOWN]), checks=checks, waited_s=waited,
                        backlog=dict(monitor.backlog.counts) if monitor else {},
                        backlog_age_s=now - monitor.backlog.at if monitor and monitor.backlog.at else None)


def limit_views(arbiter: Arbiter, monitor: Monitor | None) -> tuple[LimitView, ...]:
    here, fleet = arbiter.stats.limits(), monitor.limits if monitor else {}
    out = []
    for name, lim in arbiter.cfg.limits.items():
        mine, theirs = here.get(name, {}), fleet.get(name)
        out.append(LimitView(name=name, concurrency=lim.concurrency, rate=lim.rate, subjects=lim.subjects,
                             in_use=theirs["in_use"] if theirs else None, starts=theirs["starts"] if theirs else None,
                             waiting=int(mine.get("waiting", 0)), held_here=int(mine.get("held", 0)),
                             taken=int(mine.get("taken", 0)), wait_s=float(mine.get("wait_s", 0.0))))
    return tuple(out)


def nats_view(nc: Any, servers: tuple[str, ...], embedded: bool) -> NatsView:
    connected = bool(nc is not None and nc.is_connected)
    url = nc.connected_url if connected else None
    return NatsView(connected=connected, server=f"{url.hostname}:{url.port}" if url else None, embedded=embedded,
                    servers=tuple(redact_url(s) for s in servers))


def consumer_view(monitor: Monitor | None, stream: str, name: str) -> ConsumerView:
    values: dict[str, Any] = dict.fromkeys(POLLED_KEYS)
    if monitor is None:
        return ConsumerView(stream, name, values, None, "self", 0, "")
    values.update({k: v for k, v in (monitor.consumer or {}).items() if k not in ("stream", "name")})
    return ConsumerView(stream, name, values, monitor.poll_age(), monitor.source, monitor.guard.skipped,
                        monitor.error)


def pool_view(arbiter: Arbiter, now: float) -> PoolView:
    pool, stats = arbiter.pool, arbiter.stats
    counts = stats.worker_counters()
    buckets, total = stats.duration_histogram()
    workers = tuple(worker_view(arbiter, w, now) for w in sorted(pool.living(), key=lambda w: (w.slot, w.pid)))
    return PoolView(
        target=pool.target, ready=pool.ready_count(), retiring=len(pool.retiring), workers=workers,
        capacity=len(pool.slots) * pool.table_entries() // 2,
        jobs=Counters(counts["ack"], counts["nak"], counts["term"], counts["duplicate"]),
        duration_buckets=tuple(buckets), duration_sum=total, slowest_job_s=stats.slowest_job(),
        restarts=stats.totals.restarts, worker_deaths=stats.totals.worker_deaths, pings=stats.totals.pings,
        busy=stats.progress_beat(arbiter.cfg.workers.job_timeout) is not None)


def worker_view(arbiter: Arbiter, w: WorkerProcess, now: float) -> WorkerView:
    t = w.table
    beat = t.heartbeat()
    return WorkerView(
        slot=w.slot, pid=w.pid, state="draining" if w.state == WorkerState.DEAD else str(w.state),
        retiring=w.retiring,
        counters=Counters(t.header(slots.ACKED_N), t.header(slots.NAKED_N), t.header(slots.TERMED_N),
                          t.header(slots.DUPLICATE_N)),
        started=t.header(slots.STARTED_N), restarts=arbiter.stats.slot_restarts.get(w.slot, 0), rss_bytes=rss_of(w),
        heartbeat_age_s=now - beat if beat > 0 else None, uptime_s=now - w.started_at,
        jobs=tuple(job_view(arbiter, w, e, now) for e in t.snapshot() if e.state in HELD_STATES))


def job_view(arbiter: Arbiter, w: WorkerProcess, e: slots.Entry, now: float) -> JobView:
    since = e.t_started if e.state == slots.RUNNING else e.t_held
    state = "parked" if e.key and e.state == slots.HELD else slots.ENTRY_STATES[e.state]
    return JobView(stream_seq=e.stream_seq, delivery=e.delivery, state=state,
                   age_s=now - since, timer_age_s=now - arbiter.deaths.timer_started(w.pid, e), reply=e.reply)
