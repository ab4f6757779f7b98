"""`supervisor status --fleet`: one row per supervisor in the fleet bucket, read straight from
NATS (no HTTP to other hosts)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import uvloop
from nats.js.errors import NotFoundError
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE

from supervisor.cli.oneshot import connect_oneshot
from supervisor.cli.render import fmt_age
from supervisor.config import Config, client_config, from_args
from supervisor.config.pools import effective, names
from supervisor.core.fleetview import BEAT_PREFIX, LOST_AFTER
from supervisor.nats.consumer import consumer_dict, lag_line
from supervisor.nats.kv import keys_under, prefix_of, stream_of

READ_TIMEOUT = 5.0          # JetStream requests of `status --fleet` once connected


def cmd_status_fleet(args: argparse.Namespace) -> int:
    """One row per supervisor in the fleet bucket, read straight from NATS; exit 4 when NATS does
    not answer within nats.connect_timeout."""
    cfg = client_config(from_args(args))
    cfg = effective(cfg, names(cfg)[0])     # with pools: the first pool's consumer, as the fleet's samples
    report = uvloop.run(read_fleet(cfg))
    note = report.pop("note", "")
    print(json.dumps(report, indent=1) if args.json else render_fleet(report))
    if note:
        print(f"supervisor: {note}", file=sys.stderr)
    return 0


async def read_fleet(cfg: Config) -> dict:
    nc = await connect_oneshot(cfg, "status --fleet")
    try:
        js = nc.jetstream(timeout=READ_TIMEOUT)
        beats, note = await read_beats(js, cfg.fleet.bucket)
        consumer: dict = {"stream": cfg.stream.name, "name": cfg.consumer.name}
        try:
            consumer.update(consumer_dict(await js.consumer_info(cfg.stream.name, cfg.consumer.name)))
        except Exception as exc:      # the fleet view stands without it; say why it is missing
            consumer["error"] = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        await nc.close()
    report: dict = {"supervisors": fleet_rows(beats, time.time()), "consumer": consumer}
    if note:
        report["note"] = note
    return report


async def read_beats(js: Any, bucket: str) -> tuple[list[tuple[dict, float]], str]:
    """Every heartbeat in the bucket with the server time it was stored: the keys from the stream's
    per-subject counts, then each key's last message. (A KV watch's "nothing pending" marker can
    come before an entry the server already sent: nats-py reads num_pending before its handler has
    seen the delivery, and the view then showed no supervisor at all.)"""
    try:
        keys = await keys_under(js, bucket, f"{BEAT_PREFIX}>")
    except NotFoundError:
        return [], f"KV bucket {bucket} does not exist: no supervisor has run with stream.create on this server"
    beats = []
    for key in sorted(keys):
        try:
            msg = await js.get_msg(stream_of(bucket), subject=prefix_of(bucket) + key)
        except NotFoundError:
            continue                          # deleted or expired since the count
        if (msg.headers or {}).get(KV_OP) in (KV_DEL, KV_PURGE) or msg.time is None:
            continue                          # a supervisor that left cleanly
        try:
            beats.append((json.loads(msg.data or b""), msg.time.timestamp()))
        except ValueError:
            continue
    return beats, ""


def fleet_rows(beats: list[tuple[dict, float]], now: float) -> list[dict]:
    """the contract's rows: `lost` after 3 missed heartbeats (by the server's clock), or once a poller
    marked it so."""
    rows = []
    for beat, server_t in beats:
        mark = beat.get("lost") or {}
        seen = float(mark.get("server_t", server_t))
        age = max(0.0, now - seen)
        lost = bool(mark) or age > LOST_AFTER * float(beat.get("heartbeat") or 2.0)
        workers = beat.get("workers") or {}
        rows.append({"name": beat.get("name"), "host": beat.get("host"), "pid": beat.get("pid"),
                     "state": "lost" if lost else "ok",
                     "workers": {"ready": workers.get("ready"), "target": workers.get("target")},
                     "jobs_per_s": beat.get("jobs_per_s"), "crashes": beat.get("crashes"),
                     "last_seen_s": round(age, 1), "unexplained": beat.get("unexplained"),
                     "held": int(beat.get("held_total", len(beat.get("held") or ()))),
                     "held_listed": len(beat.get("held") or ()), "version": beat.get("version")})
    return sorted(rows, key=lambda r: (r["state"] != "ok", str(r["name"]), r["pid"] or 0))


FLEET_COLUMNS = (("name", "<16"), ("host", "<16"), ("pid", ">7"), ("state", "<5"), ("workers", ">7"),
                 ("jobs/s", ">7"), ("crashes", ">7"), ("held", ">5"), ("last seen", ">9"))


def render_fleet(report: dict) -> str:

    def row(cells: list) -> str:
        return "  ".join(f"{str(c):{align}}" for c, (_, align) in zip(cells, FLEET_COLUMNS)).rstrip()

    lines = [row([name for name, _ in FLEET_COLUMNS])]
    for r in report["supervisors"]:
        w = r["workers"]
        lines.append(row([r["name"], r["host"], r["pid"], r["state"], f"{w['ready']}/{w['target']}",
                          r["jobs_per_s"], r["crashes"], r["held"], fmt_age(r["last_seen_s"])]))
    if not report["supervisors"]:
        lines.append("(no supervisor in the fleet view)")
    c = report["consumer"]
    where = f"{c.get('stream')}/{c.get('name')}"
    if c.get("error"):
        lines.append(f"consumer  {where}: {c['error']}")
    else:
        leader = f"  (leader {c['leader']})" if c.get("leader") else ""
        lines.append(f"consumer  {where}  {lag_line(c)}{leader}")
    return "\n".join(lines)
