"""/status for people: the terminal table `supervisor status` prints (colour on a tty)."""

from __future__ import annotations

import os
from typing import Any

from supervisor.core.lag import STALE_MIN_S
from supervisor.nats.consumer import lag_line

COLORS = {"red": "31", "green": "32", "yellow": "33", "bold": "1", "dim": "2"}
LAG_COLORS = {"ok": "green", "growing": "yellow", "stuck": "red", "unknown": "yellow"}
IN_FLIGHT_SHOWN = 3
OUTSTANDING_SHOWN = 5


def use_color(stream: Any) -> bool:
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
    """The human view of /status: header, workers table, consumer, lag, cross-check, alerts; with
    several pools (or any [pools.NAME]) a section per pool between the header and the alerts."""
    pools = s.get("pools") or {}
    if len(pools) > 1 or any(name != "default" for name in pools):
        lines = status_header(s, color, with_pool=False)
        for name, p in pools.items():
            lines += ["", *pool_header(name, p, color), *autoscale_line(p.get("autoscale")),
                      *ordering_line(p.get("ordering")), "",
                      *workers_table(p.get("workers") or {}), "", *consumer_lines(p, color),
                      *crosscheck_lines(p.get("crosscheck") or {})]
        return "\n".join([*lines, "", *alert_lines(s.get("alerts") or [], color)])
    lines = [*status_header(s, color), "", *workers_table(s.get("workers") or {}), "",
             *consumer_lines(s, color), *crosscheck_lines(s.get("crosscheck") or {}),
             *alert_lines(s.get("alerts") or [], color)]
    return "\n".join(lines)


def pool_header(name: str, p: dict[str, Any], color: bool) -> list[str]:
    w = p.get("workers") or {}
    halted = f", {paint('HALTED', 'red', color)}: {p['halted']}" if p.get("halted") else ""
    return [paint(f"pool {name}", "bold", color) + f"  {w.get('alive', 0)} alive, {w.get('ready', '?')} ready, "
            f"target {w.get('target', '?')}, handler {p.get('handler', '?')}{halted}"]


def status_header(s: dict[str, Any], color: bool, with_pool: bool = True) -> list[str]:
    """The supervisor's lines; `with_pool`: the one pool's autoscale and ordering too."""
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
            *(autoscale_line(s.get("autoscale")) + ordering_line(s.get("ordering")) if with_pool else [])]


def autoscale_line(a: dict[str, Any] | None) -> list[str]:
    if not a:
        return []
    if not a.get("enabled"):
        return ["autoscale   off"]
    return [f"autoscale   {a.get('min', '?')}..{a.get('max', '?')}, target {a.get('target', '?')} "
            f"({a.get('kind', '?')}): {a.get('reason', '')}"]


def ordering_line(o: dict[str, Any] | None) -> list[str]:
    """[ordering]: the jobs parked here and the key waited on longest."""
    if not o:
        return []
    blocked = o.get("blocked") or []
    first = blocked[0] if blocked else None
    behind = "asking" if first is None or first.get("head_seq") is None else f"behind seq {first['head_seq']}"
    longest = f"; longest: key {first['key']} {behind}, {fmt_age(first['since_s'])}" if first else ""
    return [f"ordering    {o.get('key', '?')}: {o.get('parked', 0)} job(s) parked on {o.get('waiting_keys', 0)} "
            f"key(s){longest}"]


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
