"""The checker's rule for a first delivery on the wire to a worker whose death's in-transit check
had not run when its supervisor was SIGKILLed (chaos/checker.py `unchecked_at_kill`, seed 700):
the supervisor's last /status (`crosscheck.in_transit_unchecked`, read by the rig just before the
kill) names the dead worker's pid and the window of first deliveries its check would have
searched; a never-started delivery handed to that pid, inside that window, waited for AckWait
for a named reason outside the supervisor's control. Synthetic evidence, no server."""

from __future__ import annotations

from chaos.checker import Evidence, RunOfJob, check, named_at_death, unchecked_at_kill
from chaos.facts import Fault, Rec, Stored

T0 = 1000.0
WHY = "not connected to NATS"


def death(pid: int = 41, after: int | None = 10, up_to: int | None = 14, why: str = WHY, age: float = 6.0) -> dict:
    return {"pid": pid, "slot": 0, "consumer": "workers", "age_s": age, "credits": 2, "died": T0 + 1.0,
            "after_seq": after, "up_to_seq": up_to, "why": why}


def test_a_first_delivery_to_that_pid_inside_the_window_is_named():
    text = unchecked_at_kill([death()], seq=12, delivery=1, holder=41)
    assert "pid 41" in text and "seq 11..14" in text and WHY in text and "SIGKILLed" in text
    assert unchecked_at_kill([death()], 11, 1, 41) and unchecked_at_kill([death()], 14, 1, 41)   # both ends


def test_another_pid_a_seq_outside_the_window_or_a_redelivery_is_not():
    assert unchecked_at_kill([death()], 12, 1, 42) == ""            # handed to another worker
    assert unchecked_at_kill([death()], 10, 1, 41) == ""            # the dead worker had read it
    assert unchecked_at_kill([death()], 15, 1, 41) == ""            # delivered after the death
    assert unchecked_at_kill([death()], 12, 2, 41) == ""            # a redelivery: not in a first-delivery window
    assert unchecked_at_kill([death()], 12, 1, 0) == ""             # the holder is not known
    assert unchecked_at_kill([], 12, 1, 41) == ""


def test_only_a_round_nats_held_up_or_a_death_moments_before_the_kill_is_named():
    """A round that waited on the supervisor's own workers for seconds is its own to answer for;
    NATS away, a failed request, peers not heard yet, or a death a tick before the kill are not."""
    own = "every live worker to show what it holds (a PING it sent after that reading, answered)"
    assert unchecked_at_kill([death(why=own)], 12, 1, 41) == ""
    assert unchecked_at_kill([death(why=own, age=0.3)], 12, 1, 41)
    assert unchecked_at_kill([death(why="ConsumerInfo failed: nats: timeout")], 12, 1, 41)
    assert unchecked_at_kill([death(why="cannot read seq 12 from the stream: nats: timeout")], 12, 1, 41)


def test_an_unknown_bound_does_not_narrow_the_window():
    assert unchecked_at_kill([death(up_to=None)], 99, 1, 41)        # no ConsumerInfo after the death
    assert unchecked_at_kill([death(up_to=None)], 10, 1, 41) == ""
    assert unchecked_at_kill([death(after=None, up_to=None)], 1, 1, 41)
    assert "seq ?..?" in unchecked_at_kill([death(after=None, up_to=None)], 1, 1, 41)


def test_named_at_death_passes_a_never_started_delivery_to_the_rule_with_its_holder():
    redo = RunOfJob(pid=50, delivery=2, start=T0 + 30.0)
    assert named_at_death({}, 12, [], redo, holder=41, unchecked=[death()])
    assert named_at_death({}, 12, [], redo, holder=0, unchecked=[death()]) == ""
    assert named_at_death({}, 12, [], redo, holder=41) == ""
    ran = [RunOfJob(pid=41, delivery=1, start=T0 + 1.0)]           # delivery 1 started: not in transit
    assert named_at_death({}, 12, ran, redo, holder=41, unchecked=[death()]) == ""


def test_without_a_holder_the_wait_still_counts_against_the_supervisor():
    """Until the proxy names the pid a delivery was written to, the rule cannot apply: the
    evidence alone must not excuse the wait (a parent SIGKILL is in its control for unstarted jobs)."""
    killed = Fault("parent SIGKILL, then a new supervisor", T0 + 6.0, T0 + 8.0, frozenset({41}))
    ev = Evidence(stored={12: Stored(12, "j12", T0)}, faults=[killed], ack_wait=30.0, origin=T0,
                  journal=[Rec(e, 50, 12, 2, T0 + t, 0.0, "j12") for e, t in (("S", 30.5), ("D", 30.6))],
                  in_transit_unchecked=[death()])
    c = check(ev).counts
    assert (c["ackwait"], c["ackwait_outside"]) == (1, 0)


def test_with_the_holder_the_proxy_saw_the_wait_is_named():
    """Seed 604: the proxy wrote delivery 1 to pid 41 (after its death: the server handed it to the
    dead worker's pull), its supervisor was SIGKILLed before that death's in-transit check ran
    (both in control): the supervisor's last /status names it, so the wait is named; handed to
    another pid, it is not."""
    from chaos.facts import Handout, Life
    killed = Fault("parent SIGKILL, then a new supervisor", T0 + 6.0, T0 + 8.0, frozenset({41}), parent=7)

    def counts(pid: int) -> dict:
        ev = Evidence(stored={12: Stored(12, "j12", T0)}, faults=[killed], ack_wait=30.0, origin=T0,
                      journal=[Rec(e, 50, 12, 2, T0 + t, 0.0, "j12") for e, t in (("S", 30.5), ("D", 30.6))],
                      in_transit_unchecked=[death()], lives={41: Life(41, T0, T0 + 1.0, parent=7)},
                      handouts=[Handout("chaos-a worker 0", "JOBS", 12, 1, T0 + 1.05, T0 + 1.05, pid=pid, conn=3)])
        return check(ev).counts
    assert (counts(41)["ackwait"], counts(41)["ackwait_outside"]) == (0, 1)
    assert (counts(42)["ackwait"], counts(42)["ackwait_outside"]) == (1, 0)
