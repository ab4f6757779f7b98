"""/status `crosscheck.in_transit_unchecked` (supervisor/parent/safety/in_transit.py `InTransit.unchecked`):
each dead worker whose in-transit round has not ended, with the window of first deliveries the
readings bound and what the round waits for, with made-up readings and times. The real-server
test is tests/integration/test_safety_checks.py::test_a_death_while_the_parent_is_away_is_listed_in_transit_unchecked."""

from __future__ import annotations

import asyncio

from supervisor.config import Config
from supervisor.core.ledger import CrashLedger
from supervisor.parent.safety.in_transit import NOT_CONNECTED, InTransit


class Link:
    """The parent's NATS connection as the round sees it: away, or back with ConsumerInfo timing out."""
    def __init__(self) -> None:
        self.is_connected = False

    def jetstream(self) -> Link:
        return self

    async def consumer_info(self, *_args: object, **_kw: object) -> object:
        raise TimeoutError


def check() -> InTransit:
    it = InTransit(Config(), Link(), CrashLedger(ack_wait=30.0, poison_after=3))
    it.observed(10.0, 10.01, 100)           # the dead worker read everything up to seq 100 ...
    it.death(20.0, 2, "worker 1 (pid 42)", 15.0, {}, pid=42, slot=1)   # ... it answered a PING at 15
    return it


def tick(it: InTransit, now: float) -> None:
    asyncio.run(it.step(now, set, lambda _t: True, True))


def test_a_death_with_credits_is_listed_with_its_window_and_why_until_its_round_ends():
    it = check()
    [row] = it.unchecked(21.0)
    assert row == {"pid": 42, "slot": 1, "consumer": "workers", "age_s": 1.0, "credits": 2, "after_seq": 100,
                   "up_to_seq": None, "why": NOT_CONNECTED}
    tick(it, 21.0)                          # NATS away: the round waits, the entry stays
    assert [r["why"] for r in it.unchecked(22.0)] == [NOT_CONNECTED]
    it.observed(19.0, 23.0, 103)            # asked before the death: no bound from above
    it.observed(23.0, 23.01, 104)
    it.observed(24.0, 24.01, 109)
    assert it.unchecked(24.1)[0]["up_to_seq"] == 104     # the first reading asked after the death
    it.nc.is_connected = True
    tick(it, 25.0)                          # back: its ConsumerInfo fails, the round waits for our hello
    assert it.unchecked(25.1)[0]["why"] == "ConsumerInfo failed: TimeoutError"
    it.done("skipped", "given up")
    assert it.unchecked(26.0) == []


def test_no_entry_without_credits_and_no_bounds_without_readings():
    it = InTransit(Config(), Link(), CrashLedger(ack_wait=30.0, poison_after=3))
    it.death(20.0, 0, "worker 0 (pid 7)", 15.0, {}, pid=7, slot=0)
    assert it.unchecked(21.0) == []         # nothing was asked for: nothing can be on its wire
    it.nc.is_connected = True
    it.death(20.0, 1, "worker 0 (pid 8)", 15.0, {}, pid=8, slot=0)
    [row] = it.unchecked(21.0)
    assert (row["pid"], row["after_seq"], row["up_to_seq"]) == (8, None, None)
    assert row["why"] == "a ConsumerInfo read after the death"


def test_an_expired_round_leaves_the_list():
    """Too late: a candidate's AckWait may be running out. The round gives up (in_transit_skipped):
    what was on the wire comes back after AckWait whether the supervisor lives or not."""
    it = check()
    tick(it, 21.0)
    assert it.unchecked(21.0)
    tick(it, 10.0 + 30.0)                   # the lower reading's AckWait is (nearly) over
    assert it.unchecked(40.0) == [] and it.stats["skipped"] == 1


def test_readings_stay_as_long_as_an_ack_wait_however_often_the_monitor_polls():
    """F20: a worker that exits long after its last answer from NATS (its link stalled first)
    still has a lower bound, however many polls came since; a reading older than the shortest
    AckWait bounds no safe NAK, and is dropped."""
    it = InTransit(Config(), Link(), CrashLedger(ack_wait=30.0, poison_after=3))
    it.observed(10.0, 10.01, 100)           # the worker's last proof comes SLACK after this one
    for k in range(1, 400):                 # polls every 0.05 s for 20 s: 64 readings were 3 s of them
        it.observed(10.0 + 0.05 * k, 10.01 + 0.05 * k, 100 + k)
    it.death(30.0, 2, "worker 1 (pid 42)", 10.5, {}, pid=42, slot=1)
    assert it.unchecked(30.1)[0]["after_seq"] == 104      # the newest reading answered SLACK before 10.5
    it.observed(45.0, 45.01, 600)           # AckWait (30 s) past 10.01 and beyond: those go
    assert it.readings[0].answered >= 45.01 - 30.0
    assert it.unchecked(45.1)[0]["after_seq"] is None


def test_a_reading_answered_before_the_workers_fork_bounds_a_death_in_its_first_moments():
    """Seed 1028: a supervisor's only reading is its start's; a worker forked 0.02 s after it
    was answered proved its link 0.13 s later and was killed: no reading came SLACK before
    that proof, yet the start's reading was answered before the worker had any request out."""
    it = InTransit(Config(), Link(), CrashLedger(ack_wait=30.0, poison_after=3))
    it.observed(10.0, 10.01, 100)           # the supervisor's start
    it.death(10.3, 2, "worker 1 (pid 42)", 10.16, {}, pid=42, slot=1, born=10.03)
    assert it.unchecked(10.4)[0]["after_seq"] == 100
    it.death(10.3, 2, "worker 2 (pid 43)", 10.16, {}, pid=43, slot=2, born=10.005)   # forked before the answer
    assert it.unchecked(10.4)[1]["after_seq"] is None
