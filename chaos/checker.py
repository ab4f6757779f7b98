"""The one ground-truth checker every chaos run goes through.

It reads what the server confirmed storing, the handlers' own journal and the runner's fault
log, never the supervisor's account (the supervisor's /status cross-check is compared against
the journal, not trusted). Per job (stream sequence):

- lost: stored, never completed by the end of the run (after waiting out AckWait).
- vanished: stored (PubAck'd), never delivered to any handler and gone from the stream at the
  end: the server lost it (a handler runs before any ack, so no ack of ours can remove it).
- deduplicated: never completed (never run, or only failed runs) and gone from the stream, its
  key done under another sequence (a publisher's retry after the stream's duplicate window): the
  idempotency guard acked it unrun.
- dead-lettered: never completed, copied to the dead-letter stream (max_deliver or poison).
- bounced: first ran at a delivery higher than 1 + the drains between its PubAck and that run:
  handed out and NAKed unstarted more often than drains could (each spends consumer.max_deliver).
- retried: a run that ended in an `R` line (the handler raised on purpose) explains the next
  delivery; its lag counts from that line.
- completed twice: the journal has two `D` lines. Each is explained only by a named fault that
  touched the worker of the earlier completion between its start and the redelivery (it died
  before its ack got out, its connection was cut, the server restarted...); otherwise it is
  an unexplained duplicate.
- redelivered: a job run more than once, or first seen at delivery > 1 (a server that lost its
  consumer state runs a job again at delivery 1, so delivery numbers alone miss repeats).
  Explained by a fault that touched the previous run's worker; unexplained when the previous
  run did not finish and nothing touched it. A delivery that never started leaves no trace
  in the journal
  (NAKed unstarted by a drain, in transit at a death, dropped): counted, named as such.
- waited for AckWait: a job that came back no sooner than an AckWait expiry would have brought
  it: more than half of AckWait after the last evidence of the previous delivery. AckWait is
  long (30 s) and scenario loads keep queueing short, so only an expiry (or a NAK held up as
  long, in a stalled connection) takes that long; the lag is reported. A wait counts against
  the supervisor unless every fault that could have caused it is outside its control. For a
  delivery that never started (no run of it in the journal), the chaos proxy names its holder
  (chaos/proxy.py handouts(): the process and the connection it was written to, and when the
  server sent it): the faults that could have caused the wait are the ones that touched that
  holder from its hand-out to the redelivery: on its pid (a SIGKILL, a SIGSTOP, a
  graceful_timeout that ran out; from its death, if the server handed the delivery to a process
  already dead), on its connection (a cut, stall or reset the proxy saw hit it: an orphan of the
  slot a worker-cut's name also matched is hit too), on the supervisor that had forked it (its
  SIGKILL, its link cut or stalled; a SIGHUP, a scale, a pause while the holder lived: a routine
  operation acts on the living workers, and a dead one's jobs are then the death's, seed 52),
  and the server's own (a kill, a stall); the lag counts from the hand-out (from when the proxy
  wrote it on). The wait is
  outside only if that set is not empty and every fault in it is outside; a holder nothing
  touched leaves it the supervisor's (a worker that was written a job and never ran it). A
  fault elsewhere, in control or not, no longer decides it (seed 705: a SIGSTOP of another
  supervisor's worker charged a wait the holder's own in-transit death explained). Without a
  known holder (the delivery never passed the proxy, or its pid was not found) the faults are
  those acting when it may have been handed out: from one AckWait before the redelivery (an
  expiry brings it back exactly then) to the redelivery. (The first start of a later job, the
  other evidence, comes late when jobs queue: after a stalled worker link healed, the backlog
  went to the pull requests the dead connection had carried, and the later jobs started only
  after the heal.) A fault that is outside its control for started jobs may be inside for
  unstarted ones, or the other way round (chaos/facts.py Fault.unstarted_in_control). A
  SIGKILL of the holder's supervisor (in control: its orphans NAK what they hold) counts as
  outside when an outside cut or stall of the holder's own link, or of the server, kept the
  orphan from NATS while it needed it (`orphans_cut_off`: its remedy had no way there; seeds 604,
  705, 809). The
  verdict's text names the holder and what touched it. One more wait counts as outside: a job
  whose worker died with its NAK sent but not fenced (F10: the parent must not NAK it again, a
  second NAK could land on the next holder), but only when a supervisor's ledger named that
  very job, delivery and worker pid at the death (`/status` `crosscheck.left_to_ack_wait`),
  never by a rule about the faults around it; likewise a dead worker's job whose NAK the parent
  held back while disconnected and took with it when it was SIGKILLed (its last /status
  `crosscheck.naks_in_doubt`, read by the rig just before the kill: seed 700, the parent's link
  cut or stalled from the worker's death until its own SIGKILL). And one more: a delivery the
  chaos proxy saw sit in a stalled link (its hand-out: read from the server, not written on to
  the worker) from before until after the job came back, or until its connection closed unread, with an
  outside fault on a connection acting when the proxy read it: the server's AckWait for that very
  delivery ran out while the link held it. That names the job, the delivery and the fault, so it
  holds whatever else happened in the window (seed 600: SIGHUPs and a scale, routine, fell inside
  the window of a never-started delivery and charged it, although the proxy had held it in a
  worker's stalled link all along). Likewise a first delivery that never started, handed to a
  worker whose death's in-transit check had not run when its supervisor was SIGKILLed (the
  rig's read of /status `crosscheck.in_transit_unchecked` just before the kill: that pid, the
  seq inside the window the check would have searched; `unchecked_at_kill`, given the pid the
  proxy wrote the delivery to): nothing could NAK it, and the successor cannot know it.
  Two facts from what the proxy carried to the server (chaos/waits.py): a job whose previous
  delivery the server had a NAK of before it sent the next one did not wait for AckWait at all
  (`nak_waited`, reported: it waited for a pull request), unless a +WPI after that NAK, before
  its delay ran out, set a whole AckWait again ("a +WPI after its NAK": judged as any wait), or
  a server SIGKILL after it may have lost it (outside: the NAK had gone; seed 604); and
  a delivery no connection read (the next one's number says the server sent it) never started:
  it was lost in the closing of a connection with a pull request outstanding about AckWait
  before the redelivery, and the faults that closed those connections decide (all outside:
  outside); with no such connection, the window rule above.
- unacked: still in the work-queue stream at the end (an ack that never landed).
- ticks_extra: firings of the drawn `[schedules.tick]` beyond one per period over the time it
  could exist (from the first supervisor's start to its removal when the load ends): a schedule
  doubled by two supervisors, or by a restart.
- reordered ([ordering] drawn): a run of a job that started before a run of an earlier job of
  its key had ended (chaos/order.py; a run with no end ended at its worker's death, or at the
  next run of its job, whichever came first: the next run is a redelivery of it, NAKed after
  that death). A reorder is what a job run twice can cause, so it is explained exactly as a
  duplicate is: by a fault that touched a worker of a run of the earlier job between that
  run's start and the later job's start (its link cut or stalled past AckWait, so the job ran
  again elsewhere and that ack let the key go on while the first run went on; a parent whose
  +WPI stopped; a host declared lost while alive; graceful_timeout running out), or by a
  server SIGKILL after the earlier job was stored (the restarted server had lost the ack's
  removal, so the job came back). Otherwise it is reorder_unexplained. With pools a key is a
  pool's: jobs of one key name in two pools are two keys.
- copied: a job whose handler asked for a retry longer than `retry.republish_after`, so the
  worker stored a copy for later (a new sequence, the same key) and acked it: not lost while its
  copy is there (the copy, a job of its own here, must complete). copy_dup: a key completed
  under a sequence and under a copy of it (README "Long delays": a copy that fired before its
  original came back; reported).
- wrong_pool: with pools, a run by a worker of another pool's consumer than the job's (pool b's
  jobs are keyed `bN`, the rest are pool a's): each pool's jobs must run on its own workers only.
  Stream order is per consumer, so a later job bounds when an earlier one was sent only within
  its pool.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from supervisor.core.ledger import NAK_READ, NAK_READ_NAKED
from workers.runtime.orphan import ORPHAN_GRACE

from .facts import Fault, Handout, Life, Link, Pull, Rec, Settle, Stored
from .order import Run, reorders
from .waits import Naked, first_pull, lost_in_closing, lost_text, nak_lost_in_close, naked

ACKWAIT_FRACTION = 0.5      # a redelivery later than this share of AckWait waited for AckWait
SLACK = 0.05                # seconds: journal lines and fault times come from different processes
# in_transit_unchecked `why`s that are NATS's doing (supervisor/parent/safety/in_transit.py), and
# how young a death's unchecked round may be whatever it waited for (a tick or two).
NATS_OBSTACLES = ("not connected to NATS", "ConsumerInfo failed", "cannot read", "cannot tell yet whether another")
UNCHECKED_FRESH = 1.0
GIVE_UP = 5.0              # seconds the in-transit check waits for every live worker's proof (in_transit.py)
ROUND_TICK = 1.0           # ... and a tick of the parent's loop to say so
OP_MOOT = 0.2              # seconds: an operation its supervisor's SIGKILL followed this soon is judged with the kill
REAPED_SEEN = 0.5          # seconds: the watcher sees a worker gone this long after its parent reaped it, at most
# Names the ledger gives a dead worker's job whose NAK the server had read (F18): it was to come back
# at once, so they excuse no AckWait wait (the rules for a never-started delivery judge it).
READ_AT_DEATH = (NAK_READ, NAK_READ_NAKED)
# An orphan's claim and its NAKs of what it had not started go out right after its parent's
# death: a cut of its link must have begun by then to have kept them from NATS.
ORPHAN_FIRST_WORDS = 0.5
EXPIRY_SLACK = 0.5          # seconds: an expiry's redelivery reaches a handler this much after AckWait at most

# Verdicts in table order, with what each must be unless a scenario says otherwise (None: reported only).
VERDICTS = {
    "jobs": None, "lost": 0, "vanished": 0, "dead_lettered": 0, "deduplicated": None, "dup": None,
    "dup_unexplained": 0, "redelivered": None, "bounced": None, "unexplained": 0,
    "ackwait": 0, "ackwait_outside": None, "unacked": 0, "sup_unexplained": 0, "sup_open": 0,
    "sup_died": 0, "exit": 0, "healthz_s": None, "ticks_extra": 0, "reordered": None, "reorder_unexplained": 0,
    "wrong_pool": 0, "copies": None, "copied": None, "copy_dup": None, "nak_waited": None,
}
SIDE_KEY = "b"              # with pools: the key prefix of pool b's jobs (chaos/randomized.py)


@dataclass(frozen=True)
class Finding:
    verdict: str
    seq: int
    key: str
    text: str


@dataclass
class Report:
    counts: dict[str, Any]
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def failures(self, expect: dict[str, Any]) -> list[str]:
        """Every verdict over its limit, as `name=value (limit)`."""
        out = []
        for name, limit in expect.items():
            value = self.counts.get(name)
            if limit is not None and value is not None and value > limit:
                out.append(f"{name}={value} (must be <= {limit})")
        return out


@dataclass
class Evidence:
    """Everything the checker reads."""
    stored: dict[int, Stored]
    journal: list[Rec]
    faults: list[Fault]
    ack_wait: float
    origin: float                               # monotonic time the run began (for +offsets)
    lives: dict[int, Life] = field(default_factory=dict)
    unacked: list[int] = field(default_factory=list)
    dead_lettered: list[int] = field(default_factory=list)     # seqs copied to the dead-letter stream
    # supervisor stops, SIGTERM to exit (each may NAK a job once)
    drains: list[tuple[float, float]] = field(default_factory=list)
    status: dict | None = None                  # the supervisor's /status at the end
    statuses: list[dict] = field(default_factory=list)   # several supervisors (a fleet): each one's
    sup_died: int = 0
    bad_exits: int = 0                          # supervisors that did not exit 0 when stopped
    healthz_s: float | None = None
    ticks_extra: int = 0                        # [schedules.tick] firings beyond one per period (rig.py)
    # Jobs a supervisor's ledger left to AckWait at a worker's death, with why: /status
    # `crosscheck.left_to_ack_wait` entries (each: stream_seq, delivery, pid, waits) of the
    # supervisors SIGKILLed on the way, from their last /status (the living's: `statuses`).
    left_to_ack_wait: list[dict] = field(default_factory=list)
    # Dead workers whose in-transit check had not run when their supervisor was SIGKILLed: /status
    # `crosscheck.in_transit_unchecked` read by the rig just before the kill (each: pid, died (the
    # rig's clock), after_seq and up_to_seq (the window of first deliveries; None: unknown), why).
    in_transit_unchecked: list[dict] = field(default_factory=list)
    pools: dict[str, str] = field(default_factory=dict)    # with pools: "main"/"side" -> consumer
    # Every work-queue delivery the chaos proxy carried: who was handed it, when, written on when
    # (empty: the run had no proxy).
    handouts: list[Handout] = field(default_factory=list)
    copies: set[int] = field(default_factory=set)           # seqs of [retry] copies for later (in `stored` too)
    # What the proxy carried from the clients to the server: the work queue's settles and pull
    # requests, and every connection with its close (chaos/waits.py reads them).
    settles: list[Settle] = field(default_factory=list)
    pulls: list[Pull] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)

    def pool_of(self, key: str) -> str:
        """The pool a job belongs to ("" without pools)."""
        if not self.pools:
            return ""
        return "side" if key.startswith(SIDE_KEY) and key[1:].isdigit() else "main"


@dataclass
class RunOfJob:
    pid: int
    delivery: int
    start: float
    done: float | None = None
    retried: float | None = None        # the handler raised on purpose (an `R` line)

    @property
    def ended(self) -> float | None:
        return self.done if self.done is not None else self.retried


def runs_by_seq(journal: list[Rec]) -> dict[int, list[RunOfJob]]:
    """Each job's runs in start order (a run = one delivery in one process). A process can run the
    same delivery number twice: a restarted server that lost its consumer state hands the job out
    again as delivery 1 (seed 855); each S line opens a run of its own, its D or R line ends it."""
    runs: dict[int, list[RunOfJob]] = defaultdict(list)
    open_: dict[tuple[int, int, int], list[RunOfJob]] = defaultdict(list)   # oldest first: two may overlap
    for r in sorted(journal, key=lambda r: r.t):
        if r.event == "S":
            run = RunOfJob(r.pid, r.delivery, r.t)
            open_[(r.seq, r.pid, r.delivery)].append(run)
            runs[r.seq].append(run)
        elif (opened := open_.get((r.seq, r.pid, r.delivery))):
            run = opened.pop(0)
            if r.event == "R":
                run.retried = r.t
            else:
                run.done = r.t
    return dict(runs)


class Checker:
    def __init__(self, ev: Evidence):
        self.ev = ev
        self.runs = runs_by_seq(ev.journal)
        self.keys = {r.seq: r.key for r in ev.journal}
        self.keys.update({s.seq: s.key for s in ev.stored.values()})
        self.findings: list[Finding] = []
        self.first_start = self._first_starts()
        self.named: dict[tuple[int, int], dict[int, str]] = defaultdict(dict)   # (seq, delivery) -> {pid: why}
        ends = ev.statuses or ([ev.status] if ev.status is not None else [])
        for w in [*ev.left_to_ack_wait, *(w for st in ends for w in st["crosscheck"].get("left_to_ack_wait", []))]:
            if w.get("waits") not in READ_AT_DEATH:     # read by the server: no reason to wait for AckWait
                self.named[(int(w["stream_seq"]), int(w["delivery"]))][int(w["pid"])] = str(w.get("waits", ""))
        self.pool_note = ""
        self.handed: dict[tuple[int, int], list[Handout]] = defaultdict(list)   # (seq, delivery) -> hand-outs
        for h in ev.handouts:
            self.handed[(h.seq, h.delivery)].append(h)

    def _first_starts(self) -> list[tuple[int, float]]:
        """(seq, start) of every first delivery, by seq: the consumer sends first deliveries in
        stream order, so a later seq's first start bounds when an earlier seq was sent (each
        pool's consumer its own: `sent_by` compares within a pool)."""
        out = [(seq, runs[0].start) for seq, runs in self.runs.items() if runs and runs[0].delivery == 1]
        return sorted(out)

    def pool(self, seq: int) -> str:
        return self.ev.pool_of(self.keys.get(seq, ""))

    def wrong_pools(self, c: dict) -> None:
        """Each pool's jobs ran on its own workers only (the watcher read each worker's consumer)."""
        if not self.ev.pools:
            return
        seen: dict[str, int] = defaultdict(int)
        for seq, runs in self.runs.items():
            want = self.ev.pools[self.pool(seq)]
            for r in runs:
                life = self.ev.lives.get(r.pid)
                seen[life.consumer if life is not None and life.consumer else "unknown"] += 1
                if life is not None and life.consumer and life.consumer != want:
                    c["wrong_pool"] += 1
                    self.find("wrong_pool", seq, f"delivery {r.delivery} ran on pid {r.pid}, a worker of "
                                                 f"{life.consumer}; the job is {want}'s")
        self.pool_note = "pools: runs by the worker's consumer: " + ", ".join(f"{k} {n}" for k, n in sorted(seen.items()))

    def at(self, t: float) -> str:
        return f"+{t - self.ev.origin:.2f}s"

    def find(self, verdict: str, seq: int, text: str) -> None:
        self.findings.append(Finding(verdict, seq, self.keys.get(seq, "?"), text))

    def touching(self, pid: int, lo: float, hi: float) -> list[Fault]:
        return [f for f in self.ev.faults if f.touches(pid, lo - SLACK, hi + SLACK)]

    def overlapping(self, lo: float, hi: float) -> list[Fault]:
        return [f for f in self.ev.faults if f.t0 <= hi + SLACK and f.t1 >= lo - SLACK]

    # ------------------------------------------------------------ per job

    def check(self) -> Report:
        c = dict.fromkeys(VERDICTS, 0)
        c["jobs"] = len(self.ev.stored) - len(self.ev.copies)
        c["copies"] = len(self.ev.copies)
        for seq in sorted(set(self.ev.stored) | set(self.runs)):
            runs = self.runs.get(seq, [])
            if seq not in self.ev.stored:
                self.find("unknown", seq, "run by a worker but never stored (publish side bookkeeping is wrong)")
            done = any(r.done is not None for r in runs)
            copy = 0 if done else first_copy(seq, self.keys, self.ev.copies)
            if not done and not (runs and copy) and seq not in self.ev.unacked and self.done_elsewhere(seq):
                # Its key done under another sequence (a publisher's retry after the duplicate
                # window), before any run of this one or between its failed runs: the guard acked it unrun.
                c["deduplicated"] += 1
                self.find("deduplicated", seq, "its key was done under another sequence; acked without running"
                          + (f" after {len(runs)} failed run(s)" if runs else ""))
            elif copy:
                c["copied"] += 1
                self.find("copied", seq, f"ran {len(runs)}x and was re-published for later as seq {copy} (its own job)")
            elif not done:
                verdict = ("dead_lettered" if seq in self.ev.dead_lettered else
                           "vanished" if not runs and seq not in self.ev.unacked else "lost")
                c[verdict] += 1
                self.find(verdict, seq, self.describe_lost(seq, runs))
            extra, unexplained = self.duplicates(seq, runs)
            c["dup"] += extra
            c["dup_unexplained"] += unexplained
            if len(runs) > 1 or (runs and runs[0].delivery > 1):
                c["redelivered"] += 1
            drains = self.drains_before(seq, runs)
            if runs and runs[0].delivery - 1 > drains:
                c["bounced"] += 1
                self.find("bounced", seq, f"first ran at delivery {runs[0].delivery}: {runs[0].delivery - 1} "
                                          f"deliveries never ran, with {drains} drain(s) in between")
            for i, run in enumerate(runs):
                if i > 0 or run.delivery > 1:
                    self.redelivery(seq, runs[:i], run, c)
        for key, seqs in copy_dups(self.runs, self.keys, self.ev.copies):
            c["copy_dup"] += 1
            self.find("copy_dup", min(seqs), f"key {key} completed as seqs {sorted(seqs)}, copies for later among "
                                             f"them: {sorted(seqs & self.ev.copies)}")
        c["ticks_extra"] = self.ev.ticks_extra
        self.order(c)
        self.wrong_pools(c)
        c["unacked"] = len(self.ev.unacked)
        for seq in self.ev.unacked:
            self.find("unacked", seq, "still in the work-queue stream at the end: no ack landed")
        self.supervisor_word(c)
        notes = self.queueing_note() + ([self.pool_note] if self.pool_note else [])
        return Report(c, self.findings, notes)

    def done_elsewhere(self, seq: int) -> bool:
        """Another stored job with the same key (a publisher's retry after the duplicate window)
        completed: the idempotency guard acks this one without running it."""
        key = self.keys.get(seq)
        return any(self.keys.get(other) == key and any(r.done is not None for r in runs)
                   for other, runs in self.runs.items() if other != seq)

    def drains_before(self, seq: int, runs: list[RunOfJob]) -> int:
        """Drains under way between the job's PubAck and its first run: each could NAK it once.
        A drain lasts from its SIGTERM to the exit: until its workers' UNSUB reaches the server,
        their pull requests still take new jobs, which the drain then NAKs unstarted."""
        stored = self.ev.stored.get(seq)
        lo = stored.t if stored else self.ev.origin
        hi = runs[0].start if runs else float("inf")
        return sum(t0 <= hi + SLACK and t1 >= lo - SLACK for t0, t1 in self.ev.drains)

    def describe_lost(self, seq: int, runs: list[RunOfJob]) -> str:
        if seq in self.ev.dead_lettered:
            return f"dead-lettered after {len(runs)} run(s) (consumer.max_deliver or poison)"
        if not runs:
            where = "still in the stream" if seq in self.ev.unacked else "gone from the stream: the server lost it"
            return f"stored (PubAck), never delivered to a handler; {where}"
        last = runs[-1]
        return (f"started {len(runs)}x, never completed; last: delivery {last.delivery} by pid {last.pid} "
                f"{self.at(last.start)}")

    def duplicates(self, seq: int, runs: list[RunOfJob]) -> tuple[int, int]:
        """(completions beyond the first, of which unexplained)."""
        done = [r for r in runs if r.done is not None]
        extra = unexplained = 0
        for earlier in done[:-1]:
            extra += 1
            # Whatever ran it next (a server that lost its consumer state redelivers at delivery 1).
            redo = min([r.start for r in runs if r.start > earlier.start], default=earlier.done)
            faults = self.touching(earlier.pid, earlier.start, redo) or self.state_lost(seq, earlier, runs)
            if not faults:
                unexplained += 1
                again = [r for r in done if r is not earlier and r.start >= earlier.start]
                second = again[0] if again else earlier
                self.find("dup_unexplained", seq,
                          f"completed at delivery {earlier.delivery} by pid {earlier.pid} {self.at(earlier.done)} "
                          f"and again at delivery {second.delivery} by pid {second.pid} {self.at(second.done)}; "
                          f"no fault touched pid {earlier.pid} in between")
            else:
                self.find("dup", seq, f"completed at delivery {earlier.delivery} by pid {earlier.pid} and again: "
                                      f"{faults[0].name(self.ev.origin)}")
        return extra, unexplained

    def state_lost(self, seq: int, earlier: RunOfJob, runs: list[RunOfJob]) -> list[Fault]:
        """The server SIGKILLed after the job was stored and before this run of it completed, and
        the next run at delivery 1: the restarted server had not persisted the delivery (or the
        ack) and handed the job out as new. The delivery can be long before the handler's start
        line: a job held waiting for a [limits] slot, or buffered by the pull."""
        stored, after = self.ev.stored.get(seq), [r for r in runs if r.start > earlier.start]
        if stored is None or not after or after[0].delivery != 1:
            return []
        end = earlier.done if earlier.done is not None else earlier.start
        return [f for f in self.ev.faults if f.kind.startswith("nats-server SIGKILL")
                and stored.t - SLACK <= f.t0 <= end + SLACK]

    def redelivery(self, seq: int, before: list[RunOfJob], run: RunOfJob, c: dict) -> None:
        """A job run again (or first seen at delivery > 1): why, and how long after it was free?"""
        holders = holders_of(self.handed, seq, before, run)
        prev = run.delivery - 1     # never started, and no connection read it (a proxy ran and saw no hand-out)
        unseen = bool(self.ev.links) and prev >= 1 and not self.handed.get((seq, prev)) and all(
            r.delivery != prev for r in before)
        if before:
            p = before[-1]
            faults = self.touching(p.pid, p.start, run.start)
            t_ref = max([p.start, p.ended or p.start, *(min(f.t0, run.start) for f in faults if f.t0 >= p.start)])
            if not faults and p.ended is None:
                c["unexplained"] += 1
                self.find("unexplained", seq, f"delivery {run.delivery} {self.at(run.start)} after pid {p.pid} "
                                              f"started delivery {p.delivery} {self.at(p.start)} and never finished "
                                              "it; no fault touched that pid")
            # A delivery after it that no connection read never started: not judged by p's worker.
            culprits = self.overlapping(run.start - self.ev.ack_wait - EXPIRY_SLACK, run.start) if unseen else faults
        else:
            t_ref = self.sent_by(seq)
            # What touched it is what acted when it was handed out. `sent_by` is only an upper
            # bound of that moment (a later job's first start: late when jobs queue); a delivery
            # that came back by expiry was handed out one AckWait before it came back.
            culprits = self.overlapping(min(t_ref, run.start - self.ev.ack_wait) - EXPIRY_SLACK, run.start)
        if holders:
            # The delivery before this one never started, and the proxy saw whom it was handed to:
            # it was free from then on (or from when the proxy wrote it on), and what could have
            # kept it is what touched that holder since.
            handed = max(h.came if h.out is None else h.out for h in holders)
            t_ref = max(t_ref, handed) if before else handed
            culprits = on_holders(self.ev, holders, run.start)
        t_ref = max(t_ref, self.key_free(seq, run.start))       # it waited for its key's turn meanwhile
        lag = run.start - t_ref
        cause = culprits[0].name(self.ev.origin) if culprits else (
            f"delivery {run.delivery - 1} never started, {holders[0].held(self.ev.origin)}" if holders else
            "an earlier delivery never started" if not before else
            "the handler asked for it (retry)" if before[-1].retried is not None else "no fault")
        self.find("redelivered", seq, f"delivery {run.delivery} by pid {run.pid} {self.at(run.start)}, {max(lag, 0):.2f}s "
                                      f"after the previous delivery was last seen; {cause}")
        if lag >= ACKWAIT_FRACTION * self.ev.ack_wait:
            late_wait(self, seq, before, run, Late(holders, culprits, lag, unseen), c)

    # ------------------------------------------------------------ [ordering]

    def order_of(self, seq: int) -> str:
        """Job `seq`'s [ordering] key ("" for none); with pools its pool's (a key name in two
        pools is two keys: each pool's consumer and workers order their own jobs)."""
        s = self.ev.stored.get(seq)
        if s is None or not s.order:
            return ""
        return f"{self.pool(seq)}/{s.order}" if self.ev.pools else s.order

    def order(self, c: dict) -> None:
        keys = {seq: key for seq in self.ev.stored if (key := self.order_of(seq))}
        if not keys:
            c["reordered"] = c["reorder_unexplained"] = None
            return
        for bad in reorders(order_runs(self.runs, self.ev.lives), keys):
            a, b = bad.before, bad.after
            faults = [f for r in self.runs.get(a.seq, []) if r.start <= b.start
                      for f in self.touching(r.pid, r.start, b.start)] or self.lost_by_server(a.seq, b.start)
            if faults:
                c["reordered"] += 1
                self.find("reordered", b.seq, f"{bad.describe()}: {faults[0].name(self.ev.origin)}")
            else:
                c["reorder_unexplained"] += 1
                self.find("reorder_unexplained", b.seq, f"{bad.describe()}; no fault touched seq {a.seq}'s workers "
                                                        "in between")

    def lost_by_server(self, seq: int, before: float) -> list[Fault]:
        """A server SIGKILLed after `seq` was stored and before `before`: it may have lost the
        removal of an acked job, which then came back."""
        stored = self.ev.stored.get(seq)
        lo = stored.t if stored else self.ev.origin
        return [f for f in self.ev.faults if f.kind.startswith("nats-server SIGKILL") and lo - SLACK <= f.t0 <= before]

    def key_free(self, seq: int, t: float) -> float:
        """[ordering]: when the last run of an earlier job of `seq`'s key before `t` ended (a job
        of the key could not start before): what a redelivery's lag counts from."""
        key = self.order_of(seq)
        if not key:
            return float("-inf")
        ends = [r.ended for s, runs in self.runs.items() if s < seq and self.order_of(s) == key
                for r in runs if r.ended is not None and r.ended <= t]
        # An earlier job whose ack was lost stayed stored, and held the key, until a later ack
        # (of a rerun, or of a redelivery acked unrun by the guard) the proxy carried: seed 817.
        ends += [x.t for x in self.ev.settles if x.seq < seq and x.kind in ("+ACK", "+TERM") and x.t <= t
                 and self.order_of(x.seq) == key]
        return max(ends, default=float("-inf"))

    def sent_by(self, seq: int) -> float:
        """A time by which a never-journaled first delivery of `seq` had surely been sent: the
        first start of any later job (first deliveries go out in stream order), else the PubAck."""
        stored = self.ev.stored.get(seq)
        later = [t for s, t in self.first_start if s > seq and self.pool(s) == self.pool(seq)]
        if later:
            return min(later)
        return stored.t if stored else self.ev.origin

    # ------------------------------------------------------------ the supervisor's own word

    def supervisor_word(self, c: dict) -> None:
        c["sup_died"] = self.ev.sup_died
        c["exit"] = self.ev.bad_exits
        c["healthz_s"] = self.ev.healthz_s
        statuses = self.ev.statuses or ([self.ev.status] if self.ev.status is not None else [])
        if not statuses:
            c["sup_unexplained"] = c["sup_open"] = None
            return
        ccs = [s["crosscheck"] for s in statuses]
        c["sup_unexplained"] = sum(cc["unexplained_redeliveries"] for cc in ccs)
        c["sup_open"] = sum(len(cc["outstanding"]) for cc in ccs)
        for o in (o for cc in ccs for o in cc["outstanding"]):
            self.find("sup_open", o["stream_seq"], f"the supervisor's ledger still lists it as held at a death: {o}")
        journal_unexplained = c["dup_unexplained"] + c["unexplained"]
        if journal_unexplained > c["sup_unexplained"]:
            self.findings.append(Finding("crosscheck", 0, "", (
                f"the journal shows {journal_unexplained} unexplained redelivery(ies) or duplicate(s), the "
                f"supervisors' cross-check counts {c['sup_unexplained']}: it explained away what it "
                "should have flagged")))

    def queueing_note(self) -> list[str]:
        """The AckWait verdict assumes jobs wait in the queue far less than AckWait: say if not."""
        waits = [runs[0].start - self.ev.stored[seq].t for seq, runs in self.runs.items()
                 if runs and runs[0].delivery == 1 and seq in self.ev.stored]
        worst = max(waits, default=0.0)
        if worst >= ACKWAIT_FRACTION * self.ev.ack_wait:
            return [f"jobs waited up to {worst:.1f}s in the queue: AckWait waits may be overcounted"]
        return []


@dataclass
class Late:
    """A redelivery that came AckWait/2 or more after its previous delivery was last seen."""
    holders: list[Handout]      # whom the proxy saw handed the delivery before it, if it never started
    culprits: list[Fault]       # what could have kept it (checker.redelivery)
    lag: float
    unseen: bool                # that delivery never started, and no connection read it


def late_wait(ck: Checker, seq: int, before: list[RunOfJob], run: RunOfJob, w: Late, c: dict) -> None:
    """Was it an AckWait wait, and whose? Not one if the server had the previous delivery's NAK
    (chaos/waits.py naked: `nak_waited`, reported); else outside the supervisor's control if a
    stalled link held it, or every fault that could have kept it is outside, or a ledger named it."""
    ev, consumer = ck.ev, ck.ev.pools.get(ck.pool(seq), "")
    nak = nak_of(ck, seq, before, run, consumer, w.unseen)
    # The wait is the NAK's only if the NAK itself came soon and the job ran soon after the
    # server sent it again: a NAK the supervisor sent late, or a delivery held long after it came,
    # is judged as any wait (a cold review: a death's NAK 20 s late would have passed).
    late_nak = False
    if nak is not None:
        due = nak_due(ev, run.start - w.lag, nak.nak.t, w.holders, before)
        late_nak = (nak.nak.t - due - away(ev, due, nak.nak.t, nak.nak.conn, nak.nak.pid)) \
            + (run.start - next_sent(ck, seq, run)) >= ACKWAIT_FRACTION * ev.ack_wait
    if nak is not None and nak.wpi is None and nak.lost_by is None and not late_nak:
        c["nak_waited"] += 1
        due = nak.nak.t + nak.nak.delay
        pull = first_pull(ev, consumer, due)
        pulled = (f"the first pull request of its consumer after that +{pull.t - ev.origin:.2f}s (connection "
                  f"#{pull.conn})" if pull else "no pull request of its consumer after that")
        ck.find("nak_waited", seq, f"delivery {run.delivery} started {w.lag:.1f}s after the previous delivery was last "
                                   f"seen, {run.start - due:.1f}s after its NAK was due: not an AckWait wait, "
                                   f"{nak.said(ev.origin)}; {pulled}")
        return
    holders, culprits = w.holders, w.culprits
    lost = lost_in_closing(ev, consumer, next_sent(ck, seq, run)) if w.unseen else []
    if lost:
        culprits = sorted({id(f): f for _, fs in lost for f in fs}.values(), key=lambda f: f.t0)
    held = held_in_link(ev, seq, run) or (nak.said(ev.origin) if nak is not None and nak.lost_by else "") or (
        nak_lost_in_close(ev, seq, before[-1].pid, before[-1].retried, {h.conn for h in ck.handed.get(
            (seq, before[-1].delivery), [])}, next_sent(ck, seq, run))
        if before and before[-1].retried is not None and before[-1].delivery == run.delivery - 1 else "")
    started = bool(before) and not holders and not w.unseen
    outside = held or (all(fs for _, fs in lost) and
                       all_outside(culprits, started, holders, before[-1].pid if started else 0, ev.lives,
                                   ev.faults))
    holder = holders[-1].pid if holders else lost[0][0].pid if len(lost) == 1 else 0   # the delivery's own
    named = "" if outside else named_at_death(ck.named, seq, before, run, holder=holder,
                                              unchecked=ev.in_transit_unchecked)
    verdict = "ackwait_outside" if outside or named else "ackwait"
    c[verdict] += 1
    context = (holder_context(ev, holders, culprits) if holders else lost_text(ev, run.delivery - 1, lost) if lost
               else wait_context(ev, run.start, culprits))
    why = held or context + (f"; named at the death by the ledger: {named}" if named else "")
    why += f"; {nak.said(ev.origin)}" if nak is not None and nak.wpi is not None else ""
    why += f"; {nak.said(ev.origin)}, judged as any wait: it came late" if late_nak and nak and nak.wpi is None else ""
    ck.find(verdict, seq, f"delivery {run.delivery} started {w.lag:.1f}s after the previous delivery was last "
                          f"seen{'' if started else ' (it never started)'}; {why}")


def nak_due(ev: Evidence, seen: float, sent: float, holders: list[Handout], before: list[RunOfJob]) -> float:
    """When the NAK of a delivery last seen at `seen` became due: then, or its holder's death
    after it, if the holder died by the time the NAK was `sent` (a dead worker's held jobs are
    its parent's to NAK from its death on; seed 1102: a job held, unstarted, 6.5 s by a worker
    waiting for a [limits] slot, then stopped and killed, NAKed by its parent at the death, was
    taken for a late NAK). The watcher sees a death once the parent reaped it, after that NAK:
    REAPED_SEEN."""
    pid = holders[-1].pid if holders else before[-1].pid if before else 0
    life = ev.lives.get(pid)
    died = life.died if life is not None else None
    return min(died, sent) if died is not None and seen <= died <= sent + REAPED_SEEN else seen


def away(ev: Evidence, lo: float, hi: float, conn: int = 0, sender: int = 0) -> float:
    """Seconds of [lo, hi] the server was stopped or down by an outside fault, or the NAK's own
    connection `conn` stalled, or its sender a parent whose connection was cut or stalled: no NAK
    could reach the server then, so that time does not make a NAK late (seed 985: an orphan's
    NAKs 9.7 s after the hand-out, 4.2 s of it a server stall and kill; seed 1015: a dead
    worker's NAK, sent by its parent at once into the parent's link, stalled 11.4 s, carried on
    at the stall's end and the job back 1.8 s later, before its AckWait ran out; seed 1102: a
    parent whose link was cut when its worker died sent the NAK 1.2 s after it was back, as
    README says it does). A fault of the NAK's link in control too: the NAK was the supervisor's
    remedy, on time, and the job came back by it, not by an expiry; whether the fault itself
    cost an AckWait elsewhere is judged where it did."""
    def kept_away(f: Fault) -> bool:
        if conn > 0 and conn in f.conns and "stall" in f.kind:
            return True
        if sender > 0 and f.parent == sender and "the parent's connection" in f.kind:
            return True
        return f.kind.startswith("nats-server") and f.pids is None and not f.in_control
    spans = sorted((max(lo, f.t0), min(hi, f.t1)) for f in ev.faults if kept_away(f) and f.t0 < hi and f.t1 > lo)
    away, end = 0.0, lo
    for a, b in spans:
        a = max(a, end)
        if b > a:
            away, end = away + b - a, b
    return away


def nak_of(ck: Checker, seq: int, before: list[RunOfJob], run: RunOfJob, consumer: str, unseen: bool) -> Naked | None:
    """The NAK the server had of the delivery before `run` (chaos/waits.py naked), looked for from
    when that delivery was sent (its hand-out; else its run's start, after it was sent) until the
    next one was (its hand-out, else `run`'s start). A delivery no connection read: when it was
    sent is not known, so a NAK cannot be told from one of the delivery before it."""
    prev = run.delivery - 1
    if unseen or prev < 1:
        return None
    came = min((h.came for h in ck.handed.get((seq, prev), [])), default=None)
    sent = came if came is not None else next((r.start for r in reversed(before) if r.delivery == prev), None)
    if sent is None:
        return None
    return naked(ck.ev, seq, consumer, sent, next_sent(ck, seq, run), came, run.start)


def next_sent(ck: Checker, seq: int, run: RunOfJob) -> float:
    """When the server sent `run`'s delivery: the proxy read it then, else by its start."""
    return min((h.came for h in ck.handed.get((seq, run.delivery), []) if h.came <= run.start + SLACK), default=run.start)


def order_runs(runs_by: dict[int, list[RunOfJob]], lives: dict) -> list[Run]:
    """Every run, with when it ended: its done or retried line, else its worker's death or the
    next run of its job, whichever came first (a death is seen a few ms late; the next run is its
    redelivery, after it)."""
    out = []
    for seq, runs in runs_by.items():
        for k, r in enumerate(runs):
            end = r.ended
            if end is None:
                life = lives.get(r.pid)
                bounds = [t for t in (life.died if life else None, *(n.start for n in runs[k + 1:])) if t]
                end = min(bounds, default=None)
            out.append(Run(seq, r.pid, r.delivery, r.start, end))
    return out


def held_in_link(ev: Evidence, seq: int, run: RunOfJob) -> str:
    """How a stalled link held the delivery before `run` while its AckWait ran out, or "": the
    proxy read it from the server before `run` and had not written it on to the worker by the
    time the job came back (EXPIRY_SLACK: the redelivery's way to a handler), or never did (the
    connection closed with it); and an outside fault on that delivery's connection (any, for a
    fault that did not record the connections it hit) acted when the proxy read it. Only that
    delivery of that job, by that fault."""
    def at(t: float) -> str:
        return f"+{t - ev.origin:.2f}s"
    for d in ev.handouts:
        if d.seq != seq or d.delivery != run.delivery - 1 or d.came > run.start:
            continue
        if d.out is not None and d.out < run.start - EXPIRY_SLACK:
            continue                    # the worker could read it before it came back: the wait is not the link's
        stalls = [f for f in ev.faults if "connection" in f.kind and not f.controls(started=False)
                  and f.t0 - SLACK <= d.came <= f.t1 + SLACK and (not f.conns or d.conn in f.conns)]
        if stalls:
            out = "never written on (its connection closed)" if d.out is None else f"written on {at(d.out)}"
            return (f"delivery {d.delivery} held in the stalled link of {d.name!r} from {at(d.came)}, {out}: "
                    f"{stalls[0].name(ev.origin)}")
    return ""


def holders_of(handed: dict[tuple[int, int], list[Handout]], seq: int, before: list[RunOfJob],
               run: RunOfJob) -> list[Handout]:
    """Whom the delivery before `run` was handed to, when it never started (no run of it in the
    journal) and the proxy saw every hand-out of it go to a process it knows; else [] (it
    started, it never passed the proxy, or a holder's pid was not found)."""
    prev = run.delivery - 1
    if prev < 1 or any(r.delivery == prev for r in before):
        return []
    found = [h for h in handed.get((seq, prev), []) if h.came <= run.start + SLACK]
    return found if found and all(h.pid for h in found) else []


def on_holders(ev: Evidence, holders: list[Handout], end: float) -> list[Fault]:
    """The faults that acted on a holder from its hand-out to `end`: on its process (a kill, a
    stop, a graceful_timeout that ran out), on its connection (a cut, stall or reset the proxy
    saw hit it), on the supervisor that had forked it (its SIGKILL, its link to the end; a
    SIGHUP, a scale, a pause while the holder lived), or on every connection (the server's). A
    holder already dead when the proxy read the delivery (the server handed it to a connection
    whose process had just died) counts from its death."""
    out: list[Fault] = []
    for h in holders:
        life = ev.lives.get(h.pid)
        parent = life.parent if life is not None and life.parent else (h.ppid if h.ppid > 1 else None)
        died = life.died if life is not None else None
        lo = h.came if died is None else min(h.came, died)
        out += [f for f in ev.faults if f.holds(h, parent, lo - SLACK, end + SLACK, None if died is None else died + SLACK)
                and all(f is not g for g in out)]
    return sorted(out, key=lambda f: f.t0)


def all_outside(culprits: list[Fault], started: bool, holders: list[Handout], pid: int,
                lives: dict[int, Life] | None = None, faults: list[Fault] | None = None) -> bool:
    """Could only faults outside the supervisor's control have caused the wait? (At least one
    did; a parent kill that left its orphans no way to NATS counts as outside: orphans_cut_off;
    so does one whose orphan an outside kill took, and what a stop never ended let nobody do:
    superseded.)"""
    pids = {pid} if pid else {h.pid for h in holders if h.pid}
    cut_off = orphans_cut_off(culprits, {h.conn for h in holders if h.conn}, pid)
    cut_off += superseded(culprits, pids, started, lives or {})
    if not started:
        cut_off += round_blocked(culprits, pids, lives or {}, faults or [])
    cut_off += moot_ops(culprits, cut_off)
    return bool(culprits) and all(not f.controls(started=started) or any(f is g for g in cut_off) for f in culprits)


def round_blocked(culprits: list[Fault], pids: set[int], lives: dict[int, Life], faults: list[Fault]) -> list[Fault]:
    """The in-control faults on a holder that died with a delivery on its wire (its kill, its
    stop), when an outside fault on another live worker's link of the same supervisor came within
    the in-transit check's GIVE_UP after the death: the check NAKs only once every live worker
    proved what it holds, and that one could not (README: "Otherwise the job waits for AckWait",
    `in_transit_skipped`; seed 982: a 39 s stall of worker 0's link 3 s after worker 1's death)."""
    out = []
    for p in pids:
        life = lives.get(p)
        if life is None or life.died is None:
            continue
        def sibling_alive(q: int) -> bool:          # a worker the check waits on: alive during it
            other = lives.get(q)
            return q != p and other is not None and other.parent == life.parent \
                and other.born <= life.died + GIVE_UP and (other.died is None or other.died > life.died)
        if any(not f.in_control and "connection" in f.kind and "worker" in f.kind and f.pids
               and all(sibling_alive(q) for q in f.pids) and f.t0 <= life.died + GIVE_UP and f.t1 >= life.died
               for f in faults):
            out += [f for f in culprits if f.in_control and f.pids is not None and p in f.pids
                    and f.t0 <= life.died + SLACK]
            # ... and its supervisor's link faults after the check had given up: they met no NAK.
            out += [f for f in culprits if f.in_control and f.parent == life.parent and "connection" in f.kind
                    and f.t0 > life.died + GIVE_UP + ROUND_TICK]
    return out


def superseded(culprits: list[Fault], pids: set[int], started: bool, lives: dict[int, Life]) -> list[Fault]:
    """In-control faults on the holder that a later fault made moot (seeds 817 and 930):
      - its supervisor's SIGKILL, when an outside SIGKILL took the orphan within ORPHAN_GRACE (for
        a job it ran; by its first words for one it had not started: those it NAKs at once): the
        orphan's remedy is what that kill prevented;
      - a SIGSTOP of the holder that an outside SIGKILL of it ended: the stopped worker would
        have gone on;
      - a routine operation on its supervisor while it was stopped by a SIGSTOP that lasted to
        its death: a stopped process acts on nothing, and it never resumed (930: a SIGTTOU while
        the holder, stopped 4.4 s, waited for the heartbeat check's kill)."""
    kills = [g for g in culprits if not g.controls(started=started) and g.kind.startswith("worker SIGKILL")
             and g.pids is not None]
    def killed_outside(p: int, lo: float, hi: float) -> bool:
        return any(p in (g.pids or ()) and lo - SLACK <= g.t0 <= hi + SLACK for g in kills)
    out = []
    for p in pids:
        life = lives.get(p)
        died = life.died if life is not None else None
        stops = [f for f in culprits if "SIGSTOP" in f.kind and f.pids is not None and p in f.pids]
        for f in culprits:
            if f.kind.startswith("parent SIGKILL") and f.pids is not None and p in f.pids \
                    and killed_outside(p, f.t0, f.t0 + (ORPHAN_GRACE if started else ORPHAN_FIRST_WORDS)):
                out.append(f)
            elif any(f is s for s in stops) and killed_outside(p, f.t0, f.t1):
                out.append(f)
            elif f.routine and life is not None and f.parent == life.parent and died is not None and any(
                    s.t0 - SLACK <= f.t0 <= died and s.t1 + SLACK >= died for s in stops):
                out.append(f)
    return out


def moot_ops(culprits: list[Fault], cut_off: list[Fault]) -> list[Fault]:
    """Routine operations (SIGHUP, scale, pause) on a supervisor SIGKILLed within OP_MOOT after
    them (less than a retirement's NAKs take on a working box), that kill among those that left
    its orphans no way to NATS: whatever the operation
    began (a retirement, a drain's NAKs) was the orphans' to finish over the same link the
    outside fault cut (seed 817: a SIGTTOU, the parent's SIGKILL and a 4.6 s server stall within
    10 ms of one another)."""
    return [f for f in culprits if f.routine and any(
        g.kind.startswith("parent SIGKILL") and g.parent == f.parent and f.t0 - SLACK <= g.t0 <= f.t0 + OP_MOOT
        for g in cut_off)]


def orphans_cut_off(culprits: list[Fault], conns: set[int], pid: int) -> list[Fault]:
    """The SIGKILLs of a holder's supervisor that left it an orphan with no way to NATS: the
    orphan's only remedy for what it holds (its claim, its NAKs) goes over its own link within
    ORPHAN_GRACE of the death (workers/runtime/orphan.py), and an outside fault cut or stalled that
    very link, or took the server itself away (a kill, a stall: every connection), while it needed
    it: the proxy saw it hit the connection a never-started delivery was handed on (`conns`), by
    the time the orphan's claim and first NAKs go out (ORPHAN_FIRST_WORDS), or, for a started run,
    a connection of its worker (`pid`) within the grace (its last NAK and its acks' fence come at
    its end; seed 809: the server SIGKILLed 1.1 s before the parent, back 1.8 s after it).
    The kill then counts as what it is, a fault outside the supervisor's control (seeds 604 and
    705: a worker-cut of 3.86 s beside the parent's SIGKILL). A cut that ended before the death,
    or began after the grace, excuses nothing."""
    links = [f for f in culprits if not f.in_control and (f.pids is None or f.conns and (
        conns & f.conns or (pid and pid in f.pids)))]
    until = ORPHAN_GRACE if pid else ORPHAN_FIRST_WORDS
    return [f for f in culprits if f.kind.startswith("parent SIGKILL") and any(
        g.t0 <= f.t0 + until + SLACK and g.t1 >= f.t0 for g in links)]


def wait_context(ev: Evidence, t: float, culprits: list[Fault]) -> str:
    """What happened about one AckWait before the redelivery: what the wait started with."""
    due = t - ev.ack_wait
    deaths = sorted((lf for lf in ev.lives.values() if lf.died is not None and abs(lf.died - due) <= 3.0),
                    key=lambda lf: abs((lf.died or 0.0) - due))
    def far(f: Fault) -> float:
        return max(f.t0 - due, due - f.t1, 0.0)
    faults = sorted((f for f in ev.faults if far(f) <= 3.0), key=far) or culprits
    parts = [f.name(ev.origin) for f in faults[:2]]
    parts += [f"worker pid {lf.pid} exited +{(lf.died or 0.0) - ev.origin:.2f}s" for lf in deaths[:3]]
    return "about AckWait after: " + "; ".join(parts) if parts else "no fault or worker exit one AckWait before"


def holder_context(ev: Evidence, holders: list[Handout], culprits: list[Fault]) -> str:
    """Who held the delivery that never started, what touched it, and when it exited."""
    parts = []
    for h in holders:
        life = ev.lives.get(h.pid)
        exited = (f", pid {h.pid} gone from its supervisor's workers +{life.died - ev.origin:.2f}s (an exit, or "
                  "its parent's death)" if life and life.died is not None else "")
        parts.append(h.held(ev.origin) + exited)
    touched = "; ".join(f.name(ev.origin) for f in culprits[:4]) or "no fault touched it"
    return f"{'; '.join(parts)}; touched by: {touched}"


def named_at_death(names: dict, seq: int, before: list[RunOfJob], run: RunOfJob, holder: int = 0,
                   unchecked: list[dict] | None = None) -> str:
    """Why a supervisor's ledger said, at a worker's death, that this redelivery would wait for
    AckWait (F10), or "": the previous run's own delivery and pid must be the ones it named, and
    this run the very next delivery; when the delivery before this one never started (NAKed
    unstarted by a drain), its number alone (no run to take a pid from). A delivery that never
    started and was handed to worker `holder` (the proxy saw it written to that pid; 0: not
    known) may also be named by the supervisor's last /status before its SIGKILL, as in transit
    to a dead worker whose in-transit check had not run (`unchecked_at_kill`)."""
    named = names.get((seq, run.delivery - 1), {})
    if before and before[-1].delivery == run.delivery - 1:
        return named.get(before[-1].pid, "")
    return next(iter(named.values()), "") or unchecked_at_kill(unchecked or [], seq, run.delivery - 1, holder)


def unchecked_at_kill(unchecked: list[dict], seq: int, delivery: int, holder: int) -> str:
    """Why `delivery` of job `seq`, handed to worker `holder` and never started, waited for
    AckWait, or "": its supervisor was SIGKILLed while `holder`'s death had its in-transit check
    still to run (`Evidence.in_transit_unchecked`, the supervisor's last /status), so nothing
    could NAK it and nothing names it since. Only a first delivery, and only inside the window
    that check would have searched as far as the supervisor knew it (stream seq above
    `after_seq`, at most `up_to_seq`; an unknown bound does not narrow it): a redelivery on a
    dead worker's wire is another check's (its seq is below any such window). And only while
    what held the check up was NATS (away, a request that failed, peers not heard yet), or the
    death came moments before the kill (UNCHECKED_FRESH): a round waiting on its own workers for
    long is the supervisor's to answer for."""
    if delivery != 1 or not holder:
        return ""
    for u in unchecked:
        lo, hi = u.get("after_seq"), u.get("up_to_seq")
        if int(u["pid"]) != holder or (lo is not None and seq <= lo) or (hi is not None and seq > hi):
            continue
        if not (u.get("why", "").startswith(NATS_OBSTACLES) or u.get("age_s", UNCHECKED_FRESH) < UNCHECKED_FRESH):
            continue                    # a round the supervisor itself held up is its own to answer for
        window = f"seq {'?' if lo is None else lo + 1}..{'?' if hi is None else hi}"
        return (f"delivery {delivery} was in transit to pid {holder} at its death, whose in-transit check "
                f"({window}) had not run when its supervisor was SIGKILLed ({u.get('why', '')})")
    return ""


def first_copy(seq: int, keys: dict[int, str], copies: set[int]) -> int:
    """The first copy for later made of job `seq` (0: none): a copy at a higher sequence with its
    key (a copy of a copy too)."""
    key = keys.get(seq)
    return min((s for s in copies if s > seq and keys.get(s) == key), default=0)


def copy_dups(runs: dict[int, list[RunOfJob]], keys: dict[int, str], copies: set[int]) -> list[tuple[str, set[int]]]:
    """(key, its completed seqs) of each key completed under a job and again under a copy of it."""
    done: dict[str, set[int]] = defaultdict(set)
    for seq, rs in runs.items():
        if any(r.done is not None for r in rs):
            done[keys.get(seq, "")].add(seq)
    return [(key, seqs) for key, seqs in done.items() if len(seqs) > 1 and seqs & copies and seqs - copies]


def check(ev: Evidence) -> Report:
    return Checker(ev).check()
