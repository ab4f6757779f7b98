"""Messages in transit to a worker when it died: found and NAKed within a second (issue 9, point 11).

A worker that dies with pull credits outstanding may have been sent messages it never read:
they are in no slot table, and the server would redeliver them only after AckWait. In a
work-queue stream every message still stored is unacked, so after such a death the parent can
list the lost ones: a stored message the consumer has delivered, that no worker of ours holds
and that the ledger does not already expect back (a NAK we know of: a dead worker's held job, a
handler's Retry with its delay), went to a process that is gone. A NAK brings it back at once.
NAKs match by stream sequence, so the NAK's reply subject can be built from the sequence alone.

That same fact makes a wrong NAK the one thing this check must never send: the server NAKs
whoever holds the sequence now (nats-server processNak checks only that it is pending), so a NAK
of a live holder's delivery runs the job twice. Every NAK here is sent only with proof that no
live process can hold that delivery; without the proof the job comes back after AckWait, and the
ledger explains it as in transit (`in_transit_redeliveries`). The proof, piece by piece:
 - the stream is a work queue (elsewhere an acked message stays stored: no way to tell) and the
   consumer has one replica (R>1: a delivery counted in ConsumerInfo may wait for its raft commit
   for as long as a slow follower takes, so no wait proves it reached its worker);
 - no other supervisor can hold a delivery (Peers.alone(): one heard in this run counts until it
   says goodbye, and our own hellos must come back to us, or we could not hear one);
 - a ConsumerInfo read after every death of the round bounds the scan from above; every live
   worker (STARTING ones hold nothing: they have no subscription yet) proved, with a PING it SENT
   after that read (plus SLACK for the server's internal delivery queue), that it has read and
   recorded every message the server sent it before (TCP keeps the server's writes in order);
 - a ConsumerInfo read before each dead worker's own last such proof (or answered before its
   fork: it had no request out) bounds the scan from below:
   every first delivery up to it reached the dead worker before the proof, so it was read; what
   is older (a previous run's Retry with a delay, a delivery pending since before we started, a
   lost ack, a silent peer's job) is never a candidate (R12);
 - that lower reading's time starts every candidate's AckWait: the NAK goes out well before any
   of them can expire and be redelivered to a live worker (policy.nak_is_safe);
 - right before the NAKs, with no await between: the tables are read again and every event the
   workers wrote is applied (a worker's NAK is announced before its table entry is freed), and a
   sequence any worker named since that lower reading is left alone;
 - the candidates are no more than the credits the dead workers had outstanding.
A consumer outside any supervisor bound to the same durable would have its jobs NAKed by
this; the README says the consumer belongs to the supervisors.

A redelivery can be on the wire to a dead worker too: a worker NAKs a job (a handler's Retry or
failure, a drain), and the server hands the next delivery to a pull request of a worker that
then dies before reading it (F1). Its sequence is below any lower bound, and the ledger expects
it back from that NAK, so the scan above never sees it. `WorkerNaks` keeps each worker NAK
until a worker names a later delivery of the job, and NAKs it again only with its own proof:
 - a worker with pull credits died after the NAK (the redelivery may be on its wire);
 - the server had read the NAK: a table read after the parent learnt of it found the job in no
   table (a worker frees the entry only once a fence proved the server read the NAK), or the
   server's MSG_NAKED advisory for it came (sent from inside processNak: monitor.py on_naked);
 - its redelivery has left the server's queue: a ConsumerInfo asked SLACK plus the NAK's delay
   after that shows a pull request waiting (the server hands redeliveries to waiting requests
   before anything else, max_ack_pending or not), and every live worker's PING sent SLACK
   after that reading was answered (so none of them holds it unread);
 - the last look finds it in no table and named by no worker since, and the redelivery's
   AckWait, which cannot have started before the NAK went out plus its delay (nor after this
   delivery's own AckWait ran out), is far from over (nak_is_safe);
 - and the same gates as the scan: a work queue, one replica, no peer, connected.
An orphan's NAK (its parent dead, it announces its NAKs itself: workers/runtime/orphan.py) can
be redelivered to one of our workers that then dies, as after a parent's SIGKILL and a new
supervisor's start (F9). One on this host says when it sent the NAK, with what delay and since
when it held the delivery, on the host's monotonic clock, so the NAK is kept as a worker's is.
Our tables cannot show the server read it (the orphan's are not ours): its goodbye does, when
it says every NAK it sent was fenced (it comes after them, and the orphan holds nothing after
it: a peer gone), or the advisory does; the rest of the proof is the same.
A NAK whose worker died before its fence came back, its entry still in the dead table (F18), may
still be unread in the dead socket: NAKed first by us, its redelivery could go to a live worker
and the late NAK send that live delivery away (a duplicate). No table read can show it read (the
dead table is no longer read), so `WorkerNaks.died` keeps it only for the advisory of that very
delivery (stream seq, delivery, consumer seq), in whichever order advisory, worker event and
death come; without it the job waits for AckWait, named at the death (F10, ledger NAK_UNSENT).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nats.js.errors import NotFoundError

from supervisor.config import Config
from supervisor.config.schedules import job_subjects
from supervisor.core.ledger import FOUND_IN_TRANSIT
from supervisor.core.policy import ack_wait_for, nak_is_safe
from workers.protocol import slots

log = logging.getLogger("supervisor")

SLACK = 0.25            # after a ConsumerInfo, before a worker's PING counts as proof
GIVE_UP = 5.0           # workers that cannot prove it within this long: leave it to AckWait
MAX_SCAN = 2000         # stored messages of the pool looked at, at most, per reconciliation
SAMPLES = 4096          # ConsumerInfo readings kept for the lower bound, at most (keep: as old as an AckWait)
NAMED_LIMIT = 10_000    # sequences recently named by a worker's event, remembered
NOT_CONNECTED = "not connected to NATS"
CANNOT_READ = "cannot read seq "
PASSING = (NOT_CONNECTED,)  # obstacles a later tick may be past: the round waits (F6)
MAX_FAILURES = 3        # NATS failing the round this often ends it


@dataclass(frozen=True)
class Reading:
    """A ConsumerInfo answer: it describes a moment between `asked` and `answered`."""
    asked: float
    answered: float
    delivered: int              # delivered stream sequence
    waiting: int = 0            # pull requests waiting
    consumer_seq: int = 0       # delivered consumer sequence (a NAK's reply subject needs one in range)


@dataclass(frozen=True)
class Loss:
    """A death with pull credits outstanding: what may have been on the wire to it."""
    t: float
    credits: int
    who: str
    read_before: float          # the dead worker's last proof: it read everything sent before this
    pid: int = 0
    slot: int = -1
    born: float = 0.0           # before its fork (the parent's clock): no request of its was out yet


@dataclass
class WorkerNak:
    """A worker's NAK of `delivery`; no worker has named a later delivery of the job yet."""
    delivery: int
    earliest: float             # the redelivery's AckWait cannot have started before this
    delay: float                # the server holds the job back this long after reading the NAK
    learnt: float               # when the parent applied the worker's event
    read_by: float | None = None    # the server had surely read the NAK by then
    dead: str = ""              # a worker with credits that died after the NAK: the redelivery may be on its wire
    by: str = ""                # an orphan's origin (F9): read by the server once its fenced goodbye came
    # Its worker died before the NAK's fence came back, the entry still in its table (F18): only
    # the server's MSG_NAKED advisory for that very delivery (`cseq`) shows the NAK was read.
    in_table: bool = False
    cseq: int = 0

    @property
    def unproven(self) -> bool:
        """Held at its worker's death with no advisory (yet): left to AckWait, as the death says (F10)."""
        return self.in_table and self.read_by is None


@dataclass
class WorkerNaks:
    """The workers' NAKs whose redelivery no worker has named yet (see the module's docstring)."""
    naks: dict[int, WorkerNak] = field(default_factory=dict)
    latest: dict[int, int] = field(default_factory=dict)    # seq -> the highest delivery a worker named
    advised: dict[int, tuple[int, int, float]] = field(default_factory=dict)  # seq -> MSG_NAKED's (delivery, cseq, when)

    def named(self, seq: int, delivery: int) -> None:
        if delivery > self.latest.get(seq, 0):
            newest(self.latest, seq, delivery)
        n = self.naks.get(seq)
        if n is not None and delivery > n.delivery:
            del self.naks[seq]                  # its redelivery reached a worker that said so

    def sent(self, seq: int, nak: WorkerNak) -> None:
        if self.latest.get(seq, 0) > nak.delivery:
            return                              # a later delivery was named first (R4b's order)
        if (known := self.naks.get(seq)) is not None and known.delivery == nak.delivery:
            return                              # said again (an orphan's goodbye): what we know of it stays
        newest(self.naks, seq, nak)
        if (a := self.advised.get(seq)) is not None and a[0] == nak.delivery:
            nak.read_by = a[2]                  # the server's advisory came before the worker's event

    def advisory(self, seq: int, delivery: int, cseq: int, t: float) -> bool:
        """The server's MSG_NAKED advisory: by `t` it had processed a NAK of `seq` at `delivery`
        (consumer sequence `cseq`). True when it proves a NAK its dead worker's table held (F18)."""
        newest(self.advised, seq, (delivery, cseq, t))
        n = self.naks.get(seq)
        if n is None or n.read_by is not None or n.delivery != delivery or (n.in_table and n.cseq != cseq):
            return False
        n.read_by = t
        return n.in_table

    def died(self, who: str, credits: int, held: dict[int, tuple[int, int]]) -> list[int]:
        """A worker died; `held`: seq -> (delivery, consumer seq) of each entry its table still held.
        A NAK so held may still be in its socket: only the server's advisory for that delivery
        can show it was read (F18), so it is kept for that and dropped if its delivery is not
        the one held (the death explains the job, F10). Every NAK's redelivery may be on the
        dead worker's wire, if it asked. Returns the held NAKs the advisory has proven read."""
        proven = []
        for seq in held.keys() & self.naks.keys():
            n, (delivery, cseq) = self.naks[seq], held[seq]
            if n.delivery != delivery:
                del self.naks[seq]
                continue
            a = self.advised.get(seq)
            n.in_table, n.cseq = True, cseq
            n.read_by = a[2] if a is not None and a[:2] == (delivery, cseq) else None   # its table's word is gone
            if n.read_by is not None:
                proven.append(seq)
        if credits > 0:
            for n in self.naks.values():
                n.dead = n.dead or who
        return proven

    def read_in(self, held: set[int], before: float, after: float) -> None:
        """Tables read between `before` and `after` found these NAKs' jobs in none: the server had
        read them (not a dead worker's: its table is no longer read)."""
        for seq, n in self.naks.items():
            if n.read_by is None and not n.by and not n.in_table and n.learnt < before and seq not in held:
                n.read_by = after

    def orphan_gone(self, origin: str, now: float) -> None:
        """The orphan `origin` said goodbye with every NAK it sent fenced: the server had read them."""
        for n in self.naks.values():
            if n.by == origin and n.read_by is None:
                n.read_by = now

    def provable(self, waiting_since: Callable[[float], Reading | None],
                 links_fresh_since: Callable[[float], bool]) -> list[int]:
        """The jobs whose redelivery has left the server's queue while no live worker can hold it unread."""
        due = []
        for seq, n in self.naks.items():
            if not n.dead or n.read_by is None:
                continue
            reading = waiting_since(n.read_by + SLACK + n.delay)
            if reading is not None and links_fresh_since(reading.answered + SLACK):
                due.append(seq)
        return due


def newest(d: dict, key: Any, value: Any) -> None:
    """Set `key` as the newest entry of `d`, keeping the NAMED_LIMIT newest (insertion order)."""
    d.pop(key, None)
    d[key] = value
    while len(d) > NAMED_LIMIT:
        del d[next(iter(d))]


def settled_once(entries: list[slots.Entry]) -> dict[int, tuple[int, int]]:
    """seq -> (delivery, consumer seq) of a dead (or exited) worker's entries, for WorkerNaks.died.
    A NAK it published and had not fenced is the one SETTLED entry of its seq. A seq it held twice
    (the NAK's redelivery read into another entry, its event to us lost with the worker) or in
    another state gets (0, 0), which matches no NAK: the table shows nothing about which of its
    deliveries a settle in the socket may name, so no advisory may prove it."""
    held: dict[int, tuple[int, int]] = {}
    for e in entries:
        once = e.stream_seq not in held and e.state == slots.SETTLED
        held[e.stream_seq] = (e.delivery, e.consumer_seq) if once else (0, 0)
    return held


@dataclass
class InTransit:
    """The in-transit check of one pool (the module's docstring). Long because the round's gates,
    the scan for first deliveries and the redeliveries' proof read one state (the losses, the
    ConsumerInfo readings, the failures, the sequences workers named), and act on it with no
    await between the last look and the NAKs: split, each part would need the others' state."""
    cfg: Config
    nc: Any
    ledger: Any
    losses: list[Loss] = field(default_factory=list)    # deaths since the last reconciliation
    info: Any = None                        # the ConsumerInfo the scan is bounded by ...
    info_at: Reading | None = None          # ... and when we had it
    readings: deque = field(default_factory=lambda: deque(maxlen=SAMPLES))
    named: dict[int, float] = field(default_factory=dict)   # seq -> last time a worker's event named it
    stats: dict = field(default_factory=lambda: {"runs": 0, "naked": 0, "skipped": 0, "last_skipped": "",
                                                 "redeliveries_naked": 0, "waiting": ""})
    is_replicated: bool = False             # the last ConsumerInfo listed replicas
    waiting: str = ""                       # why the round waits (a passing obstacle), said once ...
    blocked: str = ""                       # ... and what held it at its last tick ("": it went on)
    failed_at: float = 0.0                  # when NATS last failed the round ...
    last_failure: str = ""                  # ... and how, and how many times this round
    failures: int = 0
    worker_naks: WorkerNaks = field(default_factory=WorkerNaks)

    # ------------------------------------------------------------ inputs

    def death(self, t: float, credits: int, who: str, read_before: float,
              held: dict[int, tuple[int, int]] | None = None, pid: int = 0, slot: int = -1, born: float = 0.0) -> None:
        """`held`: seq -> (delivery, consumer seq) of each entry in the dead worker's table;
        `born`: a moment before its fork."""
        for seq in self.worker_naks.died(who, credits, held or {}):
            self.ledger.nak_read(seq, self.worker_naks.naks[seq].delivery)     # before the death is recorded
        if credits > 0:
            self.losses.append(Loss(t, credits, who, read_before, pid, slot, born))

    def worker_nak(self, seq: int, delivery: int, at: float, delay: float, held_at: float, now: float,
                   by: str = "") -> None:
        """A worker NAKed `seq` at `delivery`, at `at` (its clock) with `delay` (events.Settled);
        `by`: an orphan on this host (its announcement: peers.py)."""
        if at > 0:
            c = self.cfg.consumer
            earliest = min(at + delay, held_at + ack_wait_for(c.ack_wait, c.backoff, delivery))
            self.worker_naks.sent(seq, WorkerNak(delivery, earliest, delay, now, by=by))

    def nak_advised(self, seq: int, delivery: int, cseq: int, t: float) -> None:
        """The server's MSG_NAKED advisory (the monitor's subscription), received at `t`."""
        if self.worker_naks.advisory(seq, delivery, cseq, t):
            self.ledger.nak_read(seq, delivery)     # after the death: its waits change

    def naks_read(self, origin: str, now: float) -> None:
        """An orphan said goodbye, every NAK it sent read by the server (peers.py)."""
        self.worker_naks.orphan_gone(origin, now)

    def observed(self, asked: float, answered: float, delivered_stream_seq: int, waiting: int = 0,
                 consumer_seq: int = 0, paused: bool = False) -> None:
        """A ConsumerInfo reading (the monitor's polls, ours): lower bounds for later deaths. A
        paused consumer (workers.Pause, `supervisor pause`) keeps pull requests waiting and hands
        nothing out, so its waiting requests prove no delivery (waiting_since): counted as none."""
        self.keep(Reading(asked, answered, delivered_stream_seq, 0 if paused else waiting, consumer_seq))

    def keep(self, reading: Reading) -> None:
        """A reading for the lower bound of later deaths, kept while it can bound a safe NAK: as
        long as the shortest AckWait (nak_is_safe), not a count. A worker dies, or exits with a
        request its deadline gave up (F20), long after its last proof when a stall of its link
        came first, and 64 readings were 6 s of a busy monitor's polls: no lower bound was left."""
        self.readings.append(reading)
        oldest = reading.answered - self.min_ack_wait()
        while self.readings[0].answered < oldest:
            self.readings.popleft()

    def waiting_since(self, t: float) -> Reading | None:
        """The first reading asked after `t` with a pull request waiting: a job NAKed before `t`
        cannot still sit in the redelivery queue then (the server hands it to a waiting request
        first), so it had been delivered by that reading's moment."""
        return next((r for r in self.readings if r.asked >= t and r.waiting > 0), None)

    def named_by_worker(self, seq: int, now: float, delivery: int = 0) -> None:
        """A live worker received, settled or could not settle `seq`: its delivery may be a live one."""
        self.worker_naks.named(seq, delivery)
        newest(self.named, seq, now)

    # ------------------------------------------------------------ the round

    @property
    def credits(self) -> int:
        return sum(loss.credits for loss in self.losses)

    async def step(self, now: float, fresh_view: Callable[[], set[int]],
                   links_fresh_since: Callable[[float], bool], alone: bool | None, heard_self_at: float = 0.0) -> None:
        """`fresh_view` applies every event the workers wrote and returns the sequences in any
        table, read before those events were applied. `heard_self_at`: when our own last hello
        came back (peers.py): our link carried a message both ways then."""
        if alone and not self.unsafe_here(alone) and not self.replicated():
            await self.nak_redeliveries(fresh_view, links_fresh_since)
        if not self.losses:
            return
        self.expire(now)
        if not self.losses:
            return
        self.blocked = ""
        why = self.unsafe_here(alone)
        if why and why not in PASSING:
            self.done("skipped", why)       # not provably safe here: AckWait it is
            return
        if alone is None and not why:
            why = "cannot tell yet whether another supervisor shares the consumer (just started, or our own " \
                  "hellos have not come back lately)"
        if self.failed_at and heard_self_at <= self.failed_at and not why:
            why = self.last_failure
        if why:
            # A passing obstacle (F6): peers may still say hello, our link is down or stalled; the
            # losses stay for a later tick while their lower bound still makes a NAK safe (expire).
            self.wait(why)
            return
        if self.info_at is None or any(loss.t >= self.info_at.asked for loss in self.losses):
            await self.read_consumer()      # a death after the reading: what it had is beyond it (R5)
            return
        if self.replicated():
            self.done("skipped", "the consumer is replicated (a delivery may wait for its raft commit)")
            return
        if not links_fresh_since(self.info_at.answered + SLACK):
            if now - self.info_at.answered > GIVE_UP:
                self.done("skipped", f"a worker could not prove within {GIVE_UP:g}s what it holds")
            return
        await self.nak_lost(fresh_view)

    def expire(self, now: float) -> None:
        """Losses no later round can prove safe: their lower bound is so old that a candidate's
        AckWait may be running out (one with no lower bound at all is nak_lost's to skip)."""
        for loss in list(self.losses):
            low = self.floor([loss])
            if low is not None and not nak_is_safe(now, low.asked, self.min_ack_wait()):
                self.done("skipped", "too late: a candidate's AckWait may be running out"
                          + (f" (waited for: {self.waiting})" if self.waiting else ""), [loss])

    def wait(self, why: str) -> None:
        """A passing obstacle: the round goes on at a later tick. Said once per reason."""
        self.blocked = why
        if why != self.waiting:
            self.waiting = why
            self.stats["waiting"] = why
            log.info("in-transit check waiting: %s (what was on the wire to %s stays a candidate)", why,
                     ", ".join(loss.who for loss in self.losses), extra={"event": "in_transit_waiting", "why": why})

    def failed(self, why: str) -> None:
        """NATS failed the round (ConsumerInfo, a stream read): try again once our own hello has
        come back since, which proves the link carries messages both ways again; up to
        MAX_FAILURES times (each try may hold the loop for its timeout)."""
        self.failures += 1
        if self.failures >= MAX_FAILURES:
            self.done("skipped", f"{why} ({self.failures} times)")
            return
        self.failed_at, self.last_failure = time.monotonic(), why
        self.info, self.info_at = None, None
        self.wait(why)

    def unsafe_here(self, alone: bool | None) -> str:
        if self.cfg.stream.retention != "workqueue":
            return "the stream is not a work queue"
        if alone is False:
            return "another supervisor may hold deliveries of this consumer"
        if not self.nc.is_connected:
            return NOT_CONNECTED
        return ""

    def replicated(self) -> bool:
        """The last ConsumerInfo named replicas (also asked by Deaths.renak_unseen), or the config asks for them."""
        return self.is_replicated or self.cfg.stream.replicas > 1

    async def read_consumer(self) -> None:
        asked = time.monotonic()
        try:
            self.info = await self.nc.jetstream().consumer_info(self.cfg.stream.name, self.cfg.consumer.name,
                                                                 timeout=2.0)
        except Exception as exc:
            self.failed(f"ConsumerInfo failed: {str(exc) or type(exc).__name__}")
            return
        self.info_at = Reading(asked, time.monotonic(), self.info.delivered.stream_seq, self.info.num_waiting or 0,
                               self.info.delivered.consumer_seq)
        self.keep(self.info_at)
        cluster = getattr(self.info, "cluster", None)
        self.is_replicated = bool(cluster and getattr(cluster, "replicas", None))

    def floor(self, losses: list[Loss]) -> Reading | None:
        """The newest reading every dead worker surely read past: its proof came SLACK after it,
        or it was answered before the worker was forked (nothing it counts went to a worker with
        no request out yet). The latter bounds a death in a supervisor's first moments, whose
        only reading is the one it took at its start (seed 1028: a worker killed 0.09 s after it
        was ready, 0.25 s after that reading, left what was on its wire to AckWait)."""
        bounds = []
        for loss in losses:
            before = [r for r in self.readings if r.answered + SLACK < loss.read_before or r.answered < loss.born]
            if not before:
                return None
            bounds.append(max(before, key=lambda r: r.delivered))
        return min(bounds, key=lambda r: r.delivered)

    def min_ack_wait(self) -> float:
        """The shortest AckWait any delivery gets (consumer.backoff replaces AckWait when set)."""
        c = self.cfg.consumer
        return min(ack_wait_for(c.ack_wait, c.backoff, d) for d in range(1, len(c.backoff) + 2))

    async def nak_lost(self, fresh_view: Callable[[], set[int]]) -> None:
        losses, credits = list(self.losses), self.credits
        low = self.floor(losses)
        if low is None:
            self.done("skipped", "no ConsumerInfo from before the dead worker's last answer from NATS", losses)
            return
        stored = await self.stored_in(low.delivered + 1, self.info.delivered.stream_seq)
        if isinstance(stored, str):
            if stored.startswith(CANNOT_READ):
                self.failed(stored)         # NATS, not the range: try again
            else:
                self.done("skipped", stored, losses)
            return
        # From here to the last NAK nothing awaits: what we read is what the NAKs act on.
        held = fresh_view()
        if not nak_is_safe(time.monotonic(), low.asked, self.min_ack_wait()):
            self.done("skipped", "too late: a candidate's AckWait may be running out", losses)
            return
        lost = [seq for seq in stored if seq not in held and not self.ledger.expecting(seq)
                and self.named.get(seq, float("-inf")) < low.asked]
        if len(lost) > credits:
            self.done("skipped", f"{len(lost)} unaccounted message(s), more than the {credits} the dead "
                                 "worker(s) asked for", losses)
            return
        await self.send_naks(lost, losses)
        self.done("runs", "", losses)

    async def nak_redeliveries(self, fresh_view: Callable[[], set[int]],
                               links_fresh_since: Callable[[float], bool]) -> None:
        """Redeliveries of workers' NAKs on the wire to a worker that died (the module's docstring)."""
        naks, ack_wait = self.worker_naks, self.min_ack_wait()
        for seq, n in [(seq, n) for seq, n in naks.naks.items() if n.dead]:
            if not nak_is_safe(time.monotonic(), n.earliest, ack_wait):
                del naks.naks[seq]
                if not n.unproven:              # an unproven one was named at its death (F10)
                    self.skip_redelivery(seq, n)
        if not any(n.dead and not n.unproven for n in naks.naks.values()):
            return
        due = naks.provable(self.waiting_since, links_fresh_since)       # the proof first, then the last look
        before = time.monotonic()
        held = fresh_view()                     # nothing awaits from here to the last NAK
        now = time.monotonic()
        naks.read_in(held, before, now)
        lost, who = [], {}
        for seq in due:
            nak = naks.naks.get(seq)
            if nak is None or seq in held:
                continue                        # named, or held, since
            del naks.naks[seq]
            if not nak_is_safe(now, nak.earliest, ack_wait):
                self.skip_redelivery(seq, nak)
                continue
            lost.append(seq)
            who[seq] = nak.dead
        if lost:
            await self.send_naks(lost, [], who)
            self.stats["redeliveries_naked"] += len(lost)

    def skip_redelivery(self, seq: int, n: WorkerNak) -> None:
        why = "too late: its redelivery's AckWait may be running out"
        self.stats["skipped"] += 1
        self.stats["last_skipped"] = why
        log.info("in-transit check skipped seq %d (NAKed at delivery %d, its redelivery maybe on the wire to %s): "
                 "%s; it comes back after AckWait (explained by that NAK)", seq, n.delivery, n.dead, why,
                 extra={"event": "in_transit_skipped", "why": why, "seq": seq})

    async def send_naks(self, lost: list[int], losses: list[Loss], who_by_seq: dict[int, str] | None = None) -> None:
        # Any consumer seq in range will do: one delivered after the candidates (the scan's upper
        # reading, or the newest: after the reading that proved a redelivery had gone out).
        delivered = self.info.delivered.consumer_seq if self.info else self.readings[-1].consumer_seq
        who = ", ".join(loss.who for loss in losses) or ", ".join(sorted(set((who_by_seq or {}).values())))
        for seq in lost:
            # $JS.ACK.<stream>.<consumer>.<deliveries>.<stream seq>.<consumer seq>.<time>.<pending>
            reply = f"$JS.ACK.{self.cfg.stream.name}.{self.cfg.consumer.name}.1.{seq}.{delivered}.0.0"
            self.ledger.in_transit_naked(seq, f"{FOUND_IN_TRANSIT}{(who_by_seq or {}).get(seq, who)} at its death "
                                              "(found and NAKed)")
            await self.nc.publish(reply, b"-NAK")
        if lost:
            try:
                await self.nc.fence(timeout=2)
            except Exception as exc:    # NATS away mid-step: the NAKs wait in nats-py's buffer; never end the parent
                log.warning("fencing in-transit NAKs failed: %s", str(exc) or type(exc).__name__)
            log.warning("NAKed %d message(s) that were on their way to %s when it died: seq %s", len(lost), who,
                        ", ".join(map(str, lost)), extra={"event": "in_transit_naked", "seqs": lost, "to": who})
        self.stats["naked"] += len(lost)

    async def stored_in(self, first: int, last: int) -> list[int] | str:
        """The stream sequences in [first, last] still stored, on the consumer's subjects; or why
        they cannot be listed. Read by subject (the server's next message on the filter at or
        after a sequence): one round trip per message of this pool, none for the others' (with
        pools a busy neighbour's backlog lies between two of ours, and the parent's loop waits on
        each read), nor for a schedule stored in between (no job in transit)."""
        js, found = self.nc.jetstream(), set()
        for subject in job_subjects(self.cfg):
            seq = first
            while seq <= last:
                try:
                    msg = await js.get_msg(self.cfg.stream.name, seq, subject=subject, next=True)
                except NotFoundError:
                    break                   # none left on it (a work queue deletes what is acked)
                except Exception as exc:    # timeout, no responders, a leader election: AckWait, not a dead parent
                    return f"{CANNOT_READ}{seq} from the stream: {str(exc) or type(exc).__name__}"
                if msg.seq > last:
                    break
                if not self.ledger.expecting(msg.seq):
                    found.add(msg.seq)
                if len(found) > MAX_SCAN:
                    return f"too many messages to scan (over {MAX_SCAN} stored on {subject} in {first}..{last})"
                seq = msg.seq + 1
        return sorted(found)

    def done(self, outcome: str, why: str, losses: list[Loss] | None = None) -> None:
        """End the round for `losses` (all of them when None); a death that came meanwhile waits for the next."""
        self.stats[outcome] += 1
        ended = self.losses if losses is None else losses
        if why:
            self.stats["last_skipped"] = why
            log.info("in-transit check skipped: %s; what was on the wire to %s comes back after AckWait "
                     "(explained as in transit)", why, ", ".join(loss.who for loss in ended),
                     extra={"event": "in_transit_skipped", "why": why})
        self.losses = [loss for loss in self.losses if loss not in ended]
        self.info, self.info_at = None, None
        if not self.losses:
            self.waiting = self.stats["waiting"] = self.blocked = ""
            self.failed_at, self.last_failure, self.failures = 0.0, "", 0

    # ------------------------------------------------------------ the view

    def unchecked(self, now: float) -> list[dict]:
        """/status `crosscheck.in_transit_unchecked`: each dead worker whose in-transit round has
        not ended, with what may have been on its wire as far as the readings bound it (first
        deliveries: stream seq above `after_seq`, at most `up_to_seq`; None: no such reading
        yet), at most `credits` of them, and what the round waits for. An entry leaves when the
        round ends: what it found is NAKed (`in_transit_checks.runs`), or it gives up
        (`in_transit_checks.skipped`; the log's `in_transit_skipped` says why, and those
        deliveries come back after AckWait, explained as in transit). A supervisor killed
        meanwhile takes the round with it: its last /status is what names those deliveries."""
        return [self.unchecked_row(loss, now) for loss in self.losses]

    def unchecked_row(self, loss: Loss, now: float) -> dict:
        low = self.floor([loss])
        after = [r.delivered for r in self.readings if r.asked >= loss.t]   # a reading after the death bounds it
        return {"pid": loss.pid, "slot": loss.slot, "consumer": self.cfg.consumer.name,
                "age_s": round(now - loss.t, 3), "credits": loss.credits,
                "after_seq": low.delivered if low else None, "up_to_seq": min(after, default=None),
                "why": self.pending_why(loss)}

    def pending_why(self, loss: Loss) -> str:
        """What the round waits for, as of its last tick (or the death's, before the next tick)."""
        if self.blocked:
            return self.blocked
        if not self.nc.is_connected:
            return NOT_CONNECTED
        if self.info_at is None or loss.t >= self.info_at.asked:
            return "a ConsumerInfo read after the death"
        return "every live worker to show what it holds (a PING it sent after that reading, answered)"
