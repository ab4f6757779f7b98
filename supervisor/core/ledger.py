"""The crash ledger: what every dead worker held, and the proof that each job came back.

Pure bookkeeping, no I/O: the arbiter feeds it deaths (with the slot-table entries the worker
held), the workers' rare events (a redelivery seen, a non-ack outcome) and the consumer's ack
floor, and it answers three questions:
  - did every job held at a death come back and get acked? (`outstanding`)
  - which redeliveries does nothing explain? (AckWait shorter than the jobs, usually)
  - which job keeps killing workers? (poison)
Every redelivery is explained by something the ledger can name: a death (held, or pulled and
still in transit), a NAK from a handler or a drain, a whole supervisor lost (the jobs its last
fleet heartbeat listed, and a window with a count for those it took after it), or nothing
(unexplained).
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from supervisor.core.policy import ack_wait_for

EXPECT_LIMIT = 100_000      # remembered NAKs (a bound, not a window: they are few)
HISTORY = 200               # deaths and unexplained redeliveries kept for /status
LOST_PEER = "held by lost supervisor "      # how a lost fleet peer's held jobs are explained
FOUND_IN_TRANSIT = "in transit to "         # how the in-transit check's NAKs are explained (in_transit_naked)
HOLD_MAX = 30.0             # a suspect is held back for a silent fleet peer at most this long past its grace
# Why a dead worker's settled job is not NAKed by the parent, so waits for AckWait (F10): named at
# the death, by what the worker had sent (its Settled event), and the redelivery explained by it.
NAK_UNSENT = "its NAK was unsent when the worker died; a second NAK could land on the next holder"
TERM_UNSENT = ("its TERM was unsent when the worker died; not NAKed: the TERM could still land on the next "
               "holder, and a NAK would rerun a job its handler rejected")
SETTLE_UNSENT = "its NAK or TERM was unsent when the worker died; a NAK could land on the next holder"
# F18: a NAK not yet fenced at the death that the server had read all the same (its MSG_NAKED
# advisory came): its redelivery comes at once, unless it went to the dead worker's own pull
# request; the in-transit check NAKs that one once no live worker can hold it (in_transit.py).
NAK_READ = ("its NAK, not fenced when the worker died, had been read by the server (its MSG_NAKED advisory): "
            "back at once, or, if its redelivery was on the dead worker's wire, once the supervisor NAKs that "
            "(else after AckWait)")
NAK_READ_NAKED = ("its NAK, not fenced when the worker died, had been read by the server (its MSG_NAKED advisory), "
                  "and its redelivery, on the wire to a dead worker, was found and NAKed by the supervisor")
COUNTERS = ("crashes", "crashes_holding_jobs", "jobs_held_at_crash", "held_jobs_naked", "held_jobs_redelivered",
            "held_jobs_acked_after_crash", "unexplained_redeliveries", "explained_redeliveries",
            "in_transit_redeliveries", "in_transit_naked", "quarantined", "lost_peer_redeliveries",
            "leader_move_redeliveries", "acks_resent", "acks_resent_confirmed", "acks_resent_unconfirmed",
            "held_jobs_left_to_ack_wait")      # /status crosscheck: all of them (CONTRACT.md names the first eight)


@dataclass
class HeldJob:
    seq: int
    delivery: int
    state: str                  # held | running | acked (ack in doubt) | settled
    naked: bool                 # the parent sent -NAK for it at the death
    timer: float | None = None  # when its AckWait timer last started (held, or our last +WPI)
    redelivered_at: float | None = None
    acked_at: float | None = None
    resolved: str = ""          # "" while outstanding; else how it was settled
    # Named at the death: why its redelivery comes after AckWait (or sooner, if what the worker
    # sent lands after all), when the parent does not NAK it (F10). "" for a job NAKed at once.
    waits: str = ""

    def as_dict(self, death: Death, now: float) -> dict:
        return {"stream_seq": self.seq, "delivery": self.delivery, "state_at_death": self.state,
                "naked": self.naked, "death": death.id, "slot": death.slot, "pid": death.pid,
                "cause": death.cause, "age_s": round(now - death.t, 3),
                "redelivered": self.redelivered_at is not None}

    def fate(self, died_at: float) -> dict:
        """What became of this job after the death: came back (redelivered) and acked, in
        seconds after it; `resolved` names how it was settled ("ack", "term", "below ack floor",
        "quarantined", ...; "" while outstanding)."""
        def after(t: float | None) -> float | None:
            return None if t is None else round(t - died_at, 3)
        return {"stream_seq": self.seq, "delivery": self.delivery, "state_at_death": self.state,
                "naked": self.naked, "came_back_after_s": after(self.redelivered_at),
                "acked_after_s": after(self.acked_at) if self.resolved == "ack" else None,
                "resolved": self.resolved, **({"waits": self.waits} if self.waits else {})}


@dataclass
class Death:
    id: int
    t: float
    slot: int
    pid: int
    cause: str
    held: list[HeldJob]
    in_transit: int             # pull credits outstanding: messages maybe on the wire
    attributed: int = 0         # redeliveries later explained as in transit at this death
    # The dead worker had read everything delivered before this (its last PING answered): what
    # was on its wire was delivered after it, so its AckWait ran out after it (F6: a SIGSTOPped
    # worker dies heartbeat_timeout after it stopped reading).
    in_transit_since: float | None = None
    # The consumer's delivered stream sequence at the first ConsumerInfo after the death: a
    # message in transit at the death had been delivered, so its sequence is at most this.
    delivered_bound: int | None = None
    # A peer supervisor's worker (F13): "<its origin>#<its death id>"; "" for a worker of ours.
    key: str = ""
    crash: bool = True          # False: a clean exit that gave up a live pull request (F20)

    def where(self) -> str:
        """Whose worker: "" for ours, " (on <origin>)" for a peer's."""
        return f" (on {self.key.rsplit('#', 1)[0]})" if self.key else ""

    def summary(self, now: float) -> dict:
        """`held` lists the seqs; `held_jobs` says per job when it came back and when it was
        acked, in seconds after this death (None: not yet, or not seen by this supervisor)."""
        return {"id": self.id, "slot": self.slot, "pid": self.pid, "cause": self.cause, "age_s": round(now - self.t, 3),
                "held": [h.seq for h in self.held], "in_transit": self.in_transit, "crash": self.crash,
                "held_jobs": [h.fate(self.t) for h in self.held]}


@dataclass
class Redelivery:
    t: float
    seq: int
    delivery: int
    why: str                    # explanation, or "unexplained"


@dataclass
class Window:
    """Redeliveries due between `start` and `end` (monotonic), at most `budget` of them, are
    explained by `why`, and counted under `counter`: the jobs a lost supervisor took after its
    last heartbeat, or jobs whose acks a consumer leader move may have swallowed."""
    start: float
    end: float
    budget: int
    why: str
    counter: str = "lost_peer_redeliveries"

    def covers(self, t: float) -> bool:
        return self.budget > 0 and self.start <= t <= self.end


@dataclass
class CrashLedger:
    """Long because every explanation of a redelivery is weighed against the others in one place
    (the order of `_explain`, the suspects' grace, the counters /status cross-checks)."""
    ack_wait: float
    poison_after: int
    backoff: tuple[float, ...] = ()         # consumer.backoff: AckWait per delivery when set
    deaths: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    unexplained: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    counts: dict = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    waits: deque = field(default_factory=lambda: deque(maxlen=HISTORY))    # (Death, HeldJob) left to AckWait

    def __post_init__(self) -> None:
        self._inherited_up_to = 0       # stream seqs pending (delivered, unacked) when we started ...
        self._inherited_left = 0        # ... and how many of their redeliveries that can explain
        self._ids = itertools.count(1)
        self._open: dict[int, list[tuple[Death, HeldJob]]] = {}      # seq -> held jobs not yet resolved
        self._expected: OrderedDict[int, str] = OrderedDict()        # seq -> why it will come back
        self._fatal: dict[int, list[Death]] = {}                     # seq -> deaths it caused (ran alone, or named)
        self._probation: dict[int, list[Death]] = {}                 # seq -> deaths it ran at beside others
        self._suspects: dict[tuple[int, int], float] = {}            # (seq, delivery) -> seen, unexplained so far
        self.quarantined: dict[int, list[Death]] = {}
        self._windows: deque[Window] = deque(maxlen=HISTORY)
        self.cluster_explained: deque[Redelivery] = deque(maxlen=HISTORY)
        self._hold_until = 0.0                                      # see hold_suspects
        self._settles: OrderedDict[int, tuple[int, str]] = OrderedDict()  # seq -> (delivery, "nak"|"term"|"nak read")
        self.peer_deaths: deque[Death] = deque(maxlen=HISTORY)       # a peer's workers dead with messages in transit
        self.attributions: list[int | str] = []     # deaths (our id, a peer's key) we explained a redelivery by: for peers

    # ------------------------------------------------------------ inputs

    def record_death(self, t: float, slot: int, pid: int, cause: str, held: Sequence[tuple],
                     in_transit: int = 0, job_to_blame: bool = True, blame: int | None = None,
                     in_transit_since: float | None = None, crash: bool = True) -> Death:
        """`held`: (stream seq, delivery, entry state, NAKed by the parent[, its AckWait timer's start]) per
        entry; a settled one not NAKed gets why it waits for AckWait (F10). `job_to_blame`: False when the
        supervisor ended the worker (SIGQUIT, a drain past its deadline). `blame`: the job a cause names.
        `crash`: False for a clean exit that left messages in transit (a pull request given up, F20)."""
        death = Death(next(self._ids), t, slot, pid, cause, [HeldJob(*h) for h in held], in_transit,
                      in_transit_since=in_transit_since or None, crash=crash)
        self.deaths.append(death)
        self.counts["crashes"] += crash
        if death.held:
            self.counts["crashes_holding_jobs"] += 1
        for job in death.held:
            self.counts["jobs_held_at_crash"] += 1
            self.counts["held_jobs_naked"] += job.naked
            self._open.setdefault(job.seq, []).append((death, job))
            if job.state == "settled" and not job.naked:
                job.waits = unsent(self._settles.get(job.seq), job.delivery)
                self.waits.append((death, job))
                self.counts["held_jobs_left_to_ack_wait"] += 1
        if job_to_blame:
            self._weigh(death, blame)
        return death

    def _weigh(self, death: Death, blame: int | None) -> None:
        """Poison evidence (R7): a death is evidence against a job only when it names that job (a
        job_timeout kill) or that job ran alone; with several running, each of them is put on
        probation instead (workers/runtime/solo.py runs it alone next time), and none is blamed."""
        running = sorted({job.seq for job in death.held if job.state == "running"})
        if blame is None and len(running) == 1:
            blame = running[0]
        if blame is not None:
            self._fatal.setdefault(blame, []).append(death)
            self._probation.pop(blame, None)
            return
        for seq in running:
            self._probation.setdefault(seq, []).append(death)

    def expect(self, seq: int, why: str, delivery: int = 0, retroactive: bool = True) -> bool:
        """A NAK (handler failure, Retry, drain, a peer's dead worker): the next delivery of
        `seq` is explained. A redelivery already seen and held as a suspect is explained now
        (returns True), unless `retroactive` is False: what happened after it cannot be its cause
        (a worker's ack refused after the job had already come back to another worker)."""
        late = sorted(d for s, d in self._suspects if s == seq and d > delivery) if retroactive else []
        if late:                            # a NAK of delivery N explains only deliveries after N
            t = self._suspects.pop((seq, late[0]))
            self.counts["explained_redeliveries"] += 1
            if why.startswith(LOST_PEER):
                self._by_the_cluster(t, seq, late[0], why, "lost_peer_redeliveries")
            self.counts["in_transit_redeliveries"] += why.startswith(FOUND_IN_TRANSIT)
            return True
        self._expected[seq] = why
        self._expected.move_to_end(seq)
        while len(self._expected) > EXPECT_LIMIT:
            self._expected.popitem(last=False)
        return False

    def redelivered(self, t: float, seq: int, delivery: int) -> str:
        """A worker received `seq` with delivery > 1. Returns the explanation, or "" when nothing
        explains it yet: it stays a suspect until `confirm_suspects`, because a peer supervisor's
        word about the NAK may arrive a moment after the redelivery it caused."""
        why = self._explain(t, seq, delivery)
        if why == "unexplained":
            self._suspects[(seq, delivery)] = t
            return ""
        self.counts["explained_redeliveries"] += 1
        return why

    def hold_suspects(self, until: float) -> None:
        """A fleet peer is silent but not yet declared lost: a redelivery of a job it held would
        be explained once it is. Until `until` (renewed while the peer stays silent), suspects
        wait, up to HOLD_MAX past their grace."""
        self._hold_until = max(self._hold_until, until)

    def expect_window(self, start: float, end: float, budget: int, why: str,
                      counter: str = "lost_peer_redeliveries") -> None:
        """Up to `budget` redeliveries due between `start` and `end` are explained by `why`,
        including suspects already waiting."""
        window = Window(start, end, budget, why, counter)
        self._windows.append(window)
        for (seq, d), t in sorted(self._suspects.items(), key=lambda item: item[1]):
            if window.covers(t):
                del self._suspects[(seq, d)]
                window.budget -= 1
                self.counts["explained_redeliveries"] += 1
                self._by_the_cluster(t, seq, d, why, counter)

    def _by_the_cluster(self, t: float, seq: int, delivery: int, why: str, counter: str) -> None:
        """A redelivery explained by a lost supervisor or a consumer leader move: counted under
        `counter` and kept in `recent_cluster_explained` (/status says which jobs and why)."""
        self.counts[counter] += 1
        self.cluster_explained.append(Redelivery(t, seq, delivery, why))

    def confirm_suspects(self, now: float, grace: float, caught_up: float = math.inf) -> list[Redelivery]:
        """Suspects older than `grace` nothing explained: unexplained, unless pending before we started (the
        weakest explanation). Up to HOLD_MAX past the grace they wait while a fleet peer is silent
        (`hold_suspects`), or if seen after `caught_up`: a peer's word may not be here yet (F13, peers.py)."""
        held = now < self._hold_until
        due = [(seq, d, t) for (seq, d), t in self._suspects.items()
               if now - t >= grace and (now - t >= grace + HOLD_MAX or (not held and t <= caught_up))]
        confirmed = []
        for seq, d, t in due:
            del self._suspects[(seq, d)]
            if seq <= self._inherited_up_to and self._inherited_left > 0:
                self._inherited_left -= 1
                self.counts["explained_redeliveries"] += 1
                continue
            self.counts["unexplained_redeliveries"] += 1
            self.unexplained.append(Redelivery(t, seq, d, "unexplained"))
            confirmed.append(self.unexplained[-1])
        return confirmed

    def _mark_redelivered(self, t: float, seq: int, delivery: int) -> list[tuple[Death, HeldJob]]:
        held = [(d, j) for d, j in self._open.get(seq, ()) if delivery > j.delivery and j.redelivered_at is None]
        for _, job in held:
            job.redelivered_at = t
            self.counts["held_jobs_redelivered"] += 1
        return held

    def redelivered_elsewhere(self, t: float, seq: int, delivery: int) -> None:
        """A peer supervisor's worker received `seq` again: our held job came back there (the
        peer's ledger says whether it was explained)."""
        self._mark_redelivered(t, seq, delivery)

    def awaiting_redelivery(self, seq: int, delivery: int) -> bool:
        """A job a dead worker held at `delivery`, NAKed, not seen again anywhere yet."""
        return any(j.delivery == delivery and j.redelivered_at is None for _, j in self._open.get(seq, ()))

    def _explain(self, t: float, seq: int, delivery: int) -> str:
        held = self._mark_redelivered(t, seq, delivery)
        if held:
            self._expected.pop(seq, None)   # a NAK sent before the death explains this same redelivery
            death, job = held[-1]
            why = f"held by worker {death.slot} (pid {death.pid}) at its death ({death.cause})"
            return f"{why}: {job.waits}" if job.waits else why
        if seq in self._expected:
            why = self._expected.pop(seq)
            if why.startswith(LOST_PEER):
                self._by_the_cluster(t, seq, delivery, why, "lost_peer_redeliveries")
            # Found and NAKed in transit: a crash redelivery, so held + in transit counts every one (item 7).
            self.counts["in_transit_redeliveries"] += why.startswith(FOUND_IN_TRANSIT)
            return why
        # A lost supervisor's unlisted jobs all come back; acks a leader move swallowed only may
        # have: where both windows cover a redelivery, the lost supervisor is the better bet.
        for window in sorted(self._windows, key=lambda w: w.counter != "lost_peer_redeliveries"):
            if window.covers(t):
                window.budget -= 1
                self._by_the_cluster(t, seq, delivery, window.why, window.counter)
                return window.why
        return self._attribute_in_transit(t, seq)

    def inherit(self, num_ack_pending: int, delivered_stream_seq: int) -> None:
        """The consumer at our start: `num_ack_pending` deliveries made before we existed (a
        previous run's drain NAKs, another process's jobs) whose redeliveries we will see."""
        self._inherited_left, self._inherited_up_to = num_ack_pending, delivered_stream_seq

    def delivered_seen(self, t: float, delivered_stream_seq: int) -> None:
        """A ConsumerInfo taken at `t`: bounds what deaths before it can have had in transit."""
        for deaths in (self.deaths, self.peer_deaths):
            for death in reversed(deaths):
                if death.delivered_bound is not None:
                    break
                if death.t <= t:
                    death.delivered_bound = delivered_stream_seq

    def peer_death(self, death: Death) -> None:
        """A peer supervisor's worker died with messages maybe in transit (its pull credits), and
        with a peer on the consumer they wait for AckWait: their redeliveries may come here (F13)."""
        self.peer_deaths.append(death)

    def attributed_elsewhere(self, ref: int | str) -> None:
        """A peer explained a redelivery as in transit at death `ref` (our id, or a peer's key): one
        credit of that death spent, so the ledgers together explain no more than its credits."""
        for death in [*self.deaths, *self.peer_deaths]:
            if (death.key or death.id) == ref:
                death.attributed += 1
                return

    def _attribute_in_transit(self, t: float, seq: int) -> str:
        """A message pulled by a worker that died before recording it comes back after AckWait
        (first delivery: that is what was on the wire), within the death's credits, and only if
        the consumer had delivered it by the death."""
        ack_wait = ack_wait_for(self.ack_wait, self.backoff, 1)
        for death in [*reversed(self.deaths), *reversed(self.peer_deaths)]:
            first_due, due = min(death.t, death.in_transit_since or death.t) + ack_wait, death.t + ack_wait
            in_range = death.delivered_bound is None or seq <= death.delivered_bound
            if death.attributed < death.in_transit and in_range and first_due - 1.0 <= t <= due + max(5.0, ack_wait):
                death.attributed += 1
                self.attributions.append(death.key or death.id)
                self.counts["in_transit_redeliveries"] += 1
                return f"in transit to worker {death.slot} (pid {death.pid}) at its death ({death.cause}){death.where()}"
        return "unexplained"

    def settled(self, t: float, seq: int, delivery: int, outcome: str) -> None:
        """A worker acked, NAKed or terminated `seq` at `delivery`."""
        self._probation.pop(seq, None)      # it ran to an outcome: it did not kill its worker
        self._settles.pop(seq, None)        # what it sent last, for a death before its fence (unsent)
        if outcome in ("nak", "term"):
            self._settles[seq] = (delivery, outcome)
            while len(self._settles) > EXPECT_LIMIT:
                self._settles.popitem(last=False)
        if outcome == "nak":
            self.expect(seq, f"NAKed at delivery {delivery}", delivery)
            return
        self._expected.pop(seq, None)
        self._fatal.pop(seq, None)
        for _death, job in self._open.pop(seq, ()):
            job.acked_at = t
            job.resolved = outcome
            if outcome == "ack":
                self.counts["held_jobs_acked_after_crash"] += 1

    def acks_resent(self, resent: int, confirmed: int, unconfirmed: list[int], why: str) -> None:
        """A worker sent `resent` recent acks again after a consumer leader change (workers/runtime/reack.py)
        and the leader confirmed `confirmed` of them: those cannot come back. The jobs of
        `unconfirmed` may run again, and that is why."""
        self.counts["acks_resent"] += resent
        self.counts["acks_resent_confirmed"] += confirmed
        self.counts["acks_resent_unconfirmed"] += len(unconfirmed)
        for seq in unconfirmed:
            self.expect(seq, f"its ack may have been lost in a consumer leader change ({why}): sent again, never confirmed")

    def ack_floor(self, stream_seq: int) -> None:
        """Everything at or below the consumer's ack floor is settled, by whoever settled it
        (an ack that was in doubt at a death, another host's worker, a TERM)."""
        for seq in [s for s in self._open if s <= stream_seq]:
            for _, job in self._open.pop(seq):
                job.resolved = job.resolved or "below ack floor"
        for seq in [s for s in self._fatal if s <= stream_seq]:
            del self._fatal[seq]
        for seq in [s for s in self._probation if s <= stream_seq]:
            del self._probation[seq]

    def in_transit_naked(self, seq: int, why: str) -> None:
        """The supervisor found and NAKed a message in transit to a dead worker (reconciliation);
        `why` starts with FOUND_IN_TRANSIT, so its redelivery counts in in_transit_redeliveries,
        unless a death held the job: its redelivery is that death's, and says so (F18)."""
        self.counts["in_transit_naked"] += 1
        self.expect(seq, why)
        for _, job in self._open.get(seq, ()):
            if job.waits == NAK_READ and job.redelivered_at is None:
                job.waits = NAK_READ_NAKED

    def nak_read(self, seq: int, delivery: int) -> None:
        """The server's MSG_NAKED advisory showed it had read a worker's NAK of `seq` at `delivery`
        that the worker's table still held at its death (F18): said before the death is recorded,
        or after it, when the advisory came later."""
        if self._settles.get(seq) == (delivery, "nak"):
            self._settles[seq] = (delivery, "nak read")
        for _, job in self._open.get(seq, ()):
            if job.delivery == delivery and job.waits == NAK_UNSENT and job.redelivered_at is None:
                job.waits = NAK_READ

    def expecting(self, seq: int) -> bool:
        """A redelivery of `seq` is already explained in advance (a NAK we know of)."""
        return seq in self._expected or seq in self._open

    def resolve(self, seq: int, how: str) -> None:
        """Settled by evidence other than a worker's report (e.g. a work-queue message that is gone)."""
        for _, job in self._open.pop(seq, ()):
            job.resolved = how

    def in_doubt(self) -> list[int]:
        """Held jobs whose ack was sent but not confirmed at the death, not seen since."""
        return [seq for seq, jobs in self._open.items()
                if all(j.state == "acked" and j.redelivered_at is None for _, j in jobs)]

    def quarantine(self, seq: int) -> list[Death]:
        """The job was dead-lettered and TERMed (not before: a failed quarantine keeps its evidence)."""
        deaths = self._fatal.pop(seq, [])
        self._probation.pop(seq, None)
        self.quarantined[seq] = deaths
        self.counts["quarantined"] += 1
        for _, job in self._open.pop(seq, ()):
            job.resolved = "quarantined"
        return deaths

    # ------------------------------------------------------------ questions

    def is_poison(self, seq: int) -> bool:
        return seq not in self.quarantined and len(self._fatal.get(seq, ())) >= self.poison_after

    def deaths_of(self, seq: int) -> list[Death]:
        return list(self._fatal.get(seq, ()))

    def on_probation(self) -> list[int]:
        """Jobs running at a death beside others, not yet run alone: to run alone (workers/runtime/solo.py)."""
        return [seq for seq in self._probation if seq not in self.quarantined]

    def outstanding(self, now: float) -> list[dict]:
        return [job.as_dict(death, now) for jobs in self._open.values() for death, job in jobs]

    def crosscheck(self, now: float) -> dict:
        out = dict(self.counts)
        out["left_to_ack_wait"] = [left_row(death, job, ack_wait_for(self.ack_wait, self.backoff, job.delivery))
                                   for death, job in self.waits]
        out["outstanding"], out["suspects"] = self.outstanding(now), len(self._suspects)   # suspects: not judged yet
        out["recent_deaths"] = [d.summary(now) for d in list(self.deaths)[-10:]]
        out["recent_cluster_explained"] = [{"stream_seq": r.seq, "delivery": r.delivery, "why": r.why,
                                            "age_s": round(now - r.t, 3)} for r in list(self.cluster_explained)[-20:]]
        out["recent_unexplained"] = [{"stream_seq": r.seq, "delivery": r.delivery, "age_s": round(now - r.t, 3)}
                                     for r in list(self.unexplained)[-10:]]
        return out


def unsent(said: tuple[int, str] | None, delivery: int) -> str:
    """Why a dead worker's settled entry (`delivery`) waits for AckWait, by what its worker said
    it sent for the job last (`said`: its delivery and "nak" or "term")."""
    if said is None or said[0] != delivery:
        return SETTLE_UNSENT                # its Settled event never came (a full event pipe)
    return {"nak": NAK_UNSENT, "nak read": NAK_READ}.get(said[1], TERM_UNSENT)


def left_row(death: Death, job: HeldJob, ack_wait: float) -> dict:
    """A job a death left to AckWait, for /status: why (named at the death), when its AckWait
    runs out (seconds after the death; None when its timer's start is unknown), what became of it."""
    due = None if job.timer is None else round(job.timer + ack_wait - death.t, 3)
    return {**job.fate(death.t), "death": death.id, "slot": death.slot, "pid": death.pid, "cause": death.cause,
            "due_after_s": due}
