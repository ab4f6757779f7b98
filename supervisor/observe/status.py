"""`/status` JSON, `/healthz` and the alerts, as functions of a Snapshot (observe/snapshot.py)."""

from __future__ import annotations

from typing import Any

from supervisor.observe.snapshot import Alert, ConsumerView, LimitView, OrderingView, PoolSnapshot, Snapshot, WorkerView
from workers.protocol.limitkeys import rate_window

OUTSTANDING_GRACE = 2.0      # poll intervals past AckWait before a missing held job raises an alert
UNKNOWN_LAG = {"state": "unknown"}


def build_status(snap: Snapshot) -> dict[str, Any]:
    """The /status JSON. With several pools the top-level workers, jobs and crosscheck are every
    pool's together and consumer, lag, autoscale and ordering the first pool's (observe/snapshot.py);
    `pools` has each pool's own, and `headline` is the worst pool's."""
    lag = snap.lag.as_dict() if snap.lag else dict(UNKNOWN_LAG)
    consumer = consumer_block(snap.consumer)
    pool = snap.pool
    pools = {p.name: pool_block(p) for p in snap.each()}
    return {
        "version": snap.version,
        "pid": snap.pid,
        "uptime_s": round(snap.uptime_s, 3),
        "state": snap.state,
        "nats": {"connected": snap.nats.connected, "server": snap.nats.server, "embedded": snap.nats.embedded,
                 "servers": list(snap.nats.servers)},
        "workers": {"target": pool.target, "alive": pool.alive, "ready": pool.ready, "retiring": pool.retiring,
                    "list": [worker_block(w) for w in pool.workers]},
        "consumer": consumer,
        "lag": lag,
        "autoscale": dict(snap.autoscale),
        "crosscheck": dict(snap.crosscheck),
        "loop": dict(snap.loop),
        "peers": dict(snap.peers),
        "jobs": pool.jobs.as_dict(),
        "idempotency": idempotency_block(snap.cfg),
        "advisories": dict(snap.advisories),
        "fleet": dict(snap.fleet),
        "limits": {v.name: limit_block(v) for v in snap.limits},
        "paused_until": consumer.get("paused_until"),
        "pause_reason": (consumer.get("pause_reason") or "") if consumer.get("paused_until") else None,
        "schedules": dict(snap.schedules),
        "ordering": ordering_block(snap.ordering),
        "pools": pools,
        "alerts": [{"kind": a.kind, "message": a.message, **({"pool": a.pool} if a.pool else {})}
                   for a in alerts(snap)],
        "headline": headline(lag, consumer) if len(pools) == 1 else worst_headline(pools),
    }


def pool_block(p: PoolSnapshot) -> dict[str, Any]:
    """One pool's part of /status: `pools.NAME`."""
    lag = p.lag.as_dict() if p.lag else dict(UNKNOWN_LAG)
    consumer = consumer_block(p.consumer)
    w = p.pool
    return {"workers": {"target": w.target, "alive": w.alive, "ready": w.ready, "retiring": w.retiring,
                        "list": [worker_block(v) for v in w.workers]},
            "handler": p.cfg.workers.handler, "consumer": consumer, "lag": lag, "crosscheck": dict(p.crosscheck),
            "autoscale": dict(p.autoscale), "jobs": w.jobs.as_dict(), "ordering": ordering_block(p.ordering),
            "halted": p.halted or None,
            "headline": {"state": "halted", "text": HEADLINES["halted"], "reason": p.halted} if p.halted
            else headline(lag, consumer)}


# The worst first: what a single word for several pools says.
HEADLINE_ORDER = ("halted", "stuck", "growing", "unknown", "paused", "draining", "idle")


def worst_headline(pools: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Several pools: the headline of the one in the worst state, its reason naming it."""
    name, block = min(pools.items(), key=lambda kv: HEADLINE_ORDER.index(kv[1]["headline"]["state"]))
    h = block["headline"]
    return {"state": h["state"], "text": h["text"], "reason": f"pool {name}: {h['reason']}" if h["reason"]
            else f"pool {name}"}


def worker_block(w: WorkerView) -> dict[str, Any]:
    in_flight = [{"stream_seq": j.stream_seq, "delivery": j.delivery, "age_s": round(j.age_s, 3), "state": j.state}
                 for j in w.jobs if j.state in ("held", "running")]
    c = w.counters
    parked = sum(j.state == "parked" for j in w.jobs)
    return {"slot": w.slot, "pid": w.pid, "state": w.state, **({"pool": w.pool} if w.pool else {}),
            "jobs_acked": c.ack, "jobs_nacked": c.nak, "jobs_terminated": c.term, "jobs_started": w.started,
            "jobs_duplicate": c.duplicate, "restarts": w.restarts, "rss_bytes": w.rss_bytes,
            "heartbeat_age_s": None if w.heartbeat_age_s is None else round(w.heartbeat_age_s, 3),
            "uptime_s": round(w.uptime_s, 3), "retiring": w.retiring, "in_flight": in_flight, "parked": parked,
            "settling": w.settling}


def limit_block(v: LimitView) -> dict[str, Any]:
    """One [limits.NAME]: `in_use` and `starts` across the fleet (null until the bucket is read);
    `waiting`, `held_here`, `taken`, `wait_s`: this supervisor's workers."""
    keys, seconds = rate_window(v.rate) if v.rate else (0, 0)
    return {"concurrency": v.concurrency, "in_use": v.in_use, "rate": v.rate, "waiting": v.waiting,
            "starts": v.starts, "rate_window": {"starts": keys, "seconds": seconds} if v.rate else None,
            "held_here": v.held_here, "taken": v.taken, "wait_s": round(v.wait_s, 3), "subjects": list(v.subjects)}


def ordering_block(v: OrderingView | None) -> dict[str, Any] | None:
    """[ordering] (null when off): jobs parked here until they are the first of their key, the
    keys they wait on (longest first: a key held back by a long retry or a poison job shows at
    the top), and the jobs each key has in the stream (every supervisor on it, counted there)."""
    if v is None:
        return None
    backlog = {"keys": None, "jobs": None, "top": [], **v.backlog,
               "age_s": None if v.backlog_age_s is None else round(v.backlog_age_s, 3)}
    return {"key": v.key, "parked": v.parked, "waiting_keys": v.waiting_keys,
            "blocked": [{"key": b.key, "head_seq": b.head_seq, "waiting": b.waiting, "since_s": round(b.since_s, 3)}
                        for b in v.blocked],
            "checks": v.checks, "waited_s": round(v.waited_s, 3), "backlog": backlog}


def idempotency_block(cfg: Any) -> dict[str, Any]:
    """What dedupes what (README "Exactly once"): the stream drops a re-published Nats-Msg-Id
    within its duplicate window; with [idempotency] on, workers skip keys whose done-marker is in
    the KV bucket for `ttl` seconds."""
    i = cfg.idempotency
    return {"enabled": i.enabled, "bucket": i.bucket if i.enabled else None, "ttl_s": i.ttl,
            "duplicate_window_s": cfg.stream.duplicate_window, "double_ack": cfg.workers.double_ack}


def consumer_block(c: ConsumerView) -> dict[str, Any]:
    # Every key always there (null before the first poll): scripts index /status without guessing.
    block: dict[str, Any] = {"stream": c.stream, "name": c.name, **c.values}
    block["poll_age_s"] = None if c.poll_age_s is None else round(c.poll_age_s, 3)
    block["source"] = c.source
    block["samples_skipped"] = c.samples_skipped
    if c.error:
        block["error"] = c.error
    return block


def alerts(snap: Snapshot) -> list[Alert]:
    """What the loop raised, then what the snapshot itself says is wrong: each pool's, then the
    supervisor's."""
    out = list(snap.raised)
    for p in snap.each():
        out += pool_alerts(p, snap.labelled)
    if not snap.nats.connected:
        out.append(Alert("nats_disconnected", "the supervisor's NATS connection is down"))
    if snap.limits_error:
        out.append(Alert("limits_unavailable", f"{snap.limits_error}: jobs needing a limit wait (none runs without it)"))
    if snap.schedules.get("refused") or snap.schedules.get("error"):
        out.append(Alert("schedules_refused" if snap.schedules.get("refused") else "schedules_failed",
                         f"[schedules] not applied: {snap.schedules.get('refused') or snap.schedules.get('error')}"))
    return out


def pool_alerts(p: PoolSnapshot, labelled: bool) -> list[Alert]:
    """One pool's: redeliveries nothing explains, held jobs not seen again, its lag, its consumer
    (named "pool NAME: ..." with [pools.*])."""
    out = []
    cfg, counts = p.cfg, p.ledger
    name, say = (p.name, f"pool {p.name}: ") if labelled else ("", "")
    if counts["unexplained_redeliveries"]:
        slowest = max(p.pool.slowest_job_s, 0.0)
        out.append(Alert("ack_wait_too_short", say + (
            f"{counts['unexplained_redeliveries']} redelivery(ies) no crash or NAK explains: consumer.ack_wait is "
            f"{cfg.consumer.ack_wait:g}s and the slowest job seen ran {slowest:.2f}s. AckWait must exceed the "
            "slowest legitimate job (or keep workers.progress_pings on); otherwise a job held by another "
            "process (another host, a previous run) timed out."), pool=name))
    grace = cfg.consumer.ack_wait + OUTSTANDING_GRACE * cfg.monitor.interval + 1.0
    missing = [o for o in p.outstanding if not o["redelivered"] and o["age_s"] > grace]
    if missing:
        seqs = ", ".join(str(o["stream_seq"]) for o in missing[:10])
        out.append(Alert("held_job_missing", say + (
            f"{len(missing)} job(s) held by dead workers not seen again after AckWait + {OUTSTANDING_GRACE:g} polls: "
            f"seq {seqs}"), pool=name))
    if p.lag and p.lag.state in ("stuck", "growing"):
        out.append(Alert(f"lag_{p.lag.state}", say + p.lag.reason, pool=name))
    if p.consumer.error:
        out.append(Alert("consumer_unavailable", say + p.consumer.error, pool=name))
    return out


# What the queue is doing, in one word a person reads at a glance (the dashboard's headline).
HEADLINES = {
    "draining": "The workers are working the queue down.",
    "idle": "Nothing waiting, nothing in flight.",
    "growing": "Jobs arrive faster than the workers finish them: pending rises across the window.",
    "stuck": "Work is waiting, but nothing has been acked for longer than AckWait.",
    "unknown": "No fresh numbers from the consumer.",
    "paused": "The consumer is paused on purpose: nothing is delivered until it resumes.",
    "halted": "The pool stopped: its workers kept dying before they were ready (fix it, then reload).",
}


def headline(lag: dict[str, Any], consumer: dict[str, Any]) -> dict[str, str]:
    """The lag state said for the queue: `ok` with work waiting or in flight is draining, `ok`
    with none is idle; growing, stuck and unknown are themselves."""
    state = lag.get("state", "unknown")
    if consumer.get("paused_until") and state != "unknown":
        reason = consumer.get("pause_reason") or "no reason given"
        return {"state": "paused", "text": HEADLINES["paused"], "reason": f"until {consumer['paused_until']}: {reason}"}
    if state == "ok":
        work = (consumer.get("num_pending") or 0) + (consumer.get("num_ack_pending") or 0)
        state = "draining" if work else "idle"
    state = state if state in HEADLINES else "unknown"
    return {"state": state, "text": HEADLINES[state], "reason": lag.get("reason", "")}


def health(snap: Snapshot) -> tuple[bool, str]:
    """(healthy, reason) for /healthz: workers alive, no pool halted, no pool's lag stuck."""
    if snap.state not in ("running", "starting"):
        return False, f"supervisor is {snap.state}"
    if snap.pool.target > 0 and snap.pool.ready == 0:
        return False, f"no worker ready (0/{snap.pool.target})"
    for p in snap.each():
        if p.halted:
            return False, f"pool {p.name} halted: {p.halted}"
        if p.lag and p.lag.state == "stuck":
            return False, f"lag stuck: {'pool ' + p.name + ': ' if snap.labelled else ''}{p.lag.reason}"
    return True, "ok"


def title(ready: int, target: int, state: str) -> str:
    """What `ps` shows after `supervisor: parent [STREAM/CONSUMER]`: every pool's workers ready
    and wanted (snapshots.headcount, which counts them as /status's merged pool does)."""
    return f"{ready}/{target} ready" + (f", {state}" if state != "running" else "")
