"""The parent's and the CLI's side of [limits.NAME] and of pauses, in the limits bucket (its
layout: workers/protocol/limitkeys.py; the workers' side: workers/middleware/limits.py).

  - `in_use`: every limit's slots and starts held now, fleet-wide, from one StreamInfo (its
    per-subject counts): what /status `limits` and autoscaling read every monitor.interval.
  - `release_worker`: a dead worker's slots, purged at its death (its parent knows it at once;
    the slots' TTL would take LEASE_TTL), each only if its value still names that worker.
  - `pause` / `resume` / `pause_reason`: the server's consumer pause (PauseUntil, in the
    consumer's config: every supervisor sees it, and it survives restarts) and why, kept beside
    it in the bucket for /status and the log.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from nats.js.errors import NotFoundError

from supervisor.config import Config
from supervisor.nats.kv import keys_under, prefix_of, stream_of
from workers.protocol.limitkeys import LEASE_TTL, Holder, freed_subject, parse_key, pause_key, rate_window

log = logging.getLogger("supervisor")

__all__ = ["LEASE_TTL", "in_use", "release_worker", "pause", "resume", "pause_reason", "describe"]

REQUEST_TIMEOUT = 2.0
FOREVER = timedelta(days=3650)     # `supervisor pause` without --for: until `supervisor resume`
REASON_KEEP = 60                   # a pause's reason outlives the pause by this (seconds)


async def held_keys(js: Any, bucket: str) -> dict[str, int]:
    """Every slot and start key that holds a value now (key -> 1)."""
    return await keys_under(js, bucket, "*.*.*")


async def in_use(js: Any, cfg: Config) -> dict[str, dict[str, int]]:
    """{NAME: {"in_use": slots held, "starts": starts in the rate's current window}}."""
    out = {name: {"in_use": 0, "starts": 0} for name in cfg.limits}
    for key in await held_keys(js, cfg.fleet.limits_bucket):
        parsed = parse_key(key)
        if parsed and parsed[0] in out:
            out[parsed[0]]["in_use" if parsed[1] == "c" else "starts"] += 1
    return out


async def release_worker(nc: Any, cfg: Config, pid: int, slot: int) -> list[str]:
    """Purge the slots a dead worker (pid, of this supervisor on this host) still holds, each up
    to the revision that names it (a later holder's lease stays), and tell the waiters."""
    js, bucket = nc.jetstream(), cfg.fleet.limits_bucket
    host, me, released = socket.gethostname(), os.getpid(), []
    for key in await held_keys(js, bucket):
        parsed = parse_key(key)
        if not parsed or parsed[1] != "c" or parsed[0] not in cfg.limits:
            continue
        try:
            msg = await js.get_msg(stream_of(bucket), subject=prefix_of(bucket) + key)
        except NotFoundError:
            continue                     # given back or expired meanwhile
        holder = Holder.parse(msg.data or b"")
        if holder is None or (holder.host, holder.parent, holder.pid) != (host, me, pid):
            continue
        await purge_upto(nc, bucket, key, msg.seq)
        await nc.publish(freed_subject(bucket, parsed[0]), str(parsed[2]).encode())
        released.append(f"{parsed[0]} slot {parsed[2]}")
    if released:
        log.info("released the limit slots of dead worker %d (pid %d): %s", slot, pid, ", ".join(released),
                 extra={"event": "limit_released", "slot": slot, "worker_pid": pid, "released": released})
    return released


async def purge_upto(nc: Any, bucket: str, key: str, revision: int) -> None:
    """Remove `key`'s value if it is still at `revision` (a purge of sequences below revision + 1)."""
    reply = json.loads((await nc.request(f"$JS.API.STREAM.PURGE.{stream_of(bucket)}", json.dumps(
        {"filter": prefix_of(bucket) + key, "seq": revision + 1}).encode(), timeout=REQUEST_TIMEOUT)).data)
    if "error" in reply:
        raise RuntimeError(f"purge of {key}: {reply['error'].get('description', reply['error'])}")


def describe(cfg: Config, name: str) -> dict[str, Any]:
    """A limit's settings as /status shows them."""
    lim = cfg.limits[name]
    keys, window = rate_window(lim.rate) if lim.rate else (0, 0)
    return {"concurrency": lim.concurrency, "rate": lim.rate, "rate_window": {"starts": keys, "seconds": window}
            if lim.rate else None, "subjects": list(lim.subjects)}


# ---------------------------------------------------------------- pausing the consumer

def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).isoformat().replace("+00:00", "Z")


async def pause(nc: Any, cfg: Config, seconds: float | None, reason: str, by: str) -> tuple[str, bool]:
    """Pause the consumer for the whole fleet for `seconds` (None: until resumed). Never shortens
    a longer pause already in place. (PauseUntil as RFC 3339, whether it was moved.)"""
    js = nc.jetstream()
    stream, consumer = cfg.stream.name, cfg.consumer.name
    now = datetime.now(UTC)
    until = now + (FOREVER if seconds is None else timedelta(seconds=seconds))
    info = await js.consumer_info(stream, consumer, timeout=REQUEST_TIMEOUT)
    if info.paused and info.pause_remaining and now + timedelta(microseconds=info.pause_remaining / 1000) >= until:
        return str(info.config.pause_until), False
    answer = await js.pause_consumer(stream, consumer, rfc3339(until), timeout=REQUEST_TIMEOUT)
    if not answer.paused:
        raise RuntimeError(f"the server did not pause consumer {consumer}")
    body = json.dumps({"until": rfc3339(until), "reason": reason, "by": by, "at": time.time()}).encode()
    headers = {} if seconds is None else {"Nats-TTL": str(int(seconds) + REASON_KEEP)}
    try:
        await nc.request(prefix_of(cfg.fleet.limits_bucket) + pause_key(stream, consumer), body,
                         timeout=REQUEST_TIMEOUT, headers=headers or None)
    except Exception as exc:              # the pause stands; only its reason is not shown
        log.warning("consumer paused, but its reason was not stored in %s: %s", cfg.fleet.limits_bucket, exc)
    return rfc3339(until), True


async def resume(nc: Any, cfg: Config) -> bool:
    """End a pause now. False when the consumer was not paused."""
    js = nc.jetstream()
    info = await js.consumer_info(cfg.stream.name, cfg.consumer.name, timeout=REQUEST_TIMEOUT)
    await js.resume_consumer(cfg.stream.name, cfg.consumer.name, timeout=REQUEST_TIMEOUT)
    try:
        await js.purge_stream(stream_of(cfg.fleet.limits_bucket),
                              subject=prefix_of(cfg.fleet.limits_bucket) + pause_key(cfg.stream.name, cfg.consumer.name))
    except Exception as exc:
        log.debug("pause reason not removed: %s", exc)
    return bool(info.paused)


async def pause_reason(js: Any, cfg: Config) -> str:
    """Why the consumer is paused ("" when nobody said)."""
    try:
        msg = await js.get_msg(stream_of(cfg.fleet.limits_bucket),
                               subject=prefix_of(cfg.fleet.limits_bucket) + pause_key(cfg.stream.name, cfg.consumer.name))
        return str(json.loads(msg.data or b"{}").get("reason", ""))
    except Exception:
        return ""
