"""The checker's runs of a job (chaos/checker.py `runs_by_seq`) and the limit check that reads them
(chaos/randomized.py `over_limit`): a process that runs the same delivery number twice (a restarted
server that lost its consumer state hands the job out again as delivery 1: seed 855) has two runs,
each ended by its own D or R line. Synthetic journal, no server."""

from __future__ import annotations

import types

from chaos.checker import Checker, Evidence, runs_by_seq
from chaos.facts import Rec, Stored
from chaos.randomized import over_limit
from supervisor.core.ledger import NAK_READ, NAK_READ_NAKED, NAK_UNSENT

T0 = 1000.0


def rec(event: str, seq: int, t: float, pid: int = 41, delivery: int = 1) -> Rec:
    return Rec(event, pid, seq, delivery, T0 + t, T0 + t, f"j{seq}")


# Seed 855's form: seq 63 ran at delivery 1, the server was SIGKILLed, and after its restart the
# same worker was handed seq 63 at delivery 1 again, right after jobs 56 and 57 (one at a time).
JOURNAL = [rec("S", 63, 0.0), rec("D", 63, 0.06),
           rec("S", 56, 5.8, delivery=2), rec("D", 56, 5.84, delivery=2),
           rec("S", 63, 5.9), rec("D", 63, 5.96)]


def test_the_same_delivery_run_twice_in_one_process_is_two_runs():
    [first, second] = runs_by_seq(JOURNAL)[63]
    assert (first.start, first.done) == (T0, T0 + 0.06)
    assert (second.start, second.done) == (T0 + 5.9, T0 + 5.96)


def test_two_overlapping_runs_of_one_delivery_in_one_process_end_oldest_first():
    """855's form with concurrency 2: the restarted server hands the job out again while its first
    run still runs; each D ends one run (the oldest: which one finished first is not known)."""
    runs = runs_by_seq([rec("S", 5, 1.0), rec("S", 5, 2.0), rec("D", 5, 3.0), rec("D", 5, 4.0)])[5]
    assert [(r.start, r.done) for r in runs] == [(T0 + 1.0, T0 + 3.0), (T0 + 2.0, T0 + 4.0)]


def test_a_retry_ends_its_run_and_an_unended_run_stays_open():
    runs = runs_by_seq([rec("S", 7, 0.0), rec("R", 7, 0.01), rec("S", 7, 1.0, delivery=2)])[7]
    assert [(r.delivery, r.retried, r.done) for r in runs] == [(1, T0 + 0.01, None), (2, None, None)]


def test_one_job_at_a_time_is_not_over_a_limit_of_one():
    run = types.SimpleNamespace(watcher=types.SimpleNamespace(lives={}), tail=types.SimpleNamespace(poll=lambda: JOURNAL),
                                faults=[], at=lambda t: f"+{t - T0:.2f}s")
    assert over_limit(run, 1) == []
    overlapping = [*JOURNAL, rec("S", 99, 5.82, pid=42), rec("D", 99, 5.83, pid=42)]
    run.tail = types.SimpleNamespace(poll=lambda: overlapping)
    assert over_limit(run, 1) == ["+5.82s: 2 jobs ran at once (limit 1)"]


def test_a_job_whose_nak_the_server_had_read_at_the_death_is_not_named_as_waiting():
    """F18: a dead worker's job named NAK_READ (or NAK_READ_NAKED) was to come back at once, so its
    name excuses no AckWait wait; F10's NAK_UNSENT still does."""
    left = [{"stream_seq": s, "delivery": 1, "pid": 41, "waits": why}
            for s, why in ((1, NAK_READ), (2, NAK_READ_NAKED), (3, NAK_UNSENT))]
    ev = Evidence(stored={s: Stored(s, f"j{s}", T0) for s in (1, 2, 3)}, journal=[], faults=[], ack_wait=30.0,
                  origin=T0, left_to_ack_wait=left)
    assert dict(Checker(ev).named) == {(3, 1): {41: NAK_UNSENT}}
