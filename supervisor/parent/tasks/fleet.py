"""The fleet: one supervisor per host, one consumer, seen through a JetStream KV bucket.

Every supervisor puts a small JSON heartbeat into `fleet.bucket` every `fleet.heartbeat` seconds,
under a key of its own (`sup.<name>.<pid>.<run>`): who it is, its workers, jobs/s, crashes, and
the jobs its workers hold right now (stream seq, delivery, how long their AckWait timer has run,
reply subject). `supervisor status --fleet` reads the bucket straight from NATS.

Each consumer has one *poller*, elected among the supervisors that run a pool on it through a
lease key of its own in the same bucket (`poller.<stream>.<consumer>`: created with a
per-message TTL, renewed with a revision-checked update: two can never both renew it). Only
the poller reads that consumer's ConsumerInfo (every `monitor.interval`) and broadcasts each
sample on core NATS, and only pollers watch the heartbeats. Everybody else takes the poller's
samples and polls ConsumerInfo itself only when they stop coming. So a fleet of N costs one
ConsumerInfo request per consumer per interval instead of N, and N heartbeat deliveries per
beat per poller instead of N*N (docs/FLEET.md has the numbers that led here). One lease per
consumer, not per bucket: a lost host's jobs are released by a supervisor that runs their
consumer, with its ledger, its AckWait and the redeliveries its peers there report; with one
pool per process (the systemd template), a bucket-wide poller ran another pool and could not.

Losing a host. A poller marks a peer `lost` once it has missed 3 heartbeats *while the bucket
worked*: its own heartbeats must have come back through the watch for that long, so a KV outage
or a leader election that silences everybody declares nobody lost. Ages are measured in the
server's timestamps, so no two hosts' clocks are compared. Then, for the consumers it polls on
which the peer ran pools, in this order:
  1. It writes the mark into the lost peer's own entry with a revision check, naming those
     consumers (added to any another consumer's poller named). If the peer beat again in the
     meantime, or another poller marked it first, the check fails and nothing else happens
     (then: the next tick, against the entry the watch brings).
  2. It tells every supervisor (supervisor/parent/safety/peers.py) which jobs the lost peer held, so a
     redelivery of one is explained "held by lost supervisor X", and when its jobs taken after
     its last heartbeat will come back (an AckWait window and a count), so those are too.
  3. It NAKs ("releases") the lost peer's held jobs so they are redelivered now instead of after
     AckWait, but only a job whose AckWait, counted from when it was held or last pinged, has
     more than RELEASE_MARGIN left (else the server may have redelivered it already, and a NAK
     matches by stream sequence: it would hit the current holder's delivery), that no live
     peer and no redelivery anyone reported has at a later delivery, and whose ack had not been
     sent already.
  0. Before all that it asks the peer's parent directly, over core NATS (`alive_subject`): a
     parent that answers is alive, its heartbeats only fail to land (the bucket refuses them, a
     KV leader election, clock skew across one), and nothing of its is marked or released. Only
     a peer that does not answer within PROBE_TIMEOUT (or has no subscriber: it is gone) is
     lost. Its workers die with it (PDEATHSIG), so a parent that is gone is a host that is gone.
A poller elected after the old one died counts its own heartbeat puts that have been getting
through as the proof that the bucket worked, so the old poller is declared lost as soon as the
new one sees it, not 3 more heartbeats later.

A heartbeat lists at most HELD_SHARE of the server's max_payload worth of held jobs (those with
the most AckWait left, the ones worth releasing) and says how many it held in all: over
max_payload nats-py refuses the put before sending it (MaxPayloadError), and a host holding some
12 000 jobs then went silent and had them released while they ran. A heartbeat that fails on
our side, or fails for LOST_AFTER - 1 beats, is an alert on /status: the poller is about to
declare this host lost.

A partitioned peer is not a dead one: its workers may still run the jobs it held. A release
then makes those jobs run twice at once. The probe cannot tell it from a dead one (it does not
answer either), nor a parent SIGSTOPped or starved for longer than PROBE_TIMEOUT while its
workers run on: those are the risk /status names (`fleet.release_risk`). Without it, they would run twice anyway once AckWait
ran out, because a partitioned parent cannot send the +WPI pings that keep them held, unless
the partition heals first. We release by default because a host lost for 3 heartbeats is far
more often dead than cut off for exactly between 3 heartbeats and AckWait, and handlers must
tolerate a redelivery anyway (at-least-once; `once()` for exactly-once effects).
`fleet.release_lost = false` waits for AckWait instead. A peer that comes back finds the mark on
its entry and logs that its jobs may have run twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from supervisor.config import Config
from supervisor.core.fleetview import (
    BEAT_PREFIX,
    LOST_AFTER,
    Fallback,
    FleetView,
    Peer,
    Release,
    ack_wait_range,
    beat_key,
    job_consumer,
    lease_key,
    lease_ttl,
    plan_release,
    reply_consumer,
    unlisted_budget,
    unlisted_window,
)
from supervisor.core.policy import ack_wait_for
from supervisor.nats.fix import server_info
from supervisor.observe.snapshot import Snapshot
from supervisor.parent.arbiter import Arbiter
from supervisor.parent.crew import Crew
from workers.protocol.fleetclaim import ORPHAN_PREFIX

log = logging.getLogger("supervisor.fleet")

SAMPLE_FRESH = 2.5          # poll intervals a broadcast ConsumerInfo sample stays usable
PROBE_TIMEOUT = 2.0         # a silent peer's parent must answer its probe this fast to count as alive
HELD_SHARE = 0.5            # of the server's max_payload a heartbeat's held list may take
DEFAULT_MAX_PAYLOAD = 1024 * 1024
# Heartbeat failures raised by nats-py before anything was sent: ours to fix, not the server's.
LOCAL_FAILURES = ("MaxPayloadError", "OutboundBufferLimitError")
RELEASE_RISK = ("a host declared lost while it is alive (cut off from NATS, or its parent paused past the probe) "
                "runs the released jobs twice, beside its own workers")


def sample_subject(stream: str, consumer: str) -> str:
    return f"supervisor.fleet.{stream}.{consumer}"


def alive_subject(stream: str, consumer: str, key: str) -> str:
    """Where a supervisor's parent answers "are you alive?" (its heartbeat key names it)."""
    return f"supervisor.fleet.{stream}.{consumer}.alive.{key}"


# ================================================================ one heartbeat

def held_jobs(snap: Snapshot) -> list[list]:
    """[seq, delivery, seconds its AckWait timer has run, reply, state] for every job a worker
    holds (state: held = pulled, parked = waiting for its key's turn ([ordering]), running, acked = ack
    sent, not yet confirmed)."""
    return [[j.stream_seq, j.delivery, round(j.timer_age_s, 3), j.reply, j.state]
            for w in snap.pool.workers for j in w.jobs]


def cap_held(held: list[list], budget: int) -> list[list]:
    """The held jobs a heartbeat lists: as many as fit in `budget` bytes of JSON, those with the
    most AckWait left first (the youngest timers: a release would skip the oldest anyway)."""
    out, used = [], 0
    for job in sorted(held, key=lambda j: j[2]):
        used += len(json.dumps(job, separators=(",", ":"))) + 1
        if used > budget:
            break
        out.append(job)
    return out


def build_beat(snap: Snapshot, name: str, started: float, jobs_per_s: float,
               held_budget: int = int(HELD_SHARE * DEFAULT_MAX_PAYLOAD)) -> dict:
    """Workers, jobs/s, crashes and held jobs of every pool, and per consumer (`consumers`) what
    its poller needs: capacity and jobs held there (a lost host's unlisted jobs are counted per
    consumer), acks and whether a long job runs (the fleet's progress for the lag analysis). A
    pool a reload is taking out is there while its workers hold jobs (capacity 0: it takes no
    more). `consumer`, `acked` and `busy` at the top are the first pool's, for older pollers."""
    counts, pool = snap.ledger, snap.pool
    lead = snap.pools[0] if snap.pools else None
    lead_consumer = (lead.consumer if lead else snap.consumer).name
    held = held_jobs(snap)
    per = {p.consumer.name: {"capacity": p.pool.capacity, "held": 0, "acked": p.pool.jobs.ack, "busy": p.pool.busy}
           for p in snap.pools} if snap.pools else \
        {lead_consumer: {"capacity": pool.capacity, "held": 0, "acked": pool.jobs.ack, "busy": pool.busy}}
    for job in held:
        consumer = job_consumer(job, {"consumer": lead_consumer})
        per.setdefault(consumer, {"capacity": 0, "held": 0, "acked": 0, "busy": False})["held"] += 1
    return {"name": name, "host": socket.gethostname(), "pid": snap.pid, "version": snap.version,
            "state": snap.state, "workers": {"ready": pool.ready, "target": pool.target},
            "jobs_per_s": round(jobs_per_s, 2), "crashes": counts["crashes"],
            "unexplained": counts["unexplained_redeliveries"], "started": started, "t": time.time(),
            "heartbeat": snap.cfg.fleet.heartbeat, "capacity": pool.capacity,
            "acked": (lead.pool if lead else pool).jobs.ack, "busy": (lead.pool if lead else pool).busy,
            "consumer": lead_consumer, "consumers": per,
            "held": cap_held(held, held_budget), "held_total": len(held)}


# ================================================================ the parent's fleet task

@dataclass
class Channel:
    """One consumer's side of the fleet, as this supervisor sees it: its poller lease (held by
    us or not), the poller's latest ConsumerInfo sample and fleet summary for it."""
    consumer: str
    sub: Any = None                       # our subscription to its samples
    lease_rev: int = 0                    # the lease's revision while we hold it; 0: we do not
    sample: tuple[dict, float, int, float] | None = None    # (consumer, received at, seq, interval)
    summary: dict = field(default_factory=dict)             # its poller's latest word on the fleet
    summary_at: float = -math.inf
    sent: int = 0                         # samples we broadcast as its poller
    fallback: Fallback = field(default_factory=Fallback)

    @property
    def polled(self) -> bool:
        return self.lease_rev > 0


class Fleet:
    """Runs on the parent's loop beside the monitors. It only reads the arbiter's state (slot
    tables, counters) and talks to NATS; it never changes a worker. Every NATS failure is
    logged once and retried at the next beat: the fleet view is never a reason to stop work.

    Long because heartbeat, leases, watch, loss handling and sample sharing are one task's steps
    around one piece of state (which leases we hold, at which revision); the decisions are
    already outside it (FleetView, Fallback, plan_release, unlisted_window), each pure.

    With pools: one heartbeat for the whole supervisor (every pool's held jobs, and per consumer
    its numbers); one Channel per consumer our pools run, each with a poller lease of its own.
    The poller of a consumer shares its ConsumerInfo and acts on the loss of a host for that
    consumer's jobs: every host's pool on it has a poller that runs it, whatever other pools
    either runs (the systemd template runs one pool per process)."""

    def __init__(self, cfg: Config, nc: Any, arbiter: Arbiter, snapshot: Callable[[], Snapshot]):
        self.cfg, self.nc, self.arbiter = cfg, nc, arbiter
        self.snapshot = snapshot              # what the heartbeat says (and our own held jobs)
        self.name = cfg.fleet.name or socket.gethostname()
        self.key = beat_key(self.name, os.getpid(), secrets.token_hex(3))
        self.started = time.time()
        self.kv: Any = None
        self.rev = 0                          # our entry's revision after our last heartbeat
        self.channels: dict[str, Channel] = {}   # consumer -> its channel, for every consumer our pools run
        self.view: FleetView | None = None    # only while we poll some consumer
        self.watcher: Any = None
        self.watch_task: asyncio.Task | None = None
        self.watch_started = 0.0
        self.acked_at: tuple[float, int] | None = None
        self.problem = ""
        self.puts_ok_since: float | None = None      # since when every heartbeat put has succeeded
        self.failing: tuple[float, str] | None = None   # (since when, why) our heartbeats fail
        self.released = 0                     # lost peers' jobs we NAKed (as a poller)
        self.beats = 0                        # heartbeats that got through
        self.probed: dict[str, float] = {}    # peer key -> when it last answered our probe
        self.records: asyncio.Task | None = None     # reading the orphans' records (read_records)

    @property
    def heartbeat(self) -> float:
        return self.cfg.fleet.heartbeat

    @property
    def poller(self) -> bool:
        """We poll some consumer: we watch the heartbeats."""
        return any(ch.polled for ch in self.channels.values())

    def polled(self) -> set[str]:
        return {c for c, ch in self.channels.items() if ch.polled}

    @property
    def lead(self) -> Crew:
        return self.arbiter.lead

    def channel(self, consumer: str) -> Channel | None:
        return self.channels.get(consumer)

    def apply_config(self, cfg: Any) -> None:
        self.cfg = cfg
        if self.view:
            self.view.heartbeat = cfg.fleet.heartbeat

    async def run(self) -> None:
        await self.nc.subscribe(alive_subject(self.cfg.stream.name, self.cfg.consumer.name, self.key), cb=self.on_probe)
        while True:
            started = time.monotonic()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:          # NATS hiccups of every kind: say it once, try next beat
                self.trouble(f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(max(0.05, self.heartbeat - (time.monotonic() - started)))

    async def tick(self) -> None:
        await self.sync_channels()
        if self.kv is None and not await self.open():
            return
        if self.records is None or self.records.done():
            self.records = asyncio.ensure_future(self.read_records())
        await self.beat()
        for ch in list(self.channels.values()):
            await self.hold_lease(ch)
        if self.poller:
            self.ensure_watch()
            await self.handle_lost()
            for ch in [ch for ch in self.channels.values() if ch.polled]:
                await self.broadcast(ch, None)
        self.hold_suspects()

    async def sync_channels(self) -> None:
        """A channel for every consumer a pool of ours runs (the first pool's first): a reload
        adds and takes out pools, and a consumer no pool here runs any more is left to another
        supervisor at once (its lease deleted, not left to expire)."""
        wanted = [c.cfg.consumer.name for c in self.arbiter.crews.values()]
        for consumer in [c for c in self.channels if c not in wanted]:
            ch = self.channels.pop(consumer)
            with contextlib.suppress(Exception):
                await ch.sub.unsubscribe()
            if ch.polled:
                rev = ch.lease_rev
                await self.step_down(ch, "no pool here runs it any more")
                with contextlib.suppress(Exception):
                    await self.kv.delete(lease_key(self.cfg.stream.name, consumer), last=rev)
        for consumer in wanted:
            if consumer not in self.channels:
                ch = Channel(consumer)
                ch.sub = await self.nc.subscribe(sample_subject(self.cfg.stream.name, consumer),
                                                 cb=functools.partial(self.on_sample, ch))
                self.channels[consumer] = ch
        self.channels = {c: self.channels[c] for c in wanted}     # the config's order: the lead first

    def trouble(self, problem: str) -> None:
        if problem != self.problem:
            log.warning("%s", problem, extra={"event": "fleet_trouble"})
        self.problem = problem

    async def open(self) -> bool:
        from nats.js.errors import BucketNotFoundError

        try:
            self.kv = await self.nc.jetstream().key_value(self.cfg.fleet.bucket)
        except BucketNotFoundError:
            self.trouble(f"KV bucket {self.cfg.fleet.bucket} does not exist (stream.create is false?); "
                         "this supervisor is not in the fleet view")
            return False
        return True

    # ------------------------------------------------------------ heartbeat

    async def beat(self) -> None:
        from nats.js.errors import KeyWrongLastSequenceError

        now, snap = time.monotonic(), self.snapshot()
        acked = snap.pool.jobs.ack
        rate = 0.0
        if self.acked_at and now > self.acked_at[0]:
            rate = (acked - self.acked_at[1]) / (now - self.acked_at[0])
        self.acked_at = (now, acked)
        max_payload = int(server_info(self.nc).get("max_payload") or DEFAULT_MAX_PAYLOAD)
        body = json.dumps(build_beat(snap, self.name, self.started, rate, held_budget=int(HELD_SHARE * max_payload)),
                          separators=(",", ":")).encode()
        try:
            self.rev = await (self.kv.update(self.key, body, last=self.rev) if self.rev
                              else self.kv.create(self.key, body))
        except KeyWrongLastSequenceError:
            await self.overwritten()
            self.rev = await self.kv.put(self.key, body)
        except BaseException as exc:
            self.puts_ok_since = None
            self.beat_failed(now, exc)
            raise
        if self.puts_ok_since is None:
            self.puts_ok_since = now
        self.failing = None
        self.beats += 1
        if self.problem:
            log.info("heartbeats get through again")
            self.problem = ""

    def beat_failed(self, now: float, exc: BaseException) -> None:
        """A failure on our side (nats-py refused the put) is a bug to fix, said loudly at once."""
        why = f"{type(exc).__name__}: {exc}"[:200]
        if self.failing is None:
            self.failing = (now, why)
        if type(exc).__name__ in LOCAL_FAILURES:
            log.error("fleet heartbeat not sent (%s): after %d missed beats the poller declares this supervisor "
                      "lost%s", why, LOST_AFTER, " and NAKs the jobs its workers are running" if self.cfg.fleet.release_lost
                      else "", extra={"event": "fleet_heartbeat_failed", "error": why})

    def alerts(self) -> list[dict[str, str]]:
        """/status alerts: our heartbeats failing (locally, or for long enough that we are about
        to be declared lost)."""
        if self.failing is None:
            return []
        since, why = self.failing
        failed_for = time.monotonic() - since
        local = why.split(":", 1)[0] in LOCAL_FAILURES
        if not local and failed_for < (LOST_AFTER - 1) * self.heartbeat:
            return []
        then = " and, with fleet.release_lost, NAKs the jobs its workers run: they run twice" \
            if self.cfg.fleet.release_lost else ""
        return [{"kind": "fleet_heartbeat_failing", "message": (
            f"fleet heartbeats have failed for {failed_for:.0f}s ({why}); after {LOST_AFTER * self.heartbeat:g}s "
            f"the poller declares this supervisor lost{then}, unless this parent answers its probe")}]

    async def on_probe(self, msg: Any) -> None:
        """A poller asks whether we are alive (our heartbeats have not reached it): we are."""
        if msg.reply:
            with contextlib.suppress(Exception):
                await self.nc.publish(msg.reply, json.dumps({"key": self.key, "failing": (self.failing or (0, ""))[1]})
                                      .encode())

    async def overwritten(self) -> None:
        """Our entry changed under us: a poller marked us lost while we could not beat."""
        try:
            entry = await self.kv.get(self.key)
            mark = json.loads(entry.value).get("lost") or {}
        except Exception:
            mark = {}
        if mark:
            text = (f"{mark.get('by', 'the poller')} declared this supervisor lost (no heartbeat for {LOST_AFTER} "
                    "beats) and released the jobs its workers held then: any of them still running here may run twice")
            log.warning("%s", text, extra={"event": "fleet_declared_lost"})
            self.arbiter.alert("fleet_declared_lost", text)

    # ------------------------------------------------------------ the poller lease

    async def hold_lease(self, ch: Channel) -> None:
        """Renew a consumer's lease we hold (revision-checked), or take it when nobody holds it."""
        from nats.js.errors import APIError, KeyWrongLastSequenceError

        body = json.dumps({"key": self.key, "name": self.name, "consumer": ch.consumer}).encode()
        ttl = lease_ttl(self.heartbeat)
        key = lease_key(self.cfg.stream.name, ch.consumer)
        if ch.polled:
            try:
                ack = await self.nc.jetstream().publish(f"$KV.{self.cfg.fleet.bucket}.{key}", body, msg_ttl=ttl,
                                                        headers={"Nats-Expected-Last-Subject-Sequence": str(ch.lease_rev)})
                ch.lease_rev = ack.seq
            except APIError as exc:
                if exc.err_code in (10071, 10164):      # someone else holds it now
                    await self.step_down(ch, "the lease moved to another supervisor")
                else:
                    raise
            return
        if time.monotonic() - ch.summary_at < LOST_AFTER * self.heartbeat:
            return                                    # its poller is talking: no need to ask
        try:
            ch.lease_rev = await self.kv.create(key, body, msg_ttl=ttl)
        except KeyWrongLastSequenceError:
            return
        if self.view is None:
            self.view = FleetView(self.key, self.heartbeat, channel_since=self.puts_ok_since)
        log.info("this supervisor is the poller of consumer %s now (its ConsumerInfo, and the fleet watch)",
                 ch.consumer, extra={"event": "fleet_poller", "consumer": ch.consumer})

    async def step_down(self, ch: Channel, why: str) -> None:
        log.info("no longer the poller of consumer %s: %s", ch.consumer, why,
                 extra={"event": "fleet_poller_lost", "consumer": ch.consumer})
        ch.lease_rev = 0
        if not self.poller:
            self.view = None
            await self.stop_watch()

    # ------------------------------------------------------------ the watch (poller only)

    def ensure_watch(self) -> None:
        """(Re)start the watch, also when it has stopped delivering our own heartbeats: the
        ordered consumer under it lives on one server, which may have gone."""
        view = self.view
        if view is None:
            return                  # not the poller
        stale = view.server_now(time.monotonic()) is None and self.watch_task is not None \
            and time.monotonic() - self.watch_started > view.stale_after
        if self.watch_task is None or self.watch_task.done() or stale:
            if self.watch_task is not None:
                asyncio.ensure_future(self.stop_watch())
            self.watch_started = time.monotonic()
            self.watch_task = asyncio.ensure_future(self.watch())

    async def watch(self) -> None:
        from nats.js.kv import KV_DEL, KV_PURGE

        self.watcher = await self.kv.watch(f"{BEAT_PREFIX}>")
        async for entry in self.watcher:
            if entry is None or self.view is None:
                continue
            if entry.operation in (KV_DEL, KV_PURGE):
                self.view.gone(entry.key)
                continue
            try:
                beat = json.loads(entry.value)
            except ValueError:
                log.warning("ignoring a malformed heartbeat under %s", entry.key)
                continue
            self.view.saw(entry.key, beat, entry.created.timestamp(), entry.revision, time.monotonic())

    async def stop_watch(self) -> None:
        task, watcher, self.watch_task, self.watcher = self.watch_task, self.watcher, None, None
        if task is not None:
            task.cancel()
        if watcher is not None:
            try:
                await watcher.stop()
            except Exception as exc:
                log.debug("stopping the watch: %s", exc)

    # ------------------------------------------------------------ lost peers (poller only)

    async def handle_lost(self) -> None:
        """Each lost peer, for the consumers we poll that it ran pools on and no poller has acted
        for yet: probe it, mark it (for those consumers), and explain and release its jobs there."""
        now, view = time.monotonic(), self.view
        if view is None:
            return                  # not a poller
        mine = frozenset(self.polled())
        for peer in view.due_lost(now, mine):
            since = view.age(peer, now)
            if since is None or await self.answers(peer, since, now):
                continue
            todo = view.todo(peer, mine)
            if not todo:
                continue
            plans = self.plans(peer, since, todo)
            if await self.mark(peer, since, todo, plans):
                await self.lost(peer, since, todo, plans)

    async def answers(self, peer: Peer, since: float, now: float) -> bool:
        """Evidence before a loss: does the silent peer's parent answer over core NATS? One that
        does is alive and keeps its jobs (asked again after LOST_AFTER beats); no answer within
        PROBE_TIMEOUT, or nobody subscribed (it is gone), and it is lost."""
        if now - self.probed.get(peer.key, -math.inf) < LOST_AFTER * self.heartbeat:
            return True
        try:
            reply = await self.nc.request(alive_subject(self.cfg.stream.name, self.cfg.consumer.name, peer.key),
                                          b"", timeout=PROBE_TIMEOUT)
        except Exception:
            self.probed.pop(peer.key, None)
            return False
        try:
            failing = str(json.loads(reply.data).get("failing") or "")
        except (ValueError, AttributeError):
            failing = ""
        if peer.key not in self.probed:
            log.warning("supervisor %s (pid %s on %s) sent no heartbeat for %.1fs but answers over NATS: not "
                        "declared lost, its jobs left alone%s", peer.name, peer.beat.get("pid"), peer.beat.get("host"),
                        since, f" (its heartbeats fail: {failing})" if failing else "",
                        extra={"event": "fleet_peer_silent_alive", "peer": peer.name, "failing": failing})
        self.probed[peer.key] = now
        return True

    async def mark(self, peer: Peer, since: float, consumers: frozenset[str], plans: dict[str, Release]) -> bool:
        """Write the lost mark into the peer's entry, checked against the revision we saw, naming
        the consumers we act for (added to those another consumer's poller named) and what `plans`
        release on each. Only the poller that wins this write acts on the loss for them, nobody if
        the peer beat again, nor if an orphan of its claimed its jobs there
        (workers/protocol/fleetclaim.py): an orphan that comes later must not NAK what we release."""
        from nats.js.errors import KeyWrongLastSequenceError

        before = peer.beat.get("lost") or {}
        handled = sorted(set(before.get("consumers") or ()) | consumers)
        released = dict(before.get("released") or {}) if isinstance(before.get("released"), dict) else {}
        released.update({name: [[s, d] for s, d, _ in plan.nak] for name, plan in plans.items()})
        mark = {"by": before.get("by", self.name), "t": before.get("t", time.time()), "server_t": peer.server_t,
                "consumers": handled, "released": released}
        beat = dict(peer.beat, lost=mark)
        try:
            peer.rev = await self.kv.update(peer.key, json.dumps(beat, separators=(",", ":")).encode(), last=peer.rev)
        except KeyWrongLastSequenceError:
            return False            # it beat again, or another poller marked it: the watch brings which
        peer.beat, peer.handled = beat, frozenset(handled)
        return True

    def crews_of(self, consumers: frozenset[str]) -> dict[str, Crew]:
        return {c.cfg.consumer.name: c for c in self.arbiter.crews.values() if c.cfg.consumer.name in consumers}

    def held_on(self, peer: Peer, consumers: frozenset[str]) -> dict[str, list[list]]:
        """A lost peer's listed jobs on each of `consumers`, by the consumer each was held on."""
        ours: dict[str, list[list]] = {}
        for job in peer.beat.get("held") or []:
            if (consumer := job_consumer(job, peer.beat)) in consumers:
                ours.setdefault(consumer, []).append(job)
        return ours

    def plans(self, peer: Peer, since: float, consumers: frozenset[str]) -> dict[str, Release]:
        """What to release of a lost peer's jobs on each consumer we act for."""
        ours = self.held_on(peer, consumers)
        return {name: self.plan(ours.get(name, []), since, crew) for name, crew in self.crews_of(consumers).items()}

    async def lost(self, peer: Peer, since: float, consumers: frozenset[str], plans: dict[str, Release]) -> None:
        """Explain a lost peer's jobs on the consumers we act for, then NAK what `plans` (named in
        our mark) release."""
        held = peer.beat.get("held") or []
        crews, ours = self.crews_of(consumers), self.held_on(peer, consumers)
        skipped = [(job[0], job[1], f"on consumer {c or '?'}: its own poller's to act on")
                   for job in held if (c := job_consumer(job, peer.beat)) not in crews]
        for consumer, crew in crews.items():
            jobs = ours.get(consumer, [])
            # Jobs the beat could not list, or taken after it, come back after AckWait, explained by the window.
            window = unlisted_window(since, ack_wait_range(crew.cfg))
            crew.peers.lost_peer(peer.name, [(s, d) for s, d, *_ in jobs], window,
                                 unlisted_budget(peer.beat, consumer, len(jobs)))
            await crew.peers.flush()    # the word first: our NAKs' redeliveries may land anywhere
        naked: list[int] = []
        for plan in plans.values():
            for seq, _delivery, reply in plan.nak:
                await self.nc.publish(reply, b"-NAK")
                naked.append(seq)
            skipped += plan.skipped
        self.released += len(naked)
        if naked:
            with contextlib.suppress(Exception):    # NATS away: the NAKs wait in nats-py's buffer; say what we did
                await self.nc.flush(timeout=2)
        log.warning("supervisor %s (pid %s on %s) is lost: no heartbeat for %.1fs; it held %d job(s): "
                    "released %d now (consumer %s), left %d alone%s", peer.name, peer.beat.get("pid"),
                    peer.beat.get("host"), since, len(held), len(naked), ", ".join(sorted(consumers)), len(skipped),
                    "".join(f"; seq {s}: {why}" for s, _, why in skipped[:5]),
                    extra={"event": "fleet_peer_lost", "peer": peer.name, "held": len(held), "released": naked,
                           "consumers": sorted(consumers), "skipped": [s for s, _, _ in skipped]})

    def plan(self, held: list[list], since: float, crew: Crew) -> Release:
        """What to NAK of a lost peer's jobs on `crew`'s consumer: a job anybody else (a live
        peer's heartbeat, our own workers, a redelivery any supervisor on it reported) has at a
        later delivery of that consumer is not its. One whose consumer a holder's reply subject
        does not say counts whatever the consumer (never a release too many)."""
        if not self.cfg.fleet.release_lost:
            return Release(skipped=[(s, d, "fleet.release_lost is false") for s, d, *_ in held])
        now, name = time.monotonic(), crew.cfg.consumer.name
        live = self.view.held_by_live(now) if self.view else {}
        own: dict[tuple[str, int], int] = {}
        for e in held_jobs(self.snapshot()):
            key = (reply_consumer(str(e[3] or "")) or "", e[0])
            own[key] = max(own.get(key, 0), e[1])
        c = crew.cfg.consumer
        return plan_release(held, since, lambda d: ack_wait_for(c.ack_wait, c.backoff, d),
                            lambda seq: max(live.get((name, seq), 0), live.get(("", seq), 0), own.get((name, seq), 0),
                                            own.get(("", seq), 0), crew.peers.seen_delivery(seq)))

    # ------------------------------------------------------------ orphans' records (every supervisor)

    async def read_records(self) -> None:
        """The records orphans leave at their exit (workers/protocol/fleetclaim.py orphan_key),
        from the oldest kept: the supervisor started in place of a dead one may have come up
        after its orphans said their NAKs on the ledger subject. Each goes to the pool of its
        consumer, as its ledger messages would have (peers.py receive)."""
        from nats.js.kv import KV_DEL, KV_PURGE

        watcher = await self.kv.watch(f"{ORPHAN_PREFIX}>")
        try:
            async for entry in watcher:
                if entry is not None and entry.operation not in (KV_DEL, KV_PURGE) and entry.value:
                    self.orphan_record(entry.value)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    def orphan_record(self, value: bytes) -> None:
        try:
            body = json.loads(value)
            for crew in self.arbiter.crews.values():
                if crew.cfg.consumer.name == body.get("consumer"):
                    crew.peers.receive(body, record=True)
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("ignoring a malformed orphan record in %s: %r", self.cfg.fleet.bucket, value[:100])

    # ------------------------------------------------------------ samples and the fleet summary

    def crew_of(self, consumer: str) -> Crew | None:
        return next((c for c in self.arbiter.crews.values() if c.cfg.consumer.name == consumer), None)

    def own_summary(self, ch: Channel) -> dict:
        now = time.monotonic()
        counts = self.view.counts(now) if self.view else {}
        acked, busy = self.view.progress(now, ch.consumer) if self.view else (0, False)
        crew = self.crew_of(ch.consumer)
        if crew is not None:        # our own share straight from the pool's counters (the Snapshot reads these)
            acked += crew.stats.worker_counters()["ack"]
            busy = busy or crew.stats.progress_beat(crew.cfg.workers.job_timeout) is not None
        return {"poller": self.name, "poller_key": self.key, "ok": counts.get("ok", 0) + counts.get("silent", 0),
                "silent": counts.get("silent", 0), "lost": counts.get("lost", 0), "acked": acked,
                "consumer": ch.consumer, "busy": busy}

    def summary_of(self, ch: Channel | None) -> dict:
        """A consumer's poller's latest word (ours when we poll it), while fresh."""
        if ch is None:
            return {}
        if ch.polled:
            return self.own_summary(ch)
        return ch.summary if time.monotonic() - ch.summary_at < LOST_AFTER * self.heartbeat else {}

    def progress(self, consumer: str) -> tuple[int, bool]:
        """Fleet-wide progress on `consumer` for its lag analysis: a sum of every supervisor's acks
        on it (it moves whenever anybody's workers ack), and whether any worker anywhere is busy
        on a long job of it within its job_timeout. Without it a host whose own workers are idle
        would read another host's long job, or its steady acks behind an ack floor pinned by a
        lost ack, as stuck."""
        summary = self.summary_of(self.channel(consumer))
        if summary.get("consumer") not in (None, consumer):
            return 0, False                 # an older poller's summary of another consumer
        return int(summary.get("acked") or 0), bool(summary.get("busy"))

    def poller_name(self, consumer: str) -> str:
        return str(self.summary_of(self.channel(consumer)).get("poller") or "poller")

    async def share(self, consumer: dict, name: str) -> None:
        """A monitor polled ConsumerInfo of consumer `name`: as its poller, hand the answer to everybody."""
        ch = self.channel(name)
        if ch is not None and ch.polled:
            await self.broadcast(ch, consumer)

    async def broadcast(self, ch: Channel, consumer: dict | None) -> None:
        ch.sent += 1
        body = {"from": self.key, "seq": ch.sent, "interval": self.cfg.monitor.interval,
                "heartbeat": self.heartbeat, "fleet": self.own_summary(ch)}
        if consumer is not None:
            body["consumer"] = consumer
        await self.nc.publish(sample_subject(self.cfg.stream.name, ch.consumer),
                              json.dumps(body, separators=(",", ":"), default=str).encode())

    async def on_sample(self, ch: Channel, msg: Any) -> None:
        try:
            body = json.loads(msg.data)
            sender, seq, interval = str(body["from"]), int(body["seq"]), float(body["interval"])
            summary = dict(body["fleet"])
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring a malformed sample: %r", msg.data[:100])
            return
        if sender == self.key:
            return
        # A second poller can only be one whose lease ran out unnoticed (renewals failing): its
        # next renewal fails the revision check and it steps down; meanwhile the lost mark's own
        # revision check keeps the two from both acting on a loss.
        now = time.monotonic()
        ch.summary, ch.summary_at = summary, now
        if isinstance(body.get("consumer"), dict):
            ch.sample = (body["consumer"], now, seq, interval)

    def shared_sample(self, now: float, consumer: str) -> tuple[dict, int] | None:
        """Its poller's latest ConsumerInfo while fresh; None: poll it yourself (if `may_poll`)."""
        ch = self.channel(consumer)
        if ch is None or ch.polled or ch.sample is None:
            return None
        sample, at, seq, interval = ch.sample
        if now - at > SAMPLE_FRESH * max(interval, self.cfg.monitor.interval):
            return None
        ch.fallback.reset()
        return sample, seq

    def may_poll(self, now: float, consumer: str) -> bool:
        """With no fresh sample: its poller always, and so does a supervisor that has never had a
        poller's sample of it (just started, or a pool just added: its lag readings must not
        wait); a member whose poller went quiet at its Fallback pace."""
        ch = self.channel(consumer)
        if ch is None or ch.polled or ch.sample is None:
            return True
        return ch.fallback.due(now, self.cfg.monitor.interval, int(ch.summary.get("ok") or 0))

    def hold_suspects(self) -> None:
        """While a peer is silent but not yet lost, a redelivery of a job it held must not be
        called unexplained: the ledger waits, at most until the peer is resolved."""
        from supervisor.parent.safety.peers import SUSPECT_GRACE

        silent = self.view.counts(time.monotonic())["silent"] if self.view else \
            max([int(self.summary_of(ch).get("silent") or 0) for ch in self.channels.values()], default=0)
        if silent:
            until = time.monotonic() + max(SUSPECT_GRACE, 2 * self.heartbeat)
            for crew in self.arbiter.crews.values():      # the arbiter's loop writes the ledgers
                self.arbiter.post(functools.partial(crew.ledger.hold_suspects, until))

    def status(self) -> dict:
        """`poller` and `is_poller` are about the first pool's consumer; `polls`, every consumer
        whose poller we are. The poller counts everybody but itself as ok/silent/lost; so does
        each member (it is one of the poller's peers, and the poller one of its own): peers =
        the poller's "ok"."""
        lead = self.channel(self.lead.cfg.consumer.name)
        summary = self.summary_of(lead)
        return {"name": self.name, "key": self.key, "bucket": self.cfg.fleet.bucket,
                "peers": summary.get("ok") if summary else None,
                "lost": summary.get("lost") if summary else None,
                "poller": summary.get("poller") if summary else None, "is_poller": bool(lead and lead.polled),
                "polls": sorted(self.polled()),
                "error": self.problem or None, "beats": self.beats, "release_lost": self.cfg.fleet.release_lost,
                "released_jobs": self.released,
                "release_risk": RELEASE_RISK if self.cfg.fleet.release_lost else
                "none: a lost host's jobs wait for AckWait (fleet.release_lost = false)"}

    async def close(self) -> None:
        """A clean stop leaves the fleet: our entry goes (not `lost`), and our leases are freed."""
        await self.stop_watch()
        if self.records is not None:
            self.records.cancel()
        if self.kv is None:
            return
        try:
            await self.kv.purge(self.key)
            for ch in self.channels.values():
                if ch.polled:
                    await self.kv.delete(lease_key(self.cfg.stream.name, ch.consumer), last=ch.lease_rev)
        except Exception as exc:
            log.warning("leaving the fleet view: %s", exc)
