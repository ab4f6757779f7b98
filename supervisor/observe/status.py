"""The one picture of a running supervisor: `/status` JSON, `/healthz`, alerts. Built on demand
from the arbiter (workers, ledger), the monitor (consumer, lag) and the slot tables."""

from __future__ import annotations

import os
import time
from typing import Any

from supervisor import __version__
from supervisor.nats.connect import redact_url
from supervisor.nats.consumer import POLLED_KEYS
from supervisor.parent.pool import rss_of
from workers.protocol import slots

OUTSTANDING_GRACE = 2.0      # poll intervals past AckWait before a missing held job raises an alert


def build_status(sup: Any) -> dict[str, Any]:
    arb, mon, cfg = sup.arbiter, sup.monitor, sup.cfg
    now = time.monotonic()
    lag = mon.analyzer.report(now).as_dict() if mon else {"state": "unknown"}
    consumer = consumer_block(mon, cfg)
    return {
        "version": __version__,
        "pid": os.getpid(),
        "uptime_s": round(now - arb.started, 3),
        "state": arb.state,
        "nats": nats_block(sup),
        "workers": {"target": arb.pool.target, "alive": len(arb.pool.slots), "ready": arb.pool.ready_count(),
                    "retiring": len(arb.pool.retiring),
                    "list": [worker_block(arb, w, now) for w in sorted(arb.pool.living(), key=lambda w: (w.slot, w.pid))]},
        "consumer": consumer,
        "lag": lag,
        "autoscale": arb.autoscale.status(now),
        "crosscheck": arb.ledger.crosscheck(now),
        "loop": arb.steps.status(),
        "peers": {"alone": bool(arb.peers.alone(now)), "heard": sorted(arb.peers.heard),
                  "gone": sorted(arb.peers.gone),
                  "in_transit_checks": dict(arb.in_transit.stats)},
        "jobs": arb.stats.worker_counters(),
        "idempotency": idempotency_block(cfg),
        "advisories": dict(mon.advisories) if mon else {},
        "fleet": sup.fleet.status() if getattr(sup, "fleet", None) else {"name": cfg.fleet.name, "peers": None},
        "alerts": alerts(sup, lag, now),
        "headline": headline(lag, consumer),
    }


def nats_block(sup: Any) -> dict[str, Any]:
    nc = sup.nc
    url = nc.connected_url if nc is not None and nc.is_connected else None
    server = f"{url.hostname}:{url.port}" if url else None
    return {"connected": bool(nc and nc.is_connected), "server": server, "embedded": sup.embedded is not None,
            "servers": [redact_url(s) for s in sup.cfg.nats.servers]}


def worker_block(arb: Any, w: Any, now: float) -> dict[str, Any]:
    t = w.table
    in_flight = []
    for e in t.snapshot():
        if e.state in (slots.HELD, slots.RUNNING):
            since = e.t_started if e.state == slots.RUNNING else e.t_held
            in_flight.append({"stream_seq": e.stream_seq, "delivery": e.delivery, "age_s": round(now - since, 3),
                              "state": slots.ENTRY_STATES[e.state]})
    beat = t.heartbeat()
    return {"slot": w.slot, "pid": w.pid, "state": w.state if w.state != "dead" else "draining",
            "jobs_acked": t.header(slots.ACKED_N), "jobs_nacked": t.header(slots.NAKED_N),
            "jobs_terminated": t.header(slots.TERMED_N), "jobs_started": t.header(slots.STARTED_N),
            "jobs_duplicate": t.header(slots.DUPLICATE_N),
            "restarts": arb.stats.slot_restarts.get(w.slot, 0), "rss_bytes": rss_of(w),
            "heartbeat_age_s": round(now - beat, 3) if beat > 0 else None,
            "uptime_s": round(now - w.started_at, 3), "retiring": w.retiring, "in_flight": in_flight}


def idempotency_block(cfg: Any) -> dict[str, Any]:
    """What dedupes what (README "Exactly once"): the stream drops a re-published Nats-Msg-Id
    within its duplicate window; with [idempotency] on, workers skip keys whose done-marker is in
    the KV bucket for `ttl` seconds."""
    i = cfg.idempotency
    return {"enabled": i.enabled, "bucket": i.bucket if i.enabled else None, "ttl_s": i.ttl,
            "duplicate_window_s": cfg.stream.duplicate_window, "double_ack": cfg.workers.double_ack}


def consumer_block(mon: Any, cfg: Any) -> dict[str, Any]:
    # Every key always there (null before the first poll): scripts index /status without guessing.
    block: dict[str, Any] = {"stream": cfg.stream.name, "name": cfg.consumer.name, **dict.fromkeys(POLLED_KEYS)}
    if mon and mon.consumer:
        block.update({k: v for k, v in mon.consumer.items() if k not in ("stream", "name")})
    age = mon.poll_age() if mon else None
    block["poll_age_s"] = None if age is None else round(age, 3)
    if mon:
        block["source"] = mon.source                     # "self", or the fleet poller that shared it
        block["samples_skipped"] = mon.guard.skipped     # answers the leader-move guard kept out
    if mon and mon.error:
        block["error"] = mon.error
    return block


def alerts(sup: Any, lag: dict[str, Any], now: float) -> list[dict[str, str]]:
    arb, cfg, mon = sup.arbiter, sup.cfg, sup.monitor
    out = [{"kind": a["kind"], "message": a["message"]} for a in arb.alerts]
    counts = arb.ledger.counts
    if counts["unexplained_redeliveries"]:
        slowest = max(arb.stats.slowest_job(), 0.0)
        out.append({"kind": "ack_wait_too_short", "message": (
            f"{counts['unexplained_redeliveries']} redelivery(ies) no crash or NAK explains: consumer.ack_wait is "
            f"{cfg.consumer.ack_wait:g}s and the slowest job seen ran {slowest:.2f}s. AckWait must exceed the "
            "slowest legitimate job (or keep workers.progress_pings on); otherwise a job held by another "
            "process (another host, a previous run) timed out.")})
    grace = cfg.consumer.ack_wait + OUTSTANDING_GRACE * cfg.monitor.interval + 1.0
    missing = [o for o in arb.ledger.outstanding(now) if not o["redelivered"] and o["age_s"] > grace]
    if missing:
        seqs = ", ".join(str(o["stream_seq"]) for o in missing[:10])
        out.append({"kind": "held_job_missing", "message": (
            f"{len(missing)} job(s) held by dead workers not seen again after AckWait + {OUTSTANDING_GRACE:g} polls: "
            f"seq {seqs}")})
    if lag.get("state") in ("stuck", "growing"):
        out.append({"kind": f"lag_{lag['state']}", "message": lag.get("reason", "")})
    if mon and mon.error:
        out.append({"kind": "consumer_unavailable", "message": mon.error})
    if sup.nc is not None and not sup.nc.is_connected:
        out.append({"kind": "nats_disconnected", "message": "the supervisor's NATS connection is down"})
    if getattr(sup, "fleet", None):
        out += sup.fleet.alerts()
    return out


# What the queue is doing, in one word a person reads at a glance (the dashboard's headline).
HEADLINES = {
    "draining": "The workers are working the queue down.",
    "idle": "Nothing waiting, nothing in flight.",
    "growing": "Jobs arrive faster than the workers finish them: pending rises across the window.",
    "stuck": "Work is waiting, but nothing has been acked for longer than AckWait.",
    "unknown": "No fresh numbers from the consumer.",
}


def headline(lag: dict[str, Any], consumer: dict[str, Any]) -> dict[str, str]:
    """The lag state said for the queue: `ok` with work waiting or in flight is draining, `ok`
    with none is idle; growing, stuck and unknown are themselves."""
    state = lag.get("state", "unknown")
    if state == "ok":
        work = (consumer.get("num_pending") or 0) + (consumer.get("num_ack_pending") or 0)
        state = "draining" if work else "idle"
    state = state if state in HEADLINES else "unknown"
    return {"state": state, "text": HEADLINES[state], "reason": lag.get("reason", "")}


def health(sup: Any) -> tuple[bool, str]:
    """(healthy, reason) for /healthz: workers alive and the lag state not stuck."""
    arb = sup.arbiter
    if arb.state not in ("running", "starting"):
        return False, f"supervisor is {arb.state}"
    if arb.pool.target > 0 and arb.pool.ready_count() == 0:
        return False, f"no worker ready (0/{arb.pool.target})"
    if sup.monitor:
        report = sup.monitor.analyzer.report(time.monotonic())
        if report.state == "stuck":
            return False, f"lag stuck: {report.reason}"
    return True, "ok"
