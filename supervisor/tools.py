"""Operator commands that talk to NATS or to a running supervisor: publish, lag, status, scale.

One-shot commands connect once and give up after `nats.connect_timeout` (exit 4): a mistyped
server must fail in a moment, not after the daemon's `nats.startup_timeout`."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import deque
from typing import Any

import nats.errors
import nats.js.errors
import uvloop

from . import provision
from .config import Config, client_config, from_args
from .consumer import consumer_info, lag_line
from .errors import EXIT_BUG, EXIT_OK, ConfigError, NatsUnavailable, SupervisorError
from .lag import STALE_MIN_S

PUBLISH_WINDOW = 4000       # PubAcks outstanding at once (nats-py's own publish_async default)
PUBACK_TIMEOUT = 10.0       # seconds a PubAck may take (a stalled window, the last ones)


async def connect_oneshot(cfg: Config, purpose: str) -> Any:
    """One connection attempt, bounded by nats.connect_timeout; NatsUnavailable (exit 4) names
    the servers and the reason."""
    from . import natsconn

    limit = cfg.nats.connect_timeout
    try:
        return await asyncio.wait_for(natsconn.connect(cfg.nats, name=f"{cfg.nats.name} {purpose}",
                                                       connect_timeout=limit), limit)
    except TimeoutError:
        where = ", ".join(natsconn.redact_url(s).partition("://")[2] for s in cfg.nats.servers)
        raise NatsUnavailable(f"cannot connect to NATS at {where}: no answer within "
                              f"nats.connect_timeout={limit:g}s") from None


def default_subject(cfg: Config) -> str:
    first = cfg.stream.subjects[0]
    return ".".join("new" if t == ">" else "any" if t == "*" else t for t in first.split("."))


# ---------------------------------------------------------------- publish

def cmd_publish(args: argparse.Namespace) -> int:
    cfg = client_config(from_args(args))
    if args.count < 0:
        raise ConfigError("--count", f"must be 0 or more, got {args.count}")
    if args.rate is not None and args.rate <= 0:
        raise ConfigError("--rate", f"must be more than 0, got {args.rate:g}")
    subject = args.subject or default_subject(cfg)
    stored, dups = uvloop.run(publish(cfg, subject, args.count, args.data, args.msg_id, args.rate))
    print(f"published {args.count} to {subject}: {stored} stored, {dups} duplicates")
    return EXIT_OK


async def publish(cfg: Config, subject: str, count: int, data: str, msg_id: str | None,
                  rate: float | None) -> tuple[int, int]:
    """Publish with up to PUBLISH_WINDOW PubAcks outstanding; (stored, duplicates). The stream is
    ensured first (as `start` would), so jobs published before the supervisor starts wait for it.

    nats-py's publish_async, as a hand-written loop would use it: each message goes out without
    waiting and its PubAck resolves a future, counted when it leaves the window. The window is
    ours (we wait for half of it at a time, with a timeout), so publish_async's own semaphore
    never blocks.
    (Awaiting js.publish in a window of tasks ran at 0.55x a plain publish_async loop: a task per
    message and asyncio.wait over the whole window each time one PubAck came back.)"""
    nc = await connect_oneshot(cfg, "publish")
    js = nc.jetstream(publish_async_max_pending=PUBLISH_WINDOW + 1)
    tally = PubAckTally(subject)
    window: deque[asyncio.Future] = deque()
    numbered, payload = "{i}" in data, data.encode()
    started = time.monotonic()
    try:
        await provision.ensure_stream(js, provision.stream_config(cfg), cfg.stream.create, "stream")
        for i in range(1, count + 1):
            if rate:
                delay = started + (i - 1) / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            if len(window) >= PUBLISH_WINDOW:
                await acks_until(window, PUBLISH_WINDOW // 2, tally)
            headers = {"Nats-Msg-Id": f"{msg_id}-{i}"} if msg_id else None
            window.append(await js.publish_async(subject, data.replace("{i}", str(i)).encode() if numbered
                                                 else payload, headers=headers))
        await acks_until(window, 0, tally)
    finally:
        await nc.drain()
    return tally.stored, tally.duplicates


async def acks_until(window: deque[asyncio.Future], left: int, tally: PubAckTally) -> None:
    """Wait until at most `left` PubAcks are outstanding (each within PUBACK_TIMEOUT); raise the
    first failure. PubAcks come back in order, nearly always: one wait for the newest that must
    be in, then whatever is done leaves the window (a straggler is waited for on its own)."""
    while len(window) > left:
        newest = window[len(window) - left - 1]
        target = window[0] if newest.done() else newest
        try:
            await asyncio.wait_for(asyncio.shield(target), PUBACK_TIMEOUT)
        except TimeoutError:
            tally.failed(TimeoutError(f"no PubAck within {PUBACK_TIMEOUT:g}s"))
        except Exception as exc:
            tally.failed(exc)
        while window and window[0].done():
            tally.count(window.popleft())
        tally.check()


class PubAckTally:
    """Counts PubAcks as their futures resolve; the first failure ends the publish (check())."""

    def __init__(self, subject: str):
        self.subject, self.stored, self.duplicates = subject, 0, 0
        self.failure: BaseException | None = None

    def count(self, future: asyncio.Future) -> None:
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            self.failed(exc)
        elif future.result().duplicate:
            self.duplicates += 1
        else:
            self.stored += 1

    def failed(self, exc: BaseException) -> None:
        self.failure = self.failure or exc

    def check(self) -> None:
        if self.failure is not None:
            raise NatsUnavailable(f"publishing to {self.subject} failed ({publish_failure(self.failure)}) after "
                                  f"{self.stored} stored, {self.duplicates} duplicates")


def publish_failure(exc: BaseException) -> str:
    """Why a JetStream publish got no PubAck, in words."""
    if isinstance(exc, (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError)):
        return "no stream captures that subject"
    return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- lag

def cmd_lag(args: argparse.Namespace) -> int:
    cfg = client_config(from_args(args))
    if args.watch is not None and args.watch <= 0:
        raise ConfigError("--watch", f"must be more than 0 seconds, got {args.watch:g}")
    return uvloop.run(lag(cfg, args.stream or cfg.stream.name, args.consumer or cfg.consumer.name,
                          args.json, args.watch))


async def lag(cfg: Config, stream: str, consumer: str, as_json: bool, watch: float | None) -> int:
    nc = await connect_oneshot(cfg, "lag")
    js = nc.jetstream()
    started = time.monotonic()
    try:
        while True:
            try:
                info: dict[str, Any] = await consumer_info(js, stream, consumer)
            except (TimeoutError, nats.errors.Error) as exc:
                # In a cluster a consumer leader move leaves ConsumerInfo unanswered for seconds:
                # a ticker says so and goes on; a single reading fails in one line (exit 4).
                why = f"no ConsumerInfo for {stream}/{consumer} ({type(exc).__name__}: {exc})"
                if watch is None:
                    raise NatsUnavailable(why) from None
                info = {"error": why}
            elapsed = time.monotonic() - started
            if as_json:
                print(json.dumps({"t": round(elapsed, 3), **info} if watch else info), flush=True)
            else:
                print((f"{elapsed:6.1f}s " if watch else "") + (info.get("error") or lag_line(info)), flush=True)
            if watch is None:
                return EXIT_OK
            await asyncio.sleep(watch - (time.monotonic() - started) % watch)
    finally:
        await nc.close()


def cmd_status(args: argparse.Namespace) -> int:
    """`supervisor status [--url URL] [--json]`: a running supervisor's /status, for people or scripts.

    Exit 0 when the supervisor answered; 1 when nothing (or no supervisor) answers at the URL,
    in one line; 2 when the URL itself is malformed. (`--fleet` is supervisor/fleet.py's.)"""
    base = supervisor_url(args)
    code, body = http_call(base, "GET", "/status")
    if code != 200:
        raise SupervisorUnreachable(f"GET {base}/status answered {code} {http_reason(code)}: {one_line(body)}")
    try:
        status = json.loads(body)
    except ValueError:
        status = None
    if not isinstance(status, dict) or "workers" not in status:
        raise SupervisorUnreachable(f"{base}/status did not answer with a supervisor's /status JSON: {one_line(body)}")
    if args.json:
        sys.stdout.write(body if body.endswith("\n") else body + "\n")
    else:
        print(render_status(status, color=use_color(sys.stdout)))
    return EXIT_OK


def cmd_scale(args: argparse.Namespace) -> int:
    """`supervisor scale N [--url URL]`: POST /scale?workers=N and print the new target.

    Exit 0 when the supervisor took the new target; 2 for N < 0, a malformed URL, or a target
    the supervisor refuses (4xx); 1 when nothing answers at the URL or it answers 5xx."""
    if args.n < 0:
        raise ConfigError("N", f"the worker count must be 0 or more, got {args.n}")
    base = supervisor_url(args)
    before = _target_now(base)
    code, body = http_call(base, "POST", f"/scale?workers={args.n}")
    if code >= 400:
        answer = f"POST {base}/scale?workers={args.n} answered {code} {http_reason(code)}: {one_line(body)}"
        if code < 500:
            raise ConfigError("scale", answer)
        raise SupervisorUnreachable(answer)
    try:
        target = int(json.loads(body)["target"])
    except (ValueError, KeyError, TypeError):
        target = args.n
    was = f" (was {before})" if before is not None else ""
    print(f"target {target} worker{'s' if target != 1 else ''}{was}; `supervisor status` shows them "
          f"{'starting' if before is None or target >= before else 'draining'}")
    return EXIT_OK


# ---------------------------------------------------------------- talking to a running supervisor


HTTP_TIMEOUT = 5.0
# An unspecified listen address means "every interface"; the supervisor is reachable on loopback.
_ANY_HOST = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class SupervisorUnreachable(SupervisorError):
    """Nothing answers at the supervisor's HTTP address, or it answers with an error.

    Exit 1: SPEC.md has no dedicated code for "the supervisor is not running"; 1 is the generic
    failure (2 stays "you typed something wrong", 4 stays "NATS")."""

    exit_code = EXIT_BUG


def supervisor_url(args: argparse.Namespace) -> str:
    """--url, else the effective monitor.http, as http://HOST:PORT (no trailing slash).
    The config is only read when --url is absent: a broken config must not hide a live supervisor."""
    if args.url:
        return base_url(args.url, "--url")
    http = from_args(args).monitor.http
    if not http:
        raise ConfigError("monitor.http", "is empty (the supervisor's HTTP endpoint is disabled); pass --url HOST:PORT")
    return base_url(http, "monitor.http")


def base_url(text: str, key: str) -> str:
    from urllib.parse import urlsplit

    from .config import parse_hostport

    text = text.strip()
    if "://" not in text:
        host, hostport = parse_hostport(text, key)
        return f"http://{_bracket(_ANY_HOST.get(host, host))}:{hostport}"
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise ConfigError(key, f"expected HOST:PORT or http://HOST:PORT, got {text!r}")
    host = _bracket(_ANY_HOST.get(parts.hostname, parts.hostname))
    return f"{parts.scheme}://{host}{f':{port}' if port else ''}{parts.path.rstrip('/')}"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def http_call(base: str, method: str, path: str) -> tuple[int, str]:
    """(status code, body) from the supervisor; SupervisorUnreachable when nothing sensible answers.
    Proxies are bypassed: the supervisor is local (or reached directly), never through http_proxy."""
    import http.client
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(base + path, method=method, data=b"" if method == "POST" else None)
    try:
        with opener.open(request, timeout=HTTP_TIMEOUT) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except urllib.error.URLError as exc:
        reason = getattr(exc.reason, "strerror", None) or str(exc.reason)
        raise SupervisorUnreachable(f"no supervisor answers at {base} ({reason}); is `supervisor start` running "
                                    "there? (--url, or monitor.http in the config)") from None
    except (OSError, http.client.HTTPException) as exc:
        reason = f"no answer within {HTTP_TIMEOUT:g}s" if isinstance(exc, TimeoutError) else (
            str(exc) or type(exc).__name__)
        raise SupervisorUnreachable(f"{base}{path}: {reason}") from None


def http_reason(code: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(code).phrase
    except ValueError:
        return ""


def one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _target_now(base: str) -> int | None:
    """The target before scaling, for the "(was N)" hint; None when /status does not say."""
    try:
        code, body = http_call(base, "GET", "/status")
        return int(json.loads(body)["workers"]["target"]) if code == 200 else None
    except (SupervisorUnreachable, ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------- rendering /status for people

COLORS = {"red": "31", "green": "32", "yellow": "33", "bold": "1", "dim": "2"}
LAG_COLORS = {"ok": "green", "growing": "yellow", "stuck": "red", "unknown": "yellow"}
IN_FLIGHT_SHOWN = 3
OUTSTANDING_SHOWN = 5


def use_color(stream: Any) -> bool:
    import os

    return bool(getattr(stream, "isatty", lambda: False)()) and "NO_COLOR" not in os.environ \
        and os.environ.get("TERM", "") != "dumb"


def paint(text: str, color: str, enabled: bool) -> str:
    return f"\x1b[{COLORS[color]}m{text}\x1b[0m" if enabled and color in COLORS else text


def fmt_age(seconds: float | None) -> str:
    """0.4s, 12s, 3m05s, 2h03m, 4d02h; '-' when unknown."""
    if seconds is None:
        return "-"
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def render_status(s: dict[str, Any], color: bool = False) -> str:
    """The human view of /status: header, workers table, consumer, lag, cross-check, alerts."""
    lines = [*status_header(s, color), "", *workers_table(s.get("workers") or {}), "",
             *consumer_lines(s, color), *crosscheck_lines(s.get("crosscheck") or {}),
             *alert_lines(s.get("alerts") or [], color)]
    return "\n".join(lines)


def status_header(s: dict[str, Any], color: bool) -> list[str]:
    state = s.get("state", "?")
    shown = paint(state, "green" if state == "running" else "yellow", color)
    nats = s.get("nats") or {}
    where = nats.get("server") or ", ".join(nats.get("servers") or []) or "?"
    link = "connected" if nats.get("connected") else paint("DISCONNECTED", "red", color)
    w = s.get("workers") or {}
    return [f"supervisor  pid {s.get('pid', '?')}, {shown}, up {fmt_age(s.get('uptime_s'))} "
            f"(jetstream-supervisor {s.get('version', '?')})",
            f"nats        {where} {link}{', embedded server' if nats.get('embedded') else ''}",
            f"workers     {w.get('alive', 0)} alive, {w.get('ready', '?')} ready, target {w.get('target', '?')}",
            *autoscale_line(s.get("autoscale"))]


def autoscale_line(a: dict[str, Any] | None) -> list[str]:
    if not a:
        return []
    if not a.get("enabled"):
        return ["autoscale   off"]
    return [f"autoscale   {a.get('min', '?')}..{a.get('max', '?')}, target {a.get('target', '?')} "
            f"({a.get('kind', '?')}): {a.get('reason', '')}"]


WORKER_COLUMNS = (("slot", ">4"), ("pid", ">7"), ("state", "<9"), ("acked", ">6"), ("nacked", ">6"),
                  ("termed", ">6"), ("restarts", ">8"), ("RSS MB", ">6"), ("beat", ">6"), ("in flight", ""))


def workers_table(workers: dict[str, Any]) -> list[str]:
    rows = [[str(w.get("slot", "?")), str(w.get("pid", "?")), _worker_state(w), str(w.get("jobs_acked", 0)),
             str(w.get("jobs_nacked", 0)), str(w.get("jobs_terminated", 0)), str(w.get("restarts", 0)),
             f"{(w.get('rss_bytes') or 0) / 1048576:.1f}", fmt_age(w.get("heartbeat_age_s")),
             _in_flight(w.get("in_flight") or [])] for w in workers.get("list") or []]
    if not rows:
        return [f"no worker processes (target {workers.get('target', '?')})"]
    return [_row([name for name, _ in WORKER_COLUMNS]), *(_row(r) for r in rows)]


def _row(cells: list[str]) -> str:
    return "  ".join(f"{cell:{align}}" for cell, (_, align) in zip(cells, WORKER_COLUMNS)).rstrip()


def _worker_state(w: dict[str, Any]) -> str:
    state = str(w.get("state", "?"))
    return "retiring" if w.get("retiring") and state == "ready" else state


def _in_flight(jobs: list[dict[str, Any]]) -> str:
    if not jobs:
        return "-"
    jobs = sorted(jobs, key=lambda j: -(j.get("age_s") or 0))
    cells = [f"seq {j.get('stream_seq')} #{j.get('delivery')} {fmt_age(j.get('age_s'))}" for j in jobs[:IN_FLIGHT_SHOWN]]
    more = f" +{len(jobs) - IN_FLIGHT_SHOWN} more" if len(jobs) > IN_FLIGHT_SHOWN else ""
    return ", ".join(cells) + more


def consumer_lines(s: dict[str, Any], color: bool) -> list[str]:
    c, lag = s.get("consumer") or {}, s.get("lag") or {}
    name = f"{c.get('stream', '?')}/{c.get('name', '?')}"
    if c.get("poll_age_s") is None or c.get("num_pending") is None:
        line = f"consumer    {name}: no ConsumerInfo yet"
    else:
        old = lag.get("state") == "unknown" and c["poll_age_s"] >= STALE_MIN_S    # unknown also means "just started"
        stale = paint(", STALE", "yellow", color) if old else ""
        line = f"consumer    {name}  {lag_line(c)}  (polled {fmt_age(c['poll_age_s'])} ago{stale})"
    lines = [line]
    if c.get("error"):
        lines.append(f"            {paint('poll failing', 'red', color)}: {c['error']}")
    state = str(lag.get("state", "unknown"))
    lines.append(f"lag         {paint(state, LAG_COLORS.get(state, ''), color)}{lag_detail(lag)}")
    return lines


def lag_detail(lag: dict[str, Any]) -> str:
    """What the lag state rests on, each number once. The reason already carries them for `ok`
    (finishing, empty in) and `growing` (the rise per second); `growing` adds what the reason
    leaves out. The pending slope is shown only as part of a rise: over a window that holds a
    burst it stays positive while the queue drains, which reads as the opposite of the truth."""
    reason = f": {lag['reason']}" if lag.get("reason") else ""
    if lag.get("state") != "growing" or lag.get("drain_rate_per_s") is None:
        return reason
    eta = lag.get("eta_s")
    return (f"{reason}; finishing {lag['drain_rate_per_s']:.1f}/s, "
            + (f"empty in ~{fmt_age(eta)}" if eta is not None else "not draining"))


def crosscheck_lines(x: dict[str, Any]) -> list[str]:
    get = lambda key: x.get(key, 0)  # noqa: E731
    lines = [f"crashes     {get('crashes')} ({get('crashes_holding_jobs')} holding jobs): held at crash "
             f"{get('jobs_held_at_crash')}, NAKed {get('held_jobs_naked')}, redelivered {get('held_jobs_redelivered')}"
             f", acked after {get('held_jobs_acked_after_crash')}, unexplained {get('unexplained_redeliveries')}, "
             f"quarantined {get('quarantined')}"]
    outstanding = x.get("outstanding") or []
    if not outstanding:
        return [*lines, "outstanding none"]
    lines.append(f"outstanding {len(outstanding)} job(s) held by dead workers, not yet redelivered and acked:")
    for o in outstanding[:OUTSTANDING_SHOWN]:
        lines.append(f"  seq {o.get('stream_seq')} (delivery {o.get('delivery')}) held by worker {o.get('slot')} "
                     f"pid {o.get('pid')}, died {fmt_age(o.get('age_s'))} ago ({o.get('cause', '?')}); "
                     f"{'NAKed' if o.get('naked') else 'not NAKed'}, "
                     f"{'redelivered' if o.get('redelivered') else 'not seen again yet'}")
    if len(outstanding) > OUTSTANDING_SHOWN:
        lines.append(f"  ... and {len(outstanding) - OUTSTANDING_SHOWN} more (--json lists them all)")
    return lines


def alert_lines(alerts: list[dict[str, Any]], color: bool) -> list[str]:
    if not alerts:
        return ["alerts      none"]
    return [f"alerts      {len(alerts)}"] + [f"  {paint(str(a.get('kind', '?')), 'red', color)}: {a.get('message', '')}"
                                             for a in alerts]
