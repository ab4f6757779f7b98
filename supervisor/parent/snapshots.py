"""Taking the Snapshot (observe/snapshot.py): the one place that reads the parent's rooms (each
pool's slots and tables, ledger, peers, autoscaler and monitor; the fleet task) for the views.
Called on the parent's loop, so what it reads is never half-changed. Each pool is a
PoolSnapshot; the top level puts them together (the Snapshot's docstring says how)."""

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
    PoolSnapshot,
    PoolView,
    Snapshot,
    WorkerView,
)
from supervisor.parent.arbiter import Arbiter
from supervisor.parent.crew import Crew
from supervisor.parent.pool import rss_of
from supervisor.parent.process import WorkerProcess, WorkerState
from supervisor.parent.tasks.fleet import Fleet
from supervisor.parent.tasks.monitor import Monitor
from workers.protocol import slots

HELD_STATES = (slots.HELD, slots.RUNNING, slots.ACKED)
BLOCKED_SHOWN = 10          # [ordering]: keys listed in /status `ordering.blocked`


def take(arbiter: Arbiter, fleet: Fleet | None, nc: Any, embedded: bool,
         schedules: Mapping[str, Any] | None = None) -> Snapshot:
    now = time.monotonic()
    cfg = arbiter.cfg
    pools = tuple(pool_snapshot(crew, now) for crew in arbiter.crews.values())
    leaving = [pool_view(crew, now) for crew in arbiter.departing]
    lead = pools[0]
    several = len(pools) > 1
    return Snapshot(
        at=now, version=__version__, pid=os.getpid(), uptime_s=now - arbiter.started, state=arbiter.state,
        stopping=bool(arbiter.stopping), cfg=cfg, nats=nats_view(nc, cfg.nats.servers, embedded),
        pool=merge_pools([p.pool for p in pools] + leaving), consumer=lead.consumer, lag=lead.lag,
        autoscale=lead.autoscale, crosscheck=merge_crosscheck(pools) if several else lead.crosscheck,
        loop=arbiter.steps.status(), ledger=sum_counts([p.ledger for p in pools]),
        outstanding=tuple(o for p in pools for o in p.outstanding), peers=lead.peers,
        advisories=sum_counts([p.advisories for p in pools]),
        fleet=fleet.status() if fleet else {"name": cfg.fleet.name, "peers": None},
        raised=(*(Alert(a["kind"], a["message"], a["t"], a.get("pool", "")) for a in arbiter.alerts),
                *(Alert(a["kind"], a["message"]) for a in (fleet.alerts() if fleet else ()))),
        limits=limit_views(arbiter), limits_error=arbiter.lead.monitor.limits_error if arbiter.lead.monitor else "",
        schedules=dict(schedules or {}), ordering=lead.ordering, pools=pools)


def headcount(arbiter: Arbiter) -> tuple[int, int]:
    """(ready, target) of every pool together, as take()'s merged pool counts them, without reading
    a slot table: the process title asks twice a second, and a full snapshot reads every entry of
    every worker's table (most of the parent's CPU at 8 busy workers)."""
    pools = [crew.pool for crew in (*arbiter.crews.values(), *arbiter.departing)]
    return sum(p.ready_count() for p in pools), sum(p.target for p in pools)


def ordering_view(crew: Crew, now: float) -> OrderingView | None:
    """[ordering] in one pool: the parked jobs of its living workers, grouped by key, longest
    waiting first; its counters; its monitor's count of the jobs per key under its filter."""
    if not crew.cfg.ordering.key:
        return None
    keys: dict[str, list[slots.Entry]] = {}
    for w in crew.living():
        for e in w.table.snapshot():
            if e.key and e.state == slots.HELD:
                keys.setdefault(e.key, []).append(e)
    blocked = sorted((KeyWait(key, max(e.waiting_for for e in es) or None, len(es), now - min(e.t_held for e in es))
                      for key, es in keys.items()), key=lambda k: -k.since_s)
    checks, waited = crew.stats.ordering()
    monitor = crew.monitor
    return OrderingView(key=crew.cfg.ordering.key, parked=sum(len(es) for es in keys.values()),
                        waiting_keys=len(keys), blocked=tuple(blocked[:BLOCKED_SHOWN]), checks=checks, waited_s=waited,
                        backlog=dict(monitor.backlog.counts) if monitor else {},
                        backlog_age_s=now - monitor.backlog.at if monitor and monitor.backlog.at else None)


def pool_snapshot(crew: Crew, now: float) -> PoolSnapshot:
    monitor, ledger, cfg = crew.monitor, crew.ledger, crew.cfg
    tag = {"pool": crew.name} if crew.label else {}
    return PoolSnapshot(
        name=crew.name, cfg=cfg, pool=pool_view(crew, now),
        consumer=consumer_view(monitor, cfg.stream.name, cfg.consumer.name),
        lag=monitor.analyzer.report(now) if monitor else None, autoscale=crew.autoscale.status(now),
        crosscheck={**ledger.crosscheck(now), "naks_in_doubt": crew.deaths.naks_in_doubt(now),
                    "in_transit_unchecked": crew.in_transit.unchecked(now)},
        ledger=dict(ledger.counts),
        outstanding=tuple({**o, **tag} for o in ledger.outstanding(now)),
        peers={"alone": bool(crew.peers.alone(now)), "heard": sorted(crew.peers.heard),
               "gone": sorted(crew.peers.gone), "in_transit_checks": dict(crew.in_transit.stats),
               "words_missing": crew.peers.words.missing(), "words_lost": crew.peers.words.lost},
        advisories=dict(monitor.advisories) if monitor else {}, halted=crew.halted, ordering=ordering_view(crew, now))


def sum_counts(counts: list[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


def merge_crosscheck(pools: tuple[PoolSnapshot, ...]) -> dict[str, Any]:
    """Every pool's cross-check as one: numbers summed, lists joined with each entry's pool."""
    out: dict[str, Any] = {}
    for p in pools:
        for k, v in p.crosscheck.items():
            if isinstance(v, list):
                out.setdefault(k, []).extend({**item, "pool": p.name} for item in v)
            else:
                out[k] = out.get(k, 0) + v
    return out


def merge_pools(views: list[PoolView]) -> PoolView:
    """Every pool's workers as one pool (the top level of /status, /healthz, systemd, the title)."""
    if len(views) == 1:
        return views[0]
    buckets = [sum(b) for b in zip(*(v.duration_buckets for v in views))]
    return PoolView(
        target=sum(v.target for v in views), ready=sum(v.ready for v in views),
        retiring=sum(v.retiring for v in views), workers=tuple(w for v in views for w in v.workers),
        capacity=sum(v.capacity for v in views),
        jobs=Counters(*(sum(getattr(v.jobs, k) for v in views) for k in ("ack", "nak", "term", "duplicate"))),
        duration_buckets=tuple(buckets), duration_sum=sum(v.duration_sum for v in views),
        slowest_job_s=max(v.slowest_job_s for v in views), restarts=sum(v.restarts for v in views),
        worker_deaths=sum(v.worker_deaths for v in views), pings=sum(v.pings for v in views),
        busy=any(v.busy for v in views))


def limit_views(arbiter: Arbiter) -> tuple[LimitView, ...]:
    """[limits.NAME] across the pools (limits are the stream's, shared by every pool): the fleet's
    use as the first pool's monitor reads it, this supervisor's workers of every pool."""
    monitor = arbiter.lead.monitor
    here = merge_limit_rows([c.stats.limits() for c in arbiter.every_crew()])
    fleet = monitor.limits if monitor else {}
    out = []
    for name, lim in arbiter.cfg.limits.items():
        mine, theirs = here.get(name, {}), fleet.get(name)
        out.append(LimitView(name=name, concurrency=lim.concurrency, rate=lim.rate, subjects=lim.subjects,
                             in_use=theirs["in_use"] if theirs else None, starts=theirs["starts"] if theirs else None,
                             waiting=int(mine.get("waiting", 0)), held_here=int(mine.get("held", 0)),
                             taken=int(mine.get("taken", 0)), wait_s=float(mine.get("wait_s", 0.0))))
    return tuple(out)


def merge_limit_rows(rows: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for row in rows:
        for name, values in row.items():
            mine = out.setdefault(name, {})
            for k, v in values.items():
                mine[k] = mine.get(k, 0) + v
    return out


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


def pool_view(crew: Crew, now: float) -> PoolView:
    pool, stats = crew.pool, crew.stats
    counts = stats.worker_counters()
    buckets, total = stats.duration_histogram()
    workers = tuple(worker_view(crew, w, now) for w in sorted(pool.living(), key=lambda w: (w.slot, w.pid)))
    return PoolView(
        target=pool.target, ready=pool.ready_count(), retiring=len(pool.retiring), workers=workers,
        capacity=len(pool.slots) * pool.table_entries() // 2,
        jobs=Counters(counts["ack"], counts["nak"], counts["term"], counts["duplicate"]),
        duration_buckets=tuple(buckets), duration_sum=total, slowest_job_s=stats.slowest_job(),
        restarts=stats.totals.restarts, worker_deaths=stats.totals.worker_deaths, pings=stats.totals.pings,
        busy=stats.progress_beat(crew.cfg.workers.job_timeout) is not None)


def worker_view(crew: Crew, w: WorkerProcess, now: float) -> WorkerView:
    t = w.table
    beat = t.heartbeat()
    entries = t.snapshot()
    return WorkerView(
        slot=w.slot, pid=w.pid, state="draining" if w.state == WorkerState.DEAD else str(w.state),
        retiring=w.retiring,
        counters=Counters(t.header(slots.ACKED_N), t.header(slots.NAKED_N), t.header(slots.TERMED_N),
                          t.header(slots.DUPLICATE_N)),
        started=t.header(slots.STARTED_N), restarts=crew.stats.slot_restarts.get(w.slot, 0), rss_bytes=rss_of(w),
        heartbeat_age_s=now - beat if beat > 0 else None, uptime_s=now - w.started_at,
        jobs=tuple(job_view(crew, w, e, now) for e in entries if e.state in HELD_STATES), pool=crew.label,
        settling=sum(e.state in (slots.ACKED, slots.SETTLED) for e in entries))


def job_view(crew: Crew, w: WorkerProcess, e: slots.Entry, now: float) -> JobView:
    since = e.t_started if e.state == slots.RUNNING else e.t_held
    state = "parked" if e.key and e.state == slots.HELD else slots.ENTRY_STATES[e.state]
    return JobView(stream_seq=e.stream_seq, delivery=e.delivery, state=state,
                   age_s=now - since, timer_age_s=now - crew.deaths.timer_started(w.pid, e), reply=e.reply)
