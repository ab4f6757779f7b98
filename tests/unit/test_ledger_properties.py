"""Property-based test of supervisor/core/ledger.py: the crash ledger against a model of the truth.

Hypothesis drives random interleavings of what the arbiter feeds the ledger (deaths holding
random jobs in random states, redeliveries, handler and peer NAKs, acks, TERMs, ack floors,
ConsumerInfo polls, what was pending at start, quarantines, the passage of time) and checks
after every step that:
  - every redelivery of a job held at a death (and not yet seen back) is explained by it;
  - a redelivery after a NAK is explained by the NAK, once;
  - `outstanding` lists exactly the held jobs nothing has resolved;
  - the counts add up (every redelivery is explained, unexplained, or still a suspect) and
    match the model; a death is blamed for a job in transit only within its credits and only
    if the consumer had delivered that job by then; poison and "ack in doubt" are what the
    model says.
Pure and fast: times are plain numbers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from supervisor.core.ledger import CrashLedger

ACK_WAIT = 30.0
POISON = 2
STATES = ("held", "running", "acked", "settled")


@dataclass
class Held:
    death: int
    seq: int
    delivery: int
    state: str
    naked: bool
    redelivered: bool = False
    resolved: bool = False


@dataclass
class DeathModel:
    id: int
    t: float
    in_transit: int
    attributed: int = 0
    bound: int | None = None            # the consumer's delivered stream seq seen after the death


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.led = CrashLedger(ack_wait=ACK_WAIT, poison_after=POISON)
        self.t = 1000.0
        self.next_seq = 1
        self.delivery: dict[int, int] = {}          # seq -> latest delivery handed to a worker
        self.live: set[int] = set()                 # seqs a live worker holds
        self.held: list[Held] = []
        self.deaths: list[DeathModel] = []
        self.naks: dict[int, str] = {}              # seq -> the NAK that explains its next delivery
        self.suspects: dict[tuple[int, int], float] = {}
        self.fatal: dict[int, int] = defaultdict(int)
        self.quarantined: set[int] = set()
        self.inherited_up_to = self.inherited_left = 0
        self.calls = self.explained = self.unexplained = self.in_transit = self.acked_after = 0

    # ------------------------------------------------------------ the world moves

    @rule(n=st.integers(1, 3))
    def deliver_new_jobs(self, n: int) -> None:
        for _ in range(n):
            self.delivery[self.next_seq] = 1
            self.live.add(self.next_seq)
            self.next_seq += 1

    @rule(dt=st.floats(0.001, 12.0))
    def time_passes(self, dt: float) -> None:
        self.t += dt

    @rule(data=st.data(), in_transit=st.integers(0, 3))
    def worker_dies(self, data: st.DataObject, in_transit: int) -> None:
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, max_size=4)) if self.live else []
        held = [(s, self.delivery[s], data.draw(st.sampled_from(STATES)), data.draw(st.booleans())) for s in seqs]
        death = self.led.record_death(self.t, 0, 100 + len(self.deaths), "SIGKILL", held, in_transit=in_transit)
        self.deaths.append(DeathModel(death.id, self.t, in_transit))
        for seq, delivery, state, naked in held:
            self.held.append(Held(death.id, seq, delivery, state, naked))
            self.live.discard(seq)
        running = {seq for seq, _, state, _ in held if state == "running"}
        if len(running) == 1:             # evidence against a job: it ran alone (several: none is blamed)
            self.fatal[running.pop()] += 1

    @precondition(lambda self: self.delivery)
    @rule(data=st.data())
    def redelivered(self, data: st.DataObject) -> None:
        """The server hands a job out again (after a death, a NAK, or for no reason we know)."""
        seq = data.draw(st.sampled_from(sorted(self.delivery)))
        d = self.delivery[seq] + 1
        self.delivery[seq] = d
        self.live.add(seq)
        self.calls += 1
        why = self.led.redelivered(self.t, seq, d)
        back = [h for h in self.held if h.seq == seq and not h.resolved and not h.redelivered and d > h.delivery]
        if back:
            assert why.startswith("held by worker"), (seq, d, why)
            for h in back:
                h.redelivered = True
            self.naks.pop(seq, None)
            self.explained += 1
        elif seq in self.naks:
            assert why == self.naks.pop(seq), (seq, d, why)
            self.explained += 1
        elif self.attribute_in_transit(seq):
            assert why.startswith("in transit to worker"), (seq, d, why)
            self.explained += 1
            self.in_transit += 1
        else:
            assert why == "", (seq, d, why)
            self.suspects[(seq, d)] = self.t

    def attribute_in_transit(self, seq: int) -> bool:
        """The ledger's rule: the latest death whose in-transit budget is not spent, whose AckWait
        is (about) up now and which the consumer had delivered `seq` by, takes the blame."""
        for death in reversed(self.deaths):
            due = death.t + ACK_WAIT
            in_range = death.bound is None or seq <= death.bound
            if death.attributed < death.in_transit and in_range and due - 1.0 <= self.t <= due + max(5.0, ACK_WAIT):
                death.attributed += 1
                return True
        return False

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def worker_naks(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.live)))
        self.live.discard(seq)
        self.nak(seq, self.delivery[seq])

    @precondition(lambda self: any(d > 1 for d in self.delivery.values()))
    @rule(data=st.data())
    def late_nak_from_a_peer(self, data: st.DataObject) -> None:
        """A peer's word that it NAKed the previous delivery, arriving after the redelivery."""
        seq = data.draw(st.sampled_from(sorted(s for s, d in self.delivery.items() if d > 1)))
        self.nak(seq, self.delivery[seq] - 1)

    def nak(self, seq: int, delivery: int) -> None:
        self.led.settled(self.t, seq, delivery, "nak")
        late = sorted(d for s, d in self.suspects if s == seq and d > delivery)
        if late:
            del self.suspects[(seq, late[0])]
            self.explained += 1
        else:
            self.naks[seq] = f"NAKed at delivery {delivery}"

    @precondition(lambda self: self.live)
    @rule(data=st.data(), outcome=st.sampled_from(["ack", "term"]))
    def worker_settles(self, data: st.DataObject, outcome: str) -> None:
        seq = data.draw(st.sampled_from(sorted(self.live)))
        self.live.discard(seq)
        self.led.settled(self.t, seq, self.delivery[seq], outcome)
        self.naks.pop(seq, None)
        self.fatal.pop(seq, None)
        for h in self.held:
            if h.seq == seq and not h.resolved:
                h.resolved = True
                self.acked_after += outcome == "ack"

    @precondition(lambda self: self.delivery)
    @rule(data=st.data())
    def ack_floor(self, data: st.DataObject) -> None:
        floor = data.draw(st.integers(0, max(self.delivery)))
        self.led.ack_floor(floor)
        for h in self.held:
            if h.seq <= floor:
                h.resolved = True
        for seq in [s for s in self.fatal if s <= floor]:
            del self.fatal[seq]

    @precondition(lambda self: any(not h.resolved for h in self.held))
    @rule(data=st.data())
    def resolved_by_evidence(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted({h.seq for h in self.held if not h.resolved})))
        self.led.resolve(seq, "acked before the death (message gone)")
        for h in self.held:
            if h.seq == seq:
                h.resolved = True

    @rule(data=st.data())
    def consumer_info(self, data: st.DataObject) -> None:
        """A ConsumerInfo poll: what the consumer had delivered bounds what the deaths before it
        can have had in transit (issue 9 point 8)."""
        delivered = data.draw(st.integers(0, self.next_seq))
        self.led.delivered_seen(self.t, delivered)
        for death in reversed(self.deaths):
            if death.bound is not None:
                break
            if death.t <= self.t:
                death.bound = delivered

    @rule(pending=st.integers(0, 4), data=st.data())
    def inherit(self, pending: int, data: st.DataObject) -> None:
        """What the consumer had pending when this supervisor started (a previous run's drain)."""
        up_to = data.draw(st.integers(0, self.next_seq))
        self.led.inherit(pending, up_to)
        self.inherited_left, self.inherited_up_to = pending, up_to

    @rule(grace=st.sampled_from([0.0, 2.0]))
    def confirm_suspects(self, grace: float) -> None:
        confirmed = self.led.confirm_suspects(self.t, grace)
        unexplained = set()
        for seq, d in sorted((k for k, t in self.suspects.items() if self.t - t >= grace),
                             key=lambda k: self.suspects[k]):
            del self.suspects[(seq, d)]
            if seq <= self.inherited_up_to and self.inherited_left > 0:
                self.inherited_left -= 1         # pending before we started: the weakest explanation
                self.explained += 1
            else:
                unexplained.add((seq, d))
        assert {(r.seq, r.delivery) for r in confirmed} == unexplained
        self.unexplained += len(unexplained)

    @precondition(lambda self: any(self.is_poison(s) for s in self.fatal))
    @rule(data=st.data())
    def quarantine(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(s for s in self.fatal if self.is_poison(s))))
        deaths = self.led.quarantine(seq)
        assert len(deaths) == self.fatal.pop(seq)
        self.quarantined.add(seq)
        for h in self.held:
            if h.seq == seq:
                h.resolved = True

    def is_poison(self, seq: int) -> bool:
        return seq not in self.quarantined and self.fatal.get(seq, 0) >= POISON

    # ------------------------------------------------------------ what must always hold

    @invariant()
    def outstanding_is_exactly_the_unresolved_held_jobs(self) -> None:
        got = sorted((o["stream_seq"], o["death"], o["redelivered"]) for o in self.led.outstanding(self.t))
        assert got == sorted((h.seq, h.death, h.redelivered) for h in self.held if not h.resolved)

    @invariant()
    def counts_match_the_model(self) -> None:
        c = self.led.crosscheck(self.t)
        assert c["crashes"] == len(self.deaths)
        assert c["crashes_holding_jobs"] == len({h.death for h in self.held})
        assert c["jobs_held_at_crash"] == len(self.held)
        assert c["held_jobs_naked"] == sum(h.naked for h in self.held)
        assert c["held_jobs_redelivered"] == sum(h.redelivered for h in self.held)
        assert c["held_jobs_acked_after_crash"] == self.acked_after
        assert c["explained_redeliveries"] == self.explained
        assert c["unexplained_redeliveries"] == self.unexplained
        assert c["in_transit_redeliveries"] == self.in_transit
        assert c["quarantined"] == len(self.quarantined)

    @invariant()
    def every_redelivery_is_accounted_for(self) -> None:
        c = self.led.counts
        assert c["explained_redeliveries"] + c["unexplained_redeliveries"] + len(self.suspects) == self.calls

    @invariant()
    def in_transit_budgets_and_bounds_hold(self) -> None:
        for death, model in zip(self.led.deaths, self.deaths):
            assert death.attributed <= death.in_transit
            assert death.delivered_bound == model.bound

    @invariant()
    def poison_and_doubt_match_the_model(self) -> None:
        for seq in self.delivery:
            assert self.led.is_poison(seq) == self.is_poison(seq), seq
        doubt = {seq for seq in {h.seq for h in self.held if not h.resolved}
                 if all(h.state == "acked" and not h.redelivered for h in self.held if h.seq == seq and not h.resolved)}
        assert set(self.led.in_doubt()) == doubt


LedgerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
test_crash_ledger_against_its_model = LedgerMachine.TestCase
