"""Pure rules about living workers: when to look at them, when one must be killed, which of its
jobs need a progress ping, when a recycled one may retire and when a NAKed job is NAKed again.
No clock is read here and nothing is sent: the arbiter passes in what it read from the slot
tables and does what these functions return (mechanism apart from policy, like policy.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from supervisor.config import Config
from workers.protocol import slots
from workers.protocol.exits import Kill, KillCause

MB = 1024 * 1024
DRAIN_MARGIN = 5.0          # beyond graceful_timeout before a draining worker is killed
FRESH_BEAT = 1.5            # a worker whose last beat is older than this shows no progress, gets no +WPI
STALE_LINK = 3.0            # a worker that had no PONG from NATS for this long has a stale connection
RENAK_AFTER = 4.0           # a dead worker's NAKed job nobody has seen again by then is NAKed once more
RSS_EVERY = 5.0             # seconds between RSS checks (psutil reads /proc)
PING_AT = 1 / 3             # +WPI once this fraction of a delivery's AckWait has gone by
STORED_PING_AFTER = 1.0     # ... or, for a job that waited in the stream that long, once held this long
UNSETTLED = (slots.HELD, slots.RUNNING)


@dataclass(frozen=True)
class Limits:
    """The configured limits these rules read (workers.* and consumer.*)."""
    heartbeat_timeout: float
    job_timeout: float
    ack_wait: float
    backoff: tuple[float, ...] = ()
    max_rss_mb: int = 0

    @classmethod
    def of(cls, cfg: Config) -> Limits:
        w, c = cfg.workers, cfg.consumer
        return cls(w.heartbeat_timeout, w.job_timeout, c.ack_wait, tuple(c.backoff), w.max_rss_mb)


def inspect_every(lim: Limits) -> float:
    """How often the living are inspected: often enough for heartbeats, job timeouts and the
    +WPI that must beat the shortest AckWait (a backoff step included)."""
    candidates = [0.5, lim.heartbeat_timeout / 4, lim.ack_wait / 6, *(b / 6 for b in lim.backoff)]
    if lim.job_timeout:
        candidates.append(lim.job_timeout / 4)
    return max(0.02, min(candidates))


def why_kill(now: float, lim: Limits, last_beat: float, started_at: float,
             entries: Iterable[slots.Entry], drain_deadline: float | None) -> Kill | None:
    """Why a worker must be SIGKILLed now, or None: silent past heartbeat_timeout (a worker that
    never beat counts from its fork), a job past job_timeout (that job is named), or a drain past
    its deadline."""
    silent = now - (last_beat if last_beat > 0 else started_at)
    if silent > lim.heartbeat_timeout:
        return Kill(KillCause.HEARTBEAT,
                    f"no heartbeat for {silent:.1f}s (workers.heartbeat_timeout={lim.heartbeat_timeout:g}s)")
    e = overdue_job(now, lim, entries)
    if e is not None:
        return Kill(KillCause.JOB_TIMEOUT, f"job seq={e.stream_seq} ran {now - e.t_started:.1f}s "
                                           f"(workers.job_timeout={lim.job_timeout:g}s)", blame=e.stream_seq)
    if drain_deadline is not None and now > drain_deadline:
        return Kill(KillCause.DRAIN_OVERDUE,
                    f"still draining {now - drain_deadline + DRAIN_MARGIN:.1f}s past graceful_timeout")
    return None


def overdue_job(now: float, lim: Limits, entries: Iterable[slots.Entry]) -> slots.Entry | None:
    """The first job running past job_timeout, if any: a kill for it blames that job alone."""
    if lim.job_timeout:
        for e in entries:
            if e.state == slots.RUNNING and now - e.t_started > lim.job_timeout:
                return e
    return None


def drain_deadline(now: float, graceful_timeout: float) -> float:
    """When a draining worker is killed: graceful_timeout for its jobs, plus time to settle them."""
    return now + graceful_timeout + DRAIN_MARGIN


def beat_fresh(now: float, last_beat: float) -> bool:
    """A worker that beat lately is making progress: its jobs may be kept alive with +WPI."""
    return now - last_beat <= FRESH_BEAT


def link_fresh(now: float, server_seen: float) -> bool:
    """The worker had a PONG from NATS lately: an ack it sends can still reach the server."""
    return now - server_seen <= STALE_LINK


def pings_due(now: float, held: Iterable[slots.Entry], timer_started: Callable[[slots.Entry], float],
              ack_wait: Callable[[int], float]) -> list[slots.Entry]:
    """The held jobs whose AckWait timer has run PING_AT of its length: +WPI restarts it. Only
    for a worker whose beat and link are fresh (the caller checks): a stuck worker's jobs must
    be free to come back."""
    return [e for e in held if e.state in UNSETTLED and e.reply
            and now - timer_started(e) >= ack_wait(e.delivery) * PING_AT]


def published_at(reply: str) -> float | None:
    """The message's timestamp (seconds since the epoch, by the server's clock) in a `$JS.ACK`
    reply subject: `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<nanoseconds>.<pending>`,
    or with a domain and account hash before the stream and a token more at the end; None when
    the subject is neither (or names no time)."""
    tokens = reply.split(".")
    if tokens[:2] != ["$JS", "ACK"] or len(tokens) not in (9, 11, 12):
        return None
    ns = tokens[7 if len(tokens) == 9 else 9]
    return int(ns) / 1e9 if ns.isdigit() and int(ns) > 0 else None


def stored_timer(e: slots.Entry, pinged: float, now: float, wall: float) -> float:
    """When the AckWait timer nats-server stores for a held delivery started (monotonic, as `now`
    and `pinged`; `wall` is time.time() at `now`): our last +WPI of this delivery, else the
    message's timestamp (what the server stores at a delivery), never later than the delivery.
    Not before STORED_PING_AFTER: most jobs end sooner, and a +WPI that lands after a NAK with a
    delay stretches the delay to a whole AckWait (processNak stores now - AckWait + delay,
    progressUpdate now), so none is sent where a fast job's NAK is likeliest."""
    if pinged >= e.t_held or now - e.t_held < STORED_PING_AFTER:
        return max(pinged, e.t_held)
    published = published_at(e.reply)
    if published is None:
        return e.t_held
    return min(e.t_held, now - max(0.0, wall - published))


def may_retire(last_job_started: bool, draining: bool, awaiting_replacement: bool,
               entries: Iterable[slots.Entry]) -> bool:
    """A worker that started its max_jobs-th job retires once its replacement is ready and that
    job is done: retiring it mid-job would let graceful_timeout cut the job short, and its
    redelivery would reach a fresh worker's limit the same way, forever."""
    return (last_job_started and not draining and not awaiting_replacement
            and not any(e.state in UNSETTLED for e in entries))


def rss_check_due(now: float, last_check: float, max_rss_mb: int) -> bool:
    return bool(max_rss_mb) and now - last_check >= RSS_EVERY


def rss_over(rss: int, max_rss_mb: int) -> str:
    """Why a worker is recycled for its memory, or ""."""
    if max_rss_mb and rss > max_rss_mb * MB:
        return f"RSS {rss / MB:.0f} MB > workers.max_rss_mb={max_rss_mb}"
    return ""


def renak_due(now: float, confirmed_at: float | None) -> bool:
    """A NAKed job nobody has seen again RENAK_AFTER after a fence proved the NAK arrived (two
    NAKs stuck in one stalled socket would arrive together and run the job twice)."""
    return confirmed_at is not None and now - confirmed_at >= RENAK_AFTER
