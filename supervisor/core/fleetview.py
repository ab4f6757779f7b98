"""The fleet seen from one supervisor, as pure decisions with the time passed in: which peers
are ok or lost (FleetView), when a fleet without a poller polls ConsumerInfo itself (Fallback),
and which of a lost peer's jobs may be NAKed now (plan_release). The task that feeds them is
supervisor/parent/tasks/fleet.py, whose docstring tells the whole story."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from supervisor.config import Config
from supervisor.core.policy import ack_wait_for

BEAT_PREFIX = "sup."
LEASE_PREFIX = "poller."
LOST_AFTER = 3              # missed heartbeats before a peer is lost (docs/CONTRACT.md)
RELEASE_MARGIN = 2.0        # seconds of AckWait that must be left to release a job (and 20 % of it)
WINDOW_SLACK = 2.0          # seconds around the AckWait window of a lost peer's unlisted jobs
FALLBACK_POLLS = 10         # ConsumerInfo requests per interval a whole fleet makes while it has no poller


def beat_key(name: str, pid: int, run: str) -> str:
    """Stable for one run, unique across hosts and restarts; KV keys allow [-/_=.a-zA-Z0-9]."""
    safe = re.sub(r"[^-_=a-zA-Z0-9]+", "_", name).strip("_") or "supervisor"
    return f"{BEAT_PREFIX}{safe}.{pid}.{run}"


def ack_wait_range(cfg: Config) -> tuple[float, float]:
    """The shortest and longest AckWait any delivery gets (consumer.backoff sets one per delivery)."""
    c = cfg.consumer
    waits = [ack_wait_for(c.ack_wait, c.backoff, d) for d in range(1, 1 + max(1, len(c.backoff)))]
    return min(waits), max(waits)


def lease_key(stream: str, consumer: str) -> str:
    """The poller lease of one consumer: each consumer has a poller of its own, elected among the
    supervisors that run a pool on it (a lost host's jobs are released by one that runs their
    consumer: its ledger, its AckWait, the redeliveries its peers report)."""
    def safe(name: str) -> str:
        return re.sub(r"[^-_=a-zA-Z0-9]+", "_", name) or "_"
    return f"{LEASE_PREFIX}{safe(stream)}.{safe(consumer)}"


def consumers_of(beat: dict) -> dict[str, dict]:
    """The consumers a heartbeat's supervisor runs pools on, each with what it says of it
    (`capacity`, `held`, `acked`, `busy`; empty from a beat older than per-consumer numbers: a
    plain list, or only its first pool's `consumer`). {} from a beat that names none."""
    named = beat.get("consumers")
    if isinstance(named, dict):
        return {str(k): v if isinstance(v, dict) else {} for k, v in named.items()}
    if isinstance(named, list):
        return {str(k): {} for k in named}
    return {str(beat["consumer"]): {}} if beat.get("consumer") else {}


def job_consumer(job: list, beat: dict) -> str:
    """The consumer a held job of a heartbeat was delivered on: its reply subject's, else the
    beat's first pool's, else "" (unknown)."""
    reply = str(job[3]) if len(job) > 3 and job[3] else ""
    return reply_consumer(reply) or str(beat.get("consumer") or "")


def lease_ttl(heartbeat: float) -> int:
    """Whole seconds (the server's per-message TTL granularity), never under 1."""
    return max(1, math.ceil(LOST_AFTER * heartbeat))


# ================================================================ the view (pure)

@dataclass
class Peer:
    key: str
    beat: dict
    server_t: float          # when the server stored this beat (seconds since the epoch)
    rev: int
    # The consumers whose pollers have acted on its loss (the lost mark in its entry); None: not
    # marked; ALL: marked by a poller of one lease per fleet (older), which acted for everyone.
    handled: frozenset[str] | None = None

    @property
    def marked(self) -> bool:
        return self.handled is not None

    @property
    def heartbeat(self) -> float:
        return float(self.beat.get("heartbeat") or 2.0)

    @property
    def name(self) -> str:
        return str(self.beat.get("name") or self.key)


ALL: frozenset[str] = frozenset({"*"})


def handled_by(mark: dict) -> frozenset[str]:
    """The consumers a lost mark says have been acted on."""
    named = mark.get("consumers")
    return frozenset(map(str, named)) if isinstance(named, list) else ALL


class FleetView:
    """What the poller knows of the fleet, from the heartbeats its watch delivers.

    Pure: every time is passed in (`now`, local monotonic). The server's clock is read off our
    own heartbeats as they come back: `server_now` is the server time of our newest echo plus
    the local time since. With no echo for 2 heartbeats the channel is down and `server_now` is
    None, so no age is measured and nobody turns lost. `ok_since` restarts when the channel
    comes back, and a peer's silence only counts from then. A new poller starts with
    `channel_since`, the local time since which its own heartbeat puts have all succeeded (the
    bucket worked for everybody then too), so a poller taking over from a dead one need not wait
    another 3 heartbeats before it can tell the dead one is lost.
    """

    def __init__(self, own_key: str, heartbeat: float, channel_since: float | None = None):
        self.own_key = own_key
        self.heartbeat = heartbeat
        self.channel_since = channel_since
        self.peers: dict[str, Peer] = {}
        self._echo: tuple[float, float] | None = None   # (server time, local time) of our newest echo
        self.ok_since: float | None = None               # server time the channel last came back

    def saw(self, key: str, beat: dict, server_t: float, rev: int, now: float) -> None:
        if key == self.own_key:
            if self._echo is None and self.channel_since is not None:
                self.ok_since = server_t - max(0.0, now - self.channel_since)
            elif self._echo is None or now - self._echo[1] > self.stale_after:
                self.ok_since = server_t
            self._echo = (server_t, now)
            return
        mark = beat.get("lost")
        if mark:                   # a poller's mark: last seen when the marked beat was stored, not now
            server_t = float(mark.get("server_t", server_t))
        self.peers[key] = Peer(key, beat, server_t, rev, handled_by(mark) if mark else None)

    def gone(self, key: str) -> None:
        """The key was deleted: a clean stop."""
        self.peers.pop(key, None)

    @property
    def stale_after(self) -> float:
        return 2 * self.heartbeat + 0.5

    def server_now(self, now: float) -> float | None:
        if self._echo is None or now - self._echo[1] > self.stale_after:
            return None
        return self._echo[0] + (now - self._echo[1])

    def age(self, peer: Peer, now: float) -> float | None:
        s = self.server_now(now)
        return None if s is None else max(0.0, s - peer.server_t)

    def state(self, peer: Peer, now: float) -> str:
        """ok | silent (missed a beat) | lost; `unknown` while our own channel is down."""
        if peer.marked:
            return "lost"
        s = self.server_now(now)
        if s is None:
            return "unknown"
        counted = s - max(peer.server_t, self.ok_since or s)
        if counted > LOST_AFTER * peer.heartbeat:
            return "lost"
        return "silent" if s - peer.server_t > 1.5 * peer.heartbeat else "ok"

    def due_lost(self, now: float, consumers: Iterable[str] | None = None) -> list[Peer]:
        """Lost, with jobs on one of `consumers` (those we poll) no poller has acted on yet: ours
        to handle. `consumers` None: any peer not yet marked."""
        mine = None if consumers is None else frozenset(consumers)
        return [p for p in self.peers.values() if self.state(p, now) == "lost" and self.todo(p, mine)]

    @staticmethod
    def todo(peer: Peer, mine: frozenset[str] | None) -> frozenset[str]:
        """The consumers of `mine` on which the lost peer's jobs are still to be acted on. A beat
        that names no consumer (older than pools) is taken to run ours."""
        if mine is None:
            return ALL if peer.handled is None else frozenset()
        if peer.handled == ALL:
            return frozenset()
        theirs = frozenset(consumers_of(peer.beat)) or mine
        return (theirs & mine) - (peer.handled or frozenset())

    def counts(self, now: float) -> dict[str, int]:
        out = {"ok": 0, "silent": 0, "lost": 0, "unknown": 0}
        for p in self.peers.values():
            out[self.state(p, now)] += 1
        return out

    def progress(self, now: float, consumer: str | None = None) -> tuple[int, bool]:
        """(the sum of the peers' ack counters, whether any peer's worker is busy on a long job).
        `consumer`: that consumer's numbers of each peer that runs it (a beat has them per
        consumer since pools; an older one only for its first pool's `consumer`, or for the one
        consumer it does not name)."""
        acked, busy = 0, False
        for p in self.peers.values():
            if self.state(p, now) == "lost":
                continue
            entry = consumers_of(p.beat).get(consumer or "") if consumer else None
            if entry and "acked" in entry:
                acked, busy = acked + int(entry.get("acked") or 0), busy or bool(entry.get("busy"))
            elif consumer is None or p.beat.get("consumer") in (None, consumer):
                acked, busy = acked + int(p.beat.get("acked") or 0), busy or bool(p.beat.get("busy"))
        return acked, busy

    def held_by_live(self, now: float) -> dict[tuple[str, int], int]:
        """(consumer, seq) -> highest delivery any not-lost peer listed in its last heartbeat. A
        sequence is one message of the stream, but each consumer of a fan-out (pools whose
        filters overlap off a work queue) delivers it on its own: only the same consumer's
        delivery stops a release ("" : a job whose consumer its beat does not say)."""
        out: dict[tuple[str, int], int] = {}
        for p in self.peers.values():
            if self.state(p, now) != "lost":
                for job in p.beat.get("held", ()):
                    key = (job_consumer(job, p.beat), job[0])
                    out[key] = max(out.get(key, 0), job[1])
        return out


class Fallback:
    """When a member asks for ConsumerInfo itself: only while the poller's samples have stopped
    (it died; its lease has not expired yet), and then each member once per
    interval * max(1, peers / FALLBACK_POLLS), from a random phase. A small fleet keeps its lag
    readings through a failover; a big one does not send every host at the consumer leader at
    once (`python -m bench.fleet_sim`: 1000 hosts would be 1000 requests in one second)."""

    def __init__(self, rng: Callable[[], float] = random.random):
        self.rng = rng
        self.next: float | None = None

    def due(self, now: float, interval: float, peers: int) -> bool:
        period = interval * max(1.0, peers / FALLBACK_POLLS)
        if self.next is None:
            self.next = now + self.rng() * period
        if now < self.next:
            return False
        self.next = max(self.next + period, now)
        return True

    def reset(self) -> None:
        self.next = None


# ================================================================ a lost peer's jobs (pure)

@dataclass
class Release:
    nak: list[tuple[int, int, str]] = field(default_factory=list)         # (seq, delivery, reply)
    skipped: list[tuple[int, int, str]] = field(default_factory=list)     # (seq, delivery, why)


def plan_release(held: Iterable[list], since_beat: float, ack_wait_for: Callable[[int], float],
                 later_delivery: Callable[[int], int]) -> Release:
    """Which of a lost peer's held jobs may be NAKed now.

    `held`: [seq, delivery, timer age at its beat, reply, state] from its last heartbeat;
    `since_beat`: seconds since that beat (server time); `later_delivery(seq)`: the highest
    delivery of `seq` seen anywhere else (0: none). A job qualifies when it has not been seen
    at a later delivery and its AckWait has more than max(RELEASE_MARGIN, 20 %) left. One whose
    ack was already sent at the beat is left alone: the ack almost surely arrived in the seconds
    since (a NAK would be a no-op), and if it did not, AckWait brings it back.
    """
    out = Release()
    for seq, delivery, age, reply, state in held:
        ack_wait = ack_wait_for(delivery)
        left = ack_wait - (age + since_beat)
        if state == "acked":
            out.skipped.append((seq, delivery, "acked before the last heartbeat"))
        elif later_delivery(seq) > delivery:
            out.skipped.append((seq, delivery, f"seen again at delivery {later_delivery(seq)}"))
        elif left <= max(RELEASE_MARGIN, 0.2 * ack_wait):
            out.skipped.append((seq, delivery, f"AckWait nearly out ({max(left, 0.0):.1f}s left)"))
        elif not reply:
            out.skipped.append((seq, delivery, "no reply subject"))
        else:
            out.nak.append((seq, delivery, reply))
    return out


def reply_consumer(reply: str) -> str | None:
    """The consumer a `$JS.ACK` reply subject belongs to (a held job's, in a heartbeat): tokens
    `$JS.ACK.<stream>.<consumer>.<7 numbers>`, or with a domain and account hash before the
    stream (12 tokens and more); None for anything else."""
    tokens = reply.split(".")
    if tokens[:2] != ["$JS", "ACK"]:
        return None
    if len(tokens) == 9:
        return tokens[3]
    return tokens[5] if len(tokens) >= 12 else None


def unlisted_budget(beat: dict, consumer: str, listed: int) -> int:
    """At most how many jobs the lost peer took on `consumer` after its last heartbeat (or could
    not list in it): its capacity on that consumer less the jobs listed there, or the jobs it
    held there but did not list. A beat without per-consumer numbers (older) gives its whole
    capacity less every listed job: the most any one consumer can have had."""
    entry = consumers_of(beat).get(consumer) or {}
    if "capacity" in entry:
        cap, total = int(entry.get("capacity") or 0), int(entry.get("held") or 0)
    else:
        cap, total = int(beat.get("capacity") or 0), int(beat.get("held_total") or 0)
        listed = len(beat.get("held") or ())
    return max(0, cap - listed, total - listed)


def unlisted_window(since_beat: float, ack_waits: tuple[float, float]) -> tuple[float, float]:
    """When jobs the lost peer took after its last beat come back, as (start, end) seconds from
    now: their AckWait timers started between that beat and its death. Its death is only known
    to be before now: a heartbeat can be late (a KV leader election stalls the put), so "one
    heartbeat after the last" is no bound."""
    low, high = ack_waits
    return low - since_beat - WINDOW_SLACK, high + WINDOW_SLACK
