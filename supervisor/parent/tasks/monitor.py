"""Watching the consumer: ConsumerInfo every monitor.interval, and the server's advisories.

Each poll feeds the lag analyzer (pure, lag.py), the dashboard's history ring (history.py) and
the crash ledger's ack floor. A failed poll (server down, consumer deleted) clears nothing and
crashes nothing: the numbers age (`poll_age_s`) until the lag state turns `unknown`.
Advisories: MAX_DELIVERIES means the server gave up on a job; it is still in the stream, so it is
copied to the dead-letter subject and nothing vanishes silently. MSG_TERMINATED is counted.
MSG_NAKED proves the server read a NAK (the in-transit check's F18 case, safety/in_transit.py).

One monitor per pool (its consumer; parent/crew.py). In a fleet (supervisor/parent/tasks/fleet.py)
only the consumer's elected poller asks the server about it; the others take its samples and
ask themselves only when those stop coming. In a cluster ConsumerInfo comes from the
consumer leader, whichever node that is now; `SampleGuard` keeps an answer that cannot be right
(a leader still catching up after a move, reporting consumer sequences that went backwards)
out of the lag analysis and the ledger. Acks sent while the leader moves can be lost (measured on
the 3-node test cluster: jobs acked during a step-down came back after AckWait): the ledger is
told to expect those redeliveries (`lost_ack_window`) instead of calling them unexplained.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from nats.js.errors import NotFoundError

from supervisor.config import Config
from supervisor.config.schedules import job_subjects
from supervisor.core.fleetview import ack_wait_range
from supervisor.core.lag import LagAnalyzer, Sample
from supervisor.nats import limits, ordering
from supervisor.nats.consumer import consumer_dict
from supervisor.observe.history import History
from supervisor.parent.crew import Crew
from supervisor.parent.tasks.fleet import Fleet
from workers import Job
from workers.runtime.deadletter import dead_letter

log = logging.getLogger("supervisor.monitor")

ACCEPT_AFTER = 5        # consecutive backward samples from one consumer taken as the truth after all
MOVE_SLACK = 2.0        # seconds around the window in which acks lost to a leader move come back
GIVEN_UP_EVERY = 60.0   # the stream is searched for jobs the consumer gave up on this often (and at a reconnect)
GIVEN_UP_BATCH = 100    # messages looked at, at most, per search


def lost_ack_window(before: dict, after: dict, t_before: float, t_after: float,
                    ack_waits: tuple[float, float]) -> tuple[float, float, int]:
    """(start, end, budget): when jobs whose acks a leader move swallowed come back, and at most
    how many. The acks were sent between the last answer of the old leader and the first of the
    new one; each job's AckWait timer had started at most a third of AckWait before its ack (the
    parent pings every AckWait/3), so it runs out between 2/3 AckWait after the first and AckWait
    after the last. At most the jobs in flight then, plus those delivered during the move."""
    low, high = ack_waits
    budget = max(before["num_ack_pending"], after["num_ack_pending"]) + max(
        0, after["delivered_consumer_seq"] - before["delivered_consumer_seq"])
    return t_before + low * 2 / 3 - MOVE_SLACK, t_after + high + MOVE_SLACK, budget


class SampleGuard:
    """Decides whether a ConsumerInfo answer is fit for the lag analysis. Pure.

    A durable consumer's sequences (delivered, ack floor) only grow for its whole life, on
    every node: an answer where they went back, from the same consumer (same `created`), is a
    consumer leader that has just taken over and not caught up, and is skipped. A new `created`
    is a recreated consumer: its answers count at once (the analyzer starts a new history). If
    the backward numbers persist for ACCEPT_AFTER answers, they are taken as the truth (a
    restored store), so a guard can never blind the monitor for good.
    """

    def __init__(self) -> None:
        self.last: dict | None = None
        self.rejected = 0           # in a row
        self.skipped = 0            # in total

    def check(self, c: dict) -> str:
        """"" when the sample is good (and becomes the reference), else why it is skipped."""
        why = self._problem(c)
        if why and self.rejected + 1 < ACCEPT_AFTER:
            self.rejected += 1
            self.skipped += 1
            return why
        self.last, self.rejected = c, 0
        return ""

    def _problem(self, c: dict) -> str:
        delivered, floor = c["delivered_consumer_seq"], c["ack_floor_consumer_seq"]
        if floor > delivered:
            return f"ack floor {floor} above delivered {delivered}"
        last = self.last
        if last is None or c.get("created") != last.get("created"):
            return ""
        if delivered < last["delivered_consumer_seq"] or floor < last["ack_floor_consumer_seq"]:
            return (f"consumer sequences went back (delivered {last['delivered_consumer_seq']} -> {delivered}, "
                    f"ack floor {last['ack_floor_consumer_seq']} -> {floor})")
        return ""


async def on_naked(crew: Crew, msg: Any) -> None:
    """MSG_NAKED: the server processed a NAK (consumer.go processNak sends it from inside), proof
    that it read that NAK, for a worker dead before the NAK's fence came back (F18, in_transit.py).
    Core NATS: one missed (a reconnect) leaves that job to AckWait, as without it."""
    t = time.monotonic()
    try:
        advisory = json.loads(msg.data)
        seq, delivery, cseq = int(advisory["stream_seq"]), int(advisory["deliveries"]), int(advisory["consumer_seq"])
    except (ValueError, KeyError, TypeError):
        log.warning("malformed MSG_NAKED advisory: %r", msg.data[:200])
        return
    in_transit = crew.in_transit
    crew.post(lambda: in_transit.nak_advised(seq, delivery, cseq, t))


def deletes_given_up(c: Config) -> bool:
    """A job the consumer gave up on is deleted from the work queue once its dead-letter copy
    is stored. With [ordering], whatever the copy (none without restart.dead_letter_subject):
    stored, the job would hold back every later job of its key for good."""
    return c.stream.retention == "workqueue" and (bool(c.ordering.key) or bool(
        c.restart.dead_letter_subject and c.restart.dead_letter_stream))


@dataclass
class LimitsReading:
    """[limits.NAME] in use fleet-wide: the stream's limits, one reading for every pool (the
    first pool's monitor polls; each pool's autoscaler and /status read it)."""
    in_use: dict[str, dict[str, int]] = field(default_factory=dict)
    error: str = ""


class Monitor:
    def __init__(self, cfg: Config, nc: Any, crew: Crew, on_polled: Callable[[], None] | None = None,
                 limits: LimitsReading | None = None, reads_limits: Callable[[], bool] = lambda: True):
        self.cfg, self.nc = cfg, nc         # the pool's effective config, the parent's connection
        self.crew = crew                    # the pool it watches: its ledger, counters, in-transit check
        self.on_polled = on_polled          # after each poll (parent/supervisor.py: systemd's STATUS=)
        self.analyzer = LagAnalyzer(cfg.monitor.lag_window, cfg.consumer.ack_wait, cfg.monitor.interval)
        self.history = History(cfg.monitor.lag_window, cfg.monitor.interval)
        self.consumer: dict[str, Any] | None = None
        self.polled_at: float | None = None
        self.error = ""
        self.advisories = {"max_deliveries": 0, "terminated": 0}
        self.guard = SampleGuard()
        self.fleet: Fleet | None = None     # set by parent/supervisor.py when the fleet runs
        self.shared_seq = 0                 # the poller's last sample taken
        self.source = "self"                # who the newest sample came from: "self" or the poller's name
        self.copied: set[int] = set()       # stream seqs given up on and dead-lettered by us
        self.given_up_due = 0.0             # next search for jobs the consumer gave up on (find_given_up) ...
        self.reconnects_seen = -1           # ... and at once after a reconnect
        self.reading = limits or LimitsReading()     # [limits.NAME] in use fleet-wide (supervisor/nats/limits.py) ...
        self.reads_limits = reads_limits             # ... polled by this monitor while this says so
        self.paused_until: str | None = None          # as last seen, to log a pause once
        self.backlog = ordering.Backlog()             # [ordering]: jobs stored per key

    def apply_config(self, cfg: Config) -> None:
        old, self.cfg = self.cfg, cfg
        if (old.monitor.lag_window, old.monitor.interval, old.consumer.ack_wait) != \
                (cfg.monitor.lag_window, cfg.monitor.interval, cfg.consumer.ack_wait):
            self.analyzer = LagAnalyzer(cfg.monitor.lag_window, cfg.consumer.ack_wait, cfg.monitor.interval)
            self.history.resize(cfg.monitor.lag_window, cfg.monitor.interval)

    async def run(self) -> None:
        await self.subscribe_advisories()
        while True:
            started = time.monotonic()
            await self.poll()
            await self.poll_limits()
            await self.backlog.poll(self.nc, self.cfg)
            self.after_poll()
            await asyncio.sleep(max(0.0, self.cfg.monitor.interval - (time.monotonic() - started)))

    async def poll(self) -> None:
        js = self.nc.jetstream()
        now = time.monotonic()
        fleet = self.fleet
        name = self.cfg.consumer.name
        shared = fleet.shared_sample(now, name) if fleet else None
        if fleet and shared is not None:
            consumer, seq = shared
            if seq != self.shared_seq:          # a sample we have not taken yet
                self.shared_seq, self.source = seq, fleet.poller_name(name)
                await self.accept(js, consumer)
            return
        if self.fleet and not self.fleet.may_poll(now, name):
            return                              # a failover in a big fleet: the readings age meanwhile
        try:
            info = await js.consumer_info(self.cfg.stream.name, self.cfg.consumer.name,
                                          timeout=max(1.0, 2 * self.cfg.monitor.interval))
        except NotFoundError:
            self.failed(time.monotonic(), f"consumer {self.cfg.consumer.name} not found on stream {self.cfg.stream.name}")
            return
        except Exception as exc:
            self.failed(time.monotonic(), f"ConsumerInfo failed: {type(exc).__name__}: {exc}"[:200])
            return
        consumer, self.source = consumer_dict(info), "self"
        if consumer["paused_until"]:     # shared with the fleet in the sample
            consumer["pause_reason"] = await limits.pause_reason(js, self.cfg)
        if await self.accept(js, consumer, asked=now):
            if self.fleet:
                await self.fleet.share(consumer, name)
            await self.find_given_up(js, consumer)

    async def accept(self, js: Any, consumer: dict[str, Any], asked: float | None = None) -> bool:
        """Take one ConsumerInfo answer (ours or the poller's) unless the guard rejects it. `asked`:
        when we sent the request (ours only: a shared sample's moment is the poller's)."""
        if self.error:
            log.info("ConsumerInfo answers again")
        self.error = ""
        why = self.guard.check(consumer)
        if why:
            log.warning("ignoring a ConsumerInfo answer from %s: %s (a new consumer leader catching up?)",
                        consumer.get("leader") or "the server", why, extra={"event": "consumer_sample_skipped"})
            return False
        now = time.monotonic()
        if self.consumer is not None and self.polled_at is not None \
                and consumer.get("leader") != self.consumer.get("leader"):
            self.leader_moved(self.consumer, consumer, self.polled_at, now)
        self.consumer = consumer
        self.polled_at = now
        self.note_pause(consumer)
        beat = self.crew.stats.progress_beat(self.crew.cfg.workers.job_timeout)
        # In a fleet, progress anywhere counts (supervisor/parent/tasks/fleet.py Fleet.progress).
        fleet_acked, fleet_busy = self.fleet.progress(self.cfg.consumer.name) if self.fleet else (0, False)
        self.analyzer.add(Sample(t=self.polled_at, num_pending=consumer["num_pending"],
                                 num_ack_pending=consumer["num_ack_pending"],
                                 num_redelivered=consumer["num_redelivered"],
                                 delivered_consumer_seq=consumer["delivered_consumer_seq"],
                                 ack_floor_consumer_seq=consumer["ack_floor_consumer_seq"],
                                 local_acked=self.crew.stats.worker_counters()["ack"] + fleet_acked,
                                 progress_alive=beat is not None or fleet_busy, progress_at=beat,
                                 paused=bool(consumer.get("paused_until"))))
        self.history.add(self.polled_at, consumer, self.analyzer.report(self.polled_at).state)
        ledger, c, t = self.crew.ledger, consumer, self.polled_at

        def record() -> None:
            ledger.ack_floor(c["ack_floor_stream_seq"])
            # Bounds only deaths before the ask (the server read its state between ask and answer);
            if asked is not None:      # a shared sample's moment is the poller's, unknown here
                ledger.delivered_seen(asked, c["delivered_stream_seq"])
        self.crew.post(record)
        if asked is not None:            # bounds what a later death can have had in transit (in_transit.py)
            in_transit = self.crew.in_transit
            self.crew.post(lambda: in_transit.observed(asked, t, c["delivered_stream_seq"], c["num_waiting"],
                                                          c["delivered_consumer_seq"], c["paused_until"] is not None))
        await self.resolve_acks_in_doubt(js)
        return True

    def note_pause(self, consumer: dict[str, Any]) -> None:
        """Say once when the consumer is paused (by anyone in the fleet) and when it resumes."""
        until = consumer.get("paused_until")
        if until == self.paused_until:
            return
        name = self.cfg.consumer.name
        if until:
            log.warning("consumer %s is paused until %s: %s", name, until, consumer.get("pause_reason") or
                        "no reason given", extra={"event": "consumer_paused", "until": until,
                                                  "reason": consumer.get("pause_reason", "")})
        else:
            log.info("consumer %s resumed", name, extra={"event": "consumer_resumed"})
        self.paused_until = until

    @property
    def limits(self) -> dict[str, dict[str, int]]:
        return self.reading.in_use

    @property
    def limits_error(self) -> str:
        return self.reading.error

    async def poll_limits(self) -> None:
        """[limits.NAME] in use across the fleet, for /status and autoscaling."""
        if not self.cfg.limits or not self.reads_limits():
            return
        try:
            self.reading.in_use = await limits.in_use(self.nc.jetstream(), self.cfg)
        except Exception as exc:
            error = f"limits bucket {self.cfg.fleet.limits_bucket}: {type(exc).__name__}: {exc}"[:200]
            if error != self.reading.error:
                log.warning("%s", error)
            self.reading.error = error
            return
        self.reading.error = ""

    def leader_moved(self, before: dict, after: dict, t_before: float, now: float) -> None:
        start, end, budget = lost_ack_window(before, after, t_before, now, ack_wait_range(self.cfg))
        why = f"ack possibly lost while the consumer leader moved ({before.get('leader')} -> {after.get('leader')})"
        ledger = self.crew.ledger
        self.crew.post(lambda: ledger.expect_window(start, end, budget, why, counter="leader_move_redeliveries"))
        log.info("consumer leader is %s now (was %s)", after.get("leader"), before.get("leader"),
                 extra={"event": "consumer_leader_moved"})

    async def resolve_acks_in_doubt(self, js: Any) -> None:
        """A dead worker's ack that may or may not have arrived: in a work queue an acked message
        is deleted, so a message that is gone was acked (the NAK we sent just in case was a no-op)."""
        if self.cfg.stream.retention != "workqueue":
            return                  # the ack floor settles these
        for seq in self.crew.ledger.in_doubt()[:20]:
            try:
                await js.get_msg(self.cfg.stream.name, seq)
            except NotFoundError:
                ledger = self.crew.ledger
                self.crew.post(partial(ledger.resolve, seq, "acked before the death (message gone)"))
            except Exception:
                return              # try again next poll

    def failed(self, t: float, error: str) -> None:
        if error != self.error:
            log.warning("%s", error)
        self.error = error
        self.analyzer.poll_failed(t, error)
        self.history.gap(t, self.analyzer.report(t).state)

    def after_poll(self) -> None:
        now = time.monotonic()
        change = self.analyzer.transition(now)
        if change:
            report = self.analyzer.report(now)
            level = logging.WARNING if report.state in ("stuck", "growing") else logging.INFO
            log.log(level, "lag state %s -> %s: %s", change[0], change[1], report.reason)
        if self.on_polled:
            self.on_polled()

    def status_line(self, now: float) -> str:
        """The pool's part of systemd's STATUS= line (parent/supervisor.py puts the pools together)."""
        c = self.consumer or {}
        return (f"pending {c.get('num_pending', '?')}, in flight {c.get('num_ack_pending', '?')}; "
                f"lag {self.analyzer.report(now).state}")

    def poll_age(self) -> float | None:
        return None if self.polled_at is None else time.monotonic() - self.polled_at

    # ------------------------------------------------------------ advisories

    async def subscribe_advisories(self) -> None:
        s, c = self.cfg.stream.name, self.cfg.consumer.name
        await self.nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{s}.{c}", cb=self.on_max_deliveries)
        await self.nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{s}.{c}", cb=self.on_terminated)
        await self.nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.MSG_NAKED.{s}.{c}", cb=partial(on_naked, self.crew))

    async def on_terminated(self, msg: Any) -> None:
        self.advisories["terminated"] += 1

    async def on_max_deliveries(self, msg: Any) -> None:
        self.advisories["max_deliveries"] += 1
        try:
            advisory = json.loads(msg.data)
            seq, deliveries = int(advisory["stream_seq"]), int(advisory.get("deliveries", 0))
        except (ValueError, KeyError, TypeError):
            log.warning("malformed MAX_DELIVERIES advisory: %r", msg.data[:200])
            return
        log.warning("job seq=%d reached consumer.max_deliver (%d deliveries); copying it to %s", seq, deliveries,
                    self.cfg.restart.dead_letter_subject or "(no dead-letter subject)")
        try:
            raw = await self.nc.jetstream().get_msg(self.cfg.stream.name, seq)
        except Exception as exc:
            log.error("job seq=%d: cannot read it back for the dead-letter copy: %s (the stream check will find it)",
                      seq, exc)
            return
        await self.give_up(raw, deliveries, f"max deliveries reached ({deliveries})")

    async def give_up(self, raw: Any, deliveries: int, reason: str) -> bool:
        """Copy a job the consumer gave up on to the dead letters. Once a dead-letter stream
        confirmed the copy, the original is deleted from the work queue: it would never be
        delivered again, and the stream check (find_given_up) must not copy it twice."""
        seq = raw.seq
        headers = dict(raw.headers or {})
        job = Job(data=raw.data or b"", subject=raw.subject or "", headers=headers, stream_seq=seq,
                  delivery=deliveries, msg_id=headers.get("Nats-Msg-Id"))
        try:
            await dead_letter(self.nc, self.cfg, job, reason)
            if deletes_given_up(self.cfg):
                await self.nc.jetstream().delete_msg(self.cfg.stream.name, seq)
        except NotFoundError:
            pass                    # deleted meanwhile (another supervisor copied it: one copy, by its Msg-Id)
        except Exception as exc:
            log.error("job seq=%d: dead-letter copy failed: %s (the stream check tries again)", seq, exc)
            return False
        self.copied.add(seq)
        message = f"job seq={seq} gave up after {deliveries} deliveries; copied to {self.cfg.restart.dead_letter_subject}"
        self.crew.post(lambda: self.crew.alert("max_deliveries", message))
        return True

    # ------------------------------------------------------------ jobs the consumer gave up on (R11a)

    async def find_given_up(self, js: Any, consumer: dict[str, Any]) -> None:
        """The MAX_DELIVERIES advisory is core NATS: a parent disconnected or restarting when it
        is sent never sees it, and the job would stay in the work queue for ever, never delivered,
        never copied. So after a start, after each reconnect and every GIVEN_UP_EVERY, look in the
        stream: in a work queue a stored message at or below the consumer's ack floor (or below
        what it delivered, when nothing awaits an ack) is one the consumer will never deliver
        again. One get_msg per such message, plus one: the first stored one past the bound ends it.
        (A job whose ack the server counted but whose removal it lost, a full disk, looks the
        same; the copy's reason says both.)"""
        c = self.cfg
        if c.stream.retention != "workqueue" or c.consumer.max_deliver == -1:
            return
        now, reconnects = time.monotonic(), self.nc.stats["reconnects"]
        if now < self.given_up_due and reconnects == self.reconnects_seen:
            return
        self.given_up_due, self.reconnects_seen = now + GIVEN_UP_EVERY, reconnects
        bound = consumer["delivered_stream_seq"] if consumer["num_ack_pending"] == 0 else consumer["ack_floor_stream_seq"]
        # Job subjects only: a schedule (or a delayed job waiting) below the bound was never the consumer's.
        for subject in job_subjects(c):
            if not await self.given_up_on(js, subject, bound):
                return

    async def given_up_on(self, js: Any, subject: str, bound: int) -> bool:
        """find_given_up on one subject; False when the search must stop here (an error)."""
        c, seq = self.cfg, 1
        for _ in range(GIVEN_UP_BATCH):
            try:
                raw = await js.get_msg(c.stream.name, seq=seq, subject=subject, next=True)
            except NotFoundError:
                return True         # nothing stored from seq on
            except Exception as exc:
                log.info("looking for jobs the consumer gave up on: %s; again at the next poll", exc)
                self.given_up_due = 0.0
                return False
            if raw.seq > bound:
                return True
            if raw.seq not in self.copied:
                log.warning("job seq=%d is in the stream below the consumer's ack floor: it reached max_deliver "
                            "while no supervisor saw the advisory; copying it to %s", raw.seq,
                            c.restart.dead_letter_subject or "(no dead-letter subject)",
                            extra={"event": "given_up_found", "seq": raw.seq})
                await self.give_up(raw, c.consumer.max_deliver,
                                   f"max deliveries reached ({c.consumer.max_deliver}); found in the stream below the "
                                   "consumer's ack floor (its advisory was missed, or the server lost an ack's removal)")
            seq = raw.seq + 1
        return True
