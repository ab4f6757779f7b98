"""The proof an in-transit NAK of a redelivery needs (supervisor/parent/safety/in_transit.py WorkerNaks,
F1): each piece on its own, with made-up readings and times. The real-server reproducer is
tests/integration/test_found_by_random.py::test_a_retry_on_its_way_to_a_worker_that_dies_comes_back_at_once."""

from __future__ import annotations

from supervisor.parent.safety.in_transit import SLACK, Reading, WorkerNak, WorkerNaks


def naks_with(delivery: int = 1, delay: float = 0.5, learnt: float = 10.0) -> WorkerNaks:
    naks = WorkerNaks()
    naks.sent(7, WorkerNak(delivery, earliest=10.0 + delay, delay=delay, learnt=learnt))
    return naks


def reading(asked: float, waiting: int = 1) -> Reading:
    return Reading(asked, asked + 0.01, 100, waiting, 200)


def first_waiting(readings: list[Reading]):
    return lambda t: next((r for r in readings if r.asked >= t and r.waiting > 0), None)


def always(_t: float) -> bool:
    return True


def proven(naks: WorkerNaks, readings: list[Reading], links=always) -> list[int]:
    return naks.provable(first_waiting(readings), links)


def test_a_nak_is_a_candidate_only_once_a_worker_with_credits_died_after_it_and_the_server_read_it():
    naks = naks_with()
    late = [reading(20.0)]
    naks.read_in(set(), before=11.0, after=11.1)
    assert proven(naks, late) == []                     # no death: nothing can be on a dead worker's wire
    naks.died("worker 0 (pid 1)", credits=0, held={})
    assert proven(naks, late) == []                     # a death with no pull outstanding took nothing
    naks.died("worker 1 (pid 2)", credits=3, held={})
    assert proven(naks, late) == [7]


def test_a_table_read_proves_the_nak_arrived_only_when_it_began_after_the_parent_learnt_of_it():
    naks = naks_with(learnt=10.0)
    naks.died("w", credits=1, held={})
    naks.read_in(set(), before=9.0, after=10.5)         # the read began before the event was applied
    assert naks.naks[7].read_by is None
    naks.read_in({7}, before=11.0, after=11.1)          # still in a table: its fence has not passed
    assert naks.naks[7].read_by is None
    naks.read_in(set(), before=12.0, after=12.1)
    assert naks.naks[7].read_by == 12.1


def test_the_redelivery_must_have_left_the_queue_after_the_nak_and_its_delay():
    naks = naks_with(delay=0.5)
    naks.died("w", credits=1, held={})
    naks.read_in(set(), before=11.0, after=11.0)
    earliest_reading = 11.0 + SLACK + 0.5
    assert proven(naks, [reading(earliest_reading - 0.01)]) == []      # asked before the delay ran out
    assert proven(naks, [reading(earliest_reading + 1, waiting=0)]) == []    # nothing waiting: maybe still queued
    assert proven(naks, [reading(earliest_reading)]) == [7]


def test_every_live_worker_must_have_answered_a_ping_sent_after_that_reading():
    naks = naks_with()
    naks.died("w", credits=1, held={})
    naks.read_in(set(), before=11.0, after=11.0)
    r = reading(13.0)
    asked_for = []

    def links(t: float) -> bool:
        asked_for.append(t)
        return False
    assert proven(naks, [r], links) == []
    assert asked_for == [r.answered + SLACK]


def test_a_later_delivery_named_by_a_worker_ends_the_nak_whichever_event_came_first():
    naks = naks_with(delivery=1)
    naks.named(7, 1)                                    # the NAK's own Settled event
    assert 7 in naks.naks
    naks.named(7, 2)                                    # the redelivery reached a live worker
    assert 7 not in naks.naks
    reordered = WorkerNaks()
    reordered.named(7, 2)                               # the redelivery's event applied first (R4b)
    reordered.sent(7, WorkerNak(1, 10.0, 0.0, 10.0))
    assert 7 not in reordered.naks


def test_a_nak_still_in_the_dead_workers_table_is_never_proven_without_its_advisory():
    """Its fence had not passed: the NAK may still sit in the dead worker's socket and land
    after ours, on the next holder's delivery (F10). No table read proves otherwise: the dead
    worker's table is no longer read, so its job is in none."""
    naks = naks_with()
    assert naks.died("w", credits=2, held={7: (1, 70)}) == []
    naks.read_in(set(), before=11.0, after=11.1)
    assert naks.naks[7].unproven and proven(naks, [reading(30.0)]) == []
    naks.advisory(7, 1, 71, 12.0)                       # another delivery's NAK (its consumer sequence)
    assert naks.naks[7].unproven
    wrong = naks_with(delivery=2)
    wrong.died("w", credits=2, held={7: (1, 70)})       # its table held another delivery than the NAK's
    assert 7 not in wrong.naks


# ---- F18: a NAK its worker's table still held at its death, proven read by the server's MSG_NAKED advisory


def test_an_advisory_before_the_death_proves_a_nak_its_table_held():
    """The advisory may come before the worker's event and before the death: kept, and read by
    the advisory's time, for that very delivery (consumer sequence) only."""
    naks = WorkerNaks()
    assert not naks.advisory(7, 1, 70, 10.5)            # before the worker's event: remembered
    naks.sent(7, WorkerNak(1, earliest=10.0, delay=0.0, learnt=11.0))
    assert naks.naks[7].read_by == 10.5
    assert naks.died("w", credits=2, held={7: (1, 70)}) == [7]
    n = naks.naks[7]
    assert (n.in_table, n.cseq, n.read_by, n.dead) == (True, 70, 10.5, "w")
    assert proven(naks, [reading(10.5 + SLACK - 0.01)]) == []
    assert proven(naks, [reading(10.5 + SLACK)]) == [7]
    other = WorkerNaks()
    other.advisory(7, 1, 71, 10.5)                      # a NAK of another delivery numbered alike
    other.sent(7, WorkerNak(1, earliest=10.0, delay=0.0, learnt=11.0))
    assert other.died("w", credits=2, held={7: (1, 70)}) == [] and other.naks[7].unproven


def test_an_advisory_after_the_death_proves_a_nak_its_table_held():
    naks = naks_with(delay=0.5)
    naks.died("w", credits=2, held={7: (1, 70)})
    assert naks.naks[7].unproven
    assert not naks.advisory(7, 2, 90, 12.0)            # another delivery's NAK: proves nothing of this one
    assert naks.advisory(7, 1, 70, 12.5)
    assert naks.naks[7].read_by == 12.5
    assert proven(naks, [reading(12.5 + SLACK + 0.5)]) == [7]


def test_an_advisory_proves_a_live_workers_nak_and_an_orphans_read_too():
    naks = naks_with()
    assert not naks.advisory(7, 1, 70, 10.2)            # sound, but not a death's: the ledger is not told
    assert naks.naks[7].read_by == 10.2
    orphan = WorkerNaks()
    orphans_nak(orphan)
    orphan.advisory(7, 1, 70, 10.3)
    assert orphan.naks[7].read_by == 10.3


def test_a_paused_consumers_waiting_requests_prove_no_delivery():
    """The server keeps pull requests waiting while the consumer is paused (workers.Pause,
    `supervisor pause`) and hands nothing out: such a reading must not prove that a NAKed job left
    the redelivery queue, or the check would NAK a delivery a live worker is about to get."""
    from supervisor.config import Config
    from supervisor.core.ledger import CrashLedger
    from supervisor.parent.safety.in_transit import InTransit

    it = InTransit(Config(), None, CrashLedger(30.0, 3))
    it.observed(10.0, 10.01, 100, waiting=2, consumer_seq=200, paused=True)
    assert it.waiting_since(9.0) is None
    it.observed(11.0, 11.01, 100, waiting=2, consumer_seq=200)
    assert it.waiting_since(9.0).asked == 11.0


# ---- F9: an orphan's NAK, heard on the ledger subject
# (tests/integration/test_found_by_random.py::test_an_orphans_nak_redelivered_to_a_worker_that_dies_comes_back_at_once)

ORPHAN = "vm/41/ab12cd34 (worker 0, orphan of pid 40)"


def orphans_nak(naks: WorkerNaks, delivery: int = 1, learnt: float = 10.0) -> None:
    naks.sent(7, WorkerNak(delivery, earliest=12.0, delay=2.0, learnt=learnt, by=ORPHAN))


def test_an_orphans_nak_is_read_by_the_server_only_once_its_fenced_goodbye_came():
    naks = WorkerNaks()
    orphans_nak(naks)
    naks.died("worker 0 (pid 2)", credits=2, held={})
    naks.read_in(set(), before=11.0, after=11.1)        # in none of OUR tables: proves nothing of the orphan's
    assert naks.naks[7].read_by is None and proven(naks, [reading(20.0)]) == []
    naks.orphan_gone("another orphan", 11.5)
    assert naks.naks[7].read_by is None
    naks.orphan_gone(ORPHAN, 12.0)
    assert naks.naks[7].read_by == 12.0
    assert proven(naks, [reading(12.0 + SLACK + 2.0 - 0.01)]) == []   # the delay counts from that proof
    assert proven(naks, [reading(12.0 + SLACK + 2.0)]) == [7]


def test_a_nak_said_again_keeps_what_was_known_of_it():
    """An orphan says its NAKs again with its goodbye: a death already seen must stay marked."""
    naks = WorkerNaks()
    orphans_nak(naks)
    naks.died("worker 0 (pid 2)", credits=2, held={})
    orphans_nak(naks, learnt=11.0)
    assert naks.naks[7].dead == "worker 0 (pid 2)" and naks.naks[7].learnt == 10.0
    orphans_nak(naks, delivery=2, learnt=12.0)         # a later delivery NAKed: that one counts now
    assert naks.naks[7].delivery == 2 and not naks.naks[7].dead
