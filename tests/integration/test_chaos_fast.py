"""The fast subset of the fault matrix (`python -m chaos` runs all of it: SIGSTOP, churn, OOM,
server and network faults, the cluster), and the checker's own unit tests.

Each scenario runs against a real nats-server and the real supervisor and is judged by
chaos/checker.py from the handlers' journal. Scenarios that fail on the code as it is, because
of a defect issue 9 names, are marked xfail(strict) and may fail only on the verdicts that
defect explains: any other verdict, or the run itself breaking, fails the test; once the
defect is fixed the test passes, the xfail turns strict XPASS, and the marker must go. A defect
that shows only now and then is a non-strict xfail, excused on its verdicts alone.
Seeds are random; CHAOS_SEED=N replays one.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from chaos import scenarios  # noqa: F401  (registers the scenarios)
from chaos.checker import Evidence, check
from chaos.core import SCENARIOS, run_scenario
from chaos.facts import Fault, Handout, Life, Link, Pull, Rec, Settle, Stored
from chaos.rig import Publisher, copies_for_later

SEED = int(os.environ["CHAOS_SEED"]) if "CHAOS_SEED" in os.environ else None


class KnownDefect(AssertionError):
    """The run failed exactly on the verdicts an open defect explains."""


def run(name: str, tmp_path, known: set[str] = frozenset()) -> None:
    result = run_scenario(name, tmp_path / name, quick=True, seed=SEED)
    if result.skipped:
        pytest.skip(result.skipped)
    assert not result.error, result.summary()
    failed = {f.split("=")[0] for f in result.failures}
    if failed and failed <= known:
        raise KnownDefect(result.summary())
    assert result.passed, result.summary()


def test_worker_sigkill_at_random_moments(tmp_path):
    """Issue 9 point 11: a message in transit to a SIGKILLed worker came back only after AckWait
    (about 3 kills in 100): the in-transit check now finds it, also in a supervisor's first
    seconds (it waits until it can tell whether it is alone)."""
    run("kill", tmp_path)


def test_scale_down_during_a_recycle_keeps_the_pool_going(tmp_path):
    """A scale-down that retired a recycle's replacement left Arbiter.replacing stuck: recycling
    stopped, workers at max_jobs stopped pulling, the pool stopped."""
    run("scale-recycle", tmp_path)


def test_restarts_under_a_burst_spend_no_deliveries(tmp_path):
    """One stop NAKed a job twice: a draining worker's NAK reached the other draining worker's
    last pull request. Shutdown NAKs now carry a delay longer than any pull request lives."""
    run("term-restart", tmp_path)


def test_recycling_alone_redelivers_nothing(tmp_path):
    """Issue 9 point 2: a retiring worker took jobs it would never run and NAKed them."""
    run("recycle", tmp_path)


def test_graceful_timeout_during_a_recycle(tmp_path):
    """Issue 9 point 3: the parent NAKed again after graceful_timeout, taking the job from its
    new holder (a third delivery running beside the second)."""
    run("graceful-recycle", tmp_path)


def test_fork_failure_is_survived(tmp_path):
    """Issue 9 point 9: fork() failing with EAGAIN (TasksMax) killed the parent."""
    run("fork-fail", tmp_path)


# ---------------------------------------------------------------- the checker on made-up evidence

T0 = 1000.0


def evidence(journal: list[tuple], faults: list[Fault] = (), stored: int = 1, **kw) -> Evidence:
    """journal rows: (event, pid, seq, delivery, seconds after T0)."""
    return Evidence(stored={s: Stored(s, f"j{s}", T0) for s in range(1, stored + 1)},
                    journal=[Rec(e, pid, seq, d, T0 + t, 0.0, f"j{seq}") for e, pid, seq, d, t in journal],
                    faults=list(faults), ack_wait=30.0, origin=T0, **kw)


def test_checker_counts_a_job_never_completed_as_lost():
    c = check(evidence([("S", 1, 1, 1, 0.1)])).counts
    assert c["lost"] == 1 and c["vanished"] == 0


def test_checker_tells_a_job_the_server_lost_from_one_still_queued():
    assert check(evidence([])).counts["vanished"] == 1
    c = check(evidence([], unacked=[1])).counts
    assert (c["lost"], c["vanished"], c["unacked"]) == (1, 0, 1)


def test_checker_counts_a_job_re_published_for_later_by_its_copy():
    """[retry] republish_after: job 1 asked for a long retry (R), the worker stored a copy (seq 5,
    its key, nobody published it) and acked the original. Not lost while the copy completes; the
    copy is a job of its own (lost if it never completes); one completed under both is a copy_dup."""
    def run(journal):
        recs = [Rec(e, pid, seq, d, T0 + t, 0.0, "j1") for e, pid, seq, d, t in journal]
        stored = {1: Stored(1, "j1", T0)}
        copies = copies_for_later(recs, stored)
        return copies, check(Evidence(stored={**stored, **copies}, journal=recs, faults=[], ack_wait=30.0, origin=T0,
                                      copies=set(copies))).counts
    copies, c = run([("S", 1, 1, 1, 0.1), ("R", 1, 1, 1, 0.2), ("S", 1, 5, 1, 1.2), ("D", 1, 5, 1, 1.3)])
    assert list(copies) == [5] and copies[5].t == T0 + 1.2
    assert (c["jobs"], c["copies"], c["copied"], c["lost"], c["copy_dup"]) == (1, 1, 1, 0, 0)
    _, c = run([("S", 1, 1, 1, 0.1), ("R", 1, 1, 1, 0.2), ("S", 1, 5, 1, 1.2)])
    assert (c["copied"], c["lost"]) == (1, 1)                       # the copy never completed
    _, c = run([("S", 1, 1, 1, 0.1), ("R", 1, 1, 1, 0.2), ("S", 2, 1, 2, 0.3), ("D", 2, 1, 2, 0.4),
                ("S", 1, 5, 1, 1.2), ("D", 1, 5, 1, 1.3)])
    assert (c["copy_dup"], c["lost"]) == (1, 0)
    assert copies_for_later([Rec("S", 1, 9, 1, T0, 0.0, "j1")], {1: Stored(1, "j1", T0)}) == {}   # no retry asked
    fired = [Rec("S", 1, 3, 1, T0, 0.0, "j1"), Rec("R", 1, 3, 1, T0, 0.0, "j1"), Rec("S", 1, 7, 1, T0 + 1, 0.0, "j1")]
    assert list(copies_for_later(fired, {})) == [7]          # a delayed job (its firing unpublished) and its copy


def test_checker_counts_a_job_whose_key_was_done_under_another_sequence_as_deduplicated():
    """Seed 700: seq 1 (key j1) failed twice and asked for a retry; meanwhile the publisher's retry
    of j1 (seq 2, after the duplicate window) completed, and the guard acked seq 1's third
    delivery unrun. Its key was done: deduplicated, not lost. Still in the stream, it is lost."""
    def run(**kw):
        return check(Evidence(stored={1: Stored(1, "j1", T0), 2: Stored(2, "j1", T0 + 0.5)},
                              journal=[Rec(e, pid, seq, d, T0 + t, 0.0, "j1") for e, pid, seq, d, t in (
                                  ("S", 1, 1, 1, 0.1), ("R", 1, 1, 1, 0.1), ("S", 2, 1, 2, 0.6), ("R", 2, 1, 2, 0.6),
                                  ("S", 3, 2, 1, 1.4), ("D", 3, 2, 1, 1.5))],
                              faults=[], ack_wait=30.0, origin=T0, **kw)).counts
    c = run()
    assert (c["deduplicated"], c["lost"], c["vanished"]) == (1, 0, 0)
    c = run(unacked=[1])
    assert (c["deduplicated"], c["lost"]) == (0, 1)


def test_checker_names_a_dead_lettered_job():
    c = check(evidence([("S", 1, 1, 1, 0.1)], dead_lettered=[1])).counts
    assert (c["dead_lettered"], c["lost"], c["vanished"]) == (1, 0, 0)


def test_checker_counts_deliveries_spent_beyond_the_drains_in_between():
    runs = [("S", 1, 1, 4, 0.5), ("D", 1, 1, 4, 0.6)]
    stop = [(T0 + 0.1, T0 + 0.15), (T0 + 0.2, T0 + 0.25), (T0 + 0.3, T0 + 0.35)]
    assert check(evidence(runs, drains=stop)).counts["bounced"] == 0
    assert check(evidence(runs, drains=stop[:2])).counts["bounced"] == 1
    assert check(evidence(runs, drains=stop[:2] + [(T0 + 9.0, T0 + 9.5)])).counts["bounced"] == 1   # too late to NAK it


def test_checker_counts_a_drain_still_under_way_when_the_job_was_stored():
    """A stop's workers take jobs until their UNSUB reaches the server, and NAK them: a drain
    signalled before the PubAck but not yet over explains one delivery."""
    runs = [("S", 1, 1, 2, 0.5), ("D", 1, 1, 2, 0.6)]
    assert check(evidence(runs, drains=[(T0 - 1.0, T0 + 0.2)])).counts["bounced"] == 0
    assert check(evidence(runs, drains=[(T0 - 1.0, T0 - 0.5)])).counts["bounced"] == 1   # over before it


def test_checker_explains_a_duplicate_only_by_a_fault_on_the_first_worker():
    runs = [("S", 1, 1, 1, 0.1), ("D", 1, 1, 1, 0.2), ("S", 2, 1, 2, 0.31), ("D", 2, 1, 2, 0.4)]
    killed = Fault("worker SIGKILL", T0 + 0.25, T0 + 0.3, frozenset({1}))
    elsewhere = Fault("worker SIGKILL", T0 + 0.25, T0 + 0.3, frozenset({3}))
    assert check(evidence(runs, [killed])).counts["dup_unexplained"] == 0
    c = check(evidence(runs, [elsewhere])).counts
    assert (c["dup"], c["dup_unexplained"]) == (1, 1)


def test_checker_counts_a_run_again_at_delivery_1_as_a_repeat():
    """A server that lost its consumer state hands a job out again at delivery 1."""
    runs = [("S", 1, 1, 1, 0.1), ("D", 1, 1, 1, 0.2), ("S", 2, 1, 1, 3.0), ("D", 2, 1, 1, 3.1)]
    c = check(evidence(runs)).counts
    assert (c["redelivered"], c["dup"], c["dup_unexplained"]) == (1, 1, 1)


def test_checker_flags_a_redelivery_after_ackwait_and_spares_a_prompt_one():
    killed = Fault("worker SIGKILL", T0 + 0.2, T0 + 0.21, frozenset({1}))
    late = [("S", 1, 1, 1, 0.1), ("S", 2, 1, 2, 30.1), ("D", 2, 1, 2, 30.2)]
    prompt = [("S", 1, 1, 1, 0.1), ("S", 2, 1, 2, 0.25), ("D", 2, 1, 2, 0.3)]
    assert check(evidence(late, [killed])).counts["ackwait"] == 1
    assert check(evidence(prompt, [killed])).counts["ackwait"] == 0
    outside = Fault("nats-server SIGKILL", T0 + 0.2, T0 + 1.2, None, in_control=False)
    c = check(evidence(late, [outside])).counts
    assert (c["ackwait"], c["ackwait_outside"]) == (0, 1)


def test_checker_takes_an_ackwait_wait_as_outside_only_where_the_ledger_named_it_at_the_death():
    """F10: a handler's NAK unsent when its worker was SIGKILLed (the kill is in the supervisor's
    control). The wait counts as outside only for the job, delivery and pid the ledger named."""
    killed = Fault("worker SIGKILL", T0 + 0.3, T0 + 0.31, frozenset({1}))
    late = [("S", 1, 1, 1, 0.1), ("R", 1, 1, 1, 0.2), ("S", 2, 1, 2, 30.2), ("D", 2, 1, 2, 30.3)]
    why = "its NAK was unsent when the worker died; a second NAK could land on the next holder"

    def named(seq: int, delivery: int, pid: int) -> list[dict]:
        return [{"stream_seq": seq, "delivery": delivery, "pid": pid, "waits": why}]
    report = check(evidence(late, [killed], left_to_ack_wait=named(1, 1, 1)))
    assert (report.counts["ackwait"], report.counts["ackwait_outside"]) == (0, 1)
    assert any(why in f.text for f in report.findings if f.verdict == "ackwait_outside")
    living = {"crosscheck": {"unexplained_redeliveries": 0, "outstanding": [], "left_to_ack_wait": named(1, 1, 1)}}
    assert check(evidence(late, [killed], statuses=[living])).counts["ackwait"] == 0    # a living one's /status
    for other in (named(1, 1, 7), named(1, 2, 1), named(2, 1, 1), []):    # another pid, delivery, job; none
        assert check(evidence(late, [killed], left_to_ack_wait=other)).counts["ackwait"] == 1, other
    # A delivery that never started (a drain's NAK unsent at the death): its number alone.
    unstarted = [("S", 2, 1, 2, 30.3), ("D", 2, 1, 2, 30.4)]
    assert check(evidence(unstarted, [killed], left_to_ack_wait=named(1, 1, 9))).counts["ackwait"] == 0
    assert check(evidence(unstarted, [killed], left_to_ack_wait=named(1, 2, 9))).counts["ackwait"] == 1


def test_checker_flags_an_unfinished_run_nothing_touched():
    runs = [("S", 1, 1, 1, 0.1), ("S", 2, 1, 2, 1.0), ("D", 2, 1, 2, 1.1)]
    assert check(evidence(runs)).counts["unexplained"] == 1
    assert check(evidence(runs, [Fault("worker SIGKILL", T0 + 0.5, T0 + 0.6, frozenset({1}))])).counts[
        "unexplained"] == 0


def test_checker_compares_the_supervisor_word_with_the_journal():
    runs = [("S", 1, 1, 1, 0.1), ("D", 1, 1, 1, 0.2), ("S", 2, 1, 2, 0.3), ("D", 2, 1, 2, 0.4)]
    status = {"crosscheck": {"unexplained_redeliveries": 0, "outstanding": []}}
    report = check(evidence(runs, status=status))
    assert report.counts["sup_unexplained"] == 0
    assert [f.verdict for f in report.findings if f.verdict == "crosscheck"] == ["crosscheck"]


def test_checker_counts_a_pool_s_job_run_by_another_pool_s_worker():
    """With pools (chaos/randomized.py draws two): pool b's jobs are keyed bN, the rest are pool
    a's; each must run only on a worker of its own pool's consumer (from the worker's title)."""
    pools = {"main": "workers-a", "side": "workers-b"}
    lives = {1: Life(1, T0, consumer="workers-a"), 2: Life(2, T0, consumer="workers-b")}
    mine = [("S", 1, 1, 1, 0.1), ("D", 1, 1, 1, 0.2)]
    assert check(evidence(mine, pools=pools, lives=lives)).counts["wrong_pool"] == 0
    c = check(evidence([("S", 2, 1, 1, 0.1), ("D", 2, 1, 1, 0.2)], pools=pools, lives=lives)).counts
    assert (c["wrong_pool"], c["lost"]) == (1, 0)
    side = Evidence(stored={1: Stored(1, "b1", T0)}, journal=[Rec("S", 2, 1, 1, T0 + 0.1, 0.0, "b1"),
                                                              Rec("D", 2, 1, 1, T0 + 0.2, 0.0, "b1")],
                    faults=[], ack_wait=30.0, origin=T0, pools=pools, lives=lives)
    assert check(side).counts["wrong_pool"] == 0
    assert check(evidence(mine, lives={1: Life(1, T0, consumer="workers-b")})).counts["wrong_pool"] == 0   # no pools


def test_every_scenario_has_a_doc_and_known_verdicts():
    for sc in SCENARIOS.values():
        assert sc.doc, sc.name
        assert set(sc.expect) <= set(check(evidence([])).counts), sc.name


def test_checker_blames_a_dead_links_heal_for_what_the_server_handed_it_then():
    """Issue 22 item 10: a worker link stalled past AckWait; at the heal the pull requests the
    dead connection had carried reached the server, which handed them the backlog (a loaded
    box queued one) before the proxy closed it. Those jobs came back after AckWait; the later
    jobs' first starts (the checker's only evidence of when they were handed out) came after
    the fault's end, so the wait was charged to the supervisor. An expiry hands a job out one
    AckWait before its redelivery: that is when the fault must have acted."""
    later = [("S", 2, 2, 1, 39.3), ("D", 2, 2, 1, 39.5)]
    back = [("S", 2, 1, 2, 69.1), ("D", 2, 1, 2, 69.3)]
    stall = Fault("worker link stalled", T0 + 1.0, T0 + 39.0, frozenset({1}), in_control=False)
    c = check(evidence(later + back, [stall], stored=2)).counts
    assert (c["ackwait"], c["ackwait_outside"]) == (0, 1)
    inside = Fault("parent link stalled", T0 + 1.0, T0 + 39.0, frozenset(), in_control=True)
    assert check(evidence(later + back, [inside], stored=2)).counts["ackwait"] == 1
    assert check(evidence(later + back, [], stored=2)).counts["ackwait"] == 1
    long_before = Fault("worker link stalled", T0 + 1.0, T0 + 30.0, frozenset({1}), in_control=False)
    assert check(evidence(later + back, [long_before], stored=2)).counts["ackwait"] == 1


def test_checker_takes_a_wait_as_the_links_only_for_the_delivery_the_proxy_saw_it_hold():
    """Seed 600: worker 1's link stalled 39 s (outside); a job handed to it meanwhile never
    started and came back after AckWait, and routine SIGHUPs and a scale (in the supervisor's
    control, touching no worker) fell in the window of that never-started delivery, so the wait
    was charged. The proxy saw that very delivery sit in the stalled link past the redelivery:
    the link's, whatever else happened. Only that job and delivery, held that long, by a fault
    on a connection acting when the proxy read it."""
    later = [("S", 2, 2, 1, 1.6), ("D", 2, 2, 1, 1.7)]
    back = [("S", 3, 1, 2, 31.5), ("D", 3, 1, 2, 31.6)]
    stall = Fault("network: worker 1's connection stall 39s", T0 + 0.4, T0 + 39.4, frozenset({1}), in_control=False)
    hup = Fault("op: SIGHUP (workers.max_jobs=6)", T0 + 10.0, T0 + 10.0, frozenset())
    faults = [stall, hup]

    def late(seq: int = 1, delivery: int = 1, came: float = 1.5, out: float | None = None) -> list[Handout]:
        return [Handout("chaos-a worker 1", "JOBS", seq, delivery, T0 + came, None if out is None else T0 + out)]
    assert check(evidence(later + back, faults, stored=2)).counts["ackwait"] == 1        # the failure seen
    for held in (late(), late(out=39.4)):                   # closed unread; written on at the heal
        report = check(evidence(later + back, faults, stored=2, handouts=held))
        assert (report.counts["ackwait"], report.counts["ackwait_outside"]) == (0, 1), held
        assert any("held in the stalled link of 'chaos-a worker 1'" in f.text and "stall 39s" in f.text
                   for f in report.findings if f.verdict == "ackwait_outside")
    # Another job; another delivery; written on in time for the worker; read before the stall began.
    for other in (late(seq=2), late(delivery=2), late(out=20.0), late(came=0.2)):
        assert check(evidence(later + back, faults, stored=2, handouts=other)).counts["ackwait"] == 1, other
    inside = Fault("network: the parent's connection stall 39s", T0 + 0.4, T0 + 39.4, frozenset(), in_control=True)
    assert check(evidence(later + back, [inside, hup], stored=2, handouts=late())).counts["ackwait"] == 1
    # A stall that recorded the connections it hit holds only what was on them.
    on_it = [Handout("chaos-a worker 1", "JOBS", 1, 1, T0 + 1.5, None, conn=7)]
    mine = Fault(stall.kind, stall.t0, stall.t1, stall.pids, in_control=False, conns=frozenset({7}))
    elsewhere = Fault(stall.kind, stall.t0, stall.t1, frozenset({5}), in_control=False, conns=frozenset({8}))
    assert check(evidence(later + back, [mine, hup], stored=2, handouts=on_it)).counts["ackwait"] == 0
    assert check(evidence(later + back, [elsewhere, hup], stored=2, handouts=on_it)).counts["ackwait"] == 1


# A job whose delivery 1 never started and came back after AckWait (delivery 2, +31.1 s): the
# proxy saw delivery 1 handed to pid 1 (connection #3 of supervisor pid 100) at +1.0 s. Pid 5 is
# a worker of another supervisor (pid 200).
BACK = [("S", 2, 1, 2, 31.1), ("D", 2, 1, 2, 31.2)]
HOLDER = Handout("chaos-a worker 0", "JOBS", 1, 1, T0 + 1.0, T0 + 1.0, pid=1, conn=3, ppid=100)
LIVES = {1: Life(1, T0, parent=100), 2: Life(2, T0, parent=100), 5: Life(5, T0, parent=200)}


def handed(faults: list[Fault], holder: Handout | None = HOLDER, **kw) -> dict:
    kw.setdefault("lives", dict(LIVES))
    return check(evidence(BACK, faults, handouts=[holder] if holder else [], **kw)).counts


def test_checker_charges_a_never_started_wait_only_to_what_touched_its_holder():
    """Seed 705: delivery 1 was in transit to a worker SIGKILLed while a peer shares the consumer
    (README: it waits for AckWait: outside), and a 5.8 s SIGSTOP of another supervisor's worker
    (in control) fell in the AckWait window. Without the holder every fault in the window is a
    culprit and the wait is charged; with it only what touched pid 1, its connection or its
    supervisor counts: a routine SIGHUP or scale of another supervisor no longer charges, one of
    its own while the holder lived still does (after its death, not), its own link cut does, and
    so does a kill of the holder that is in control."""
    in_transit = Fault("worker SIGKILL", T0 + 5.0, T0 + 5.1, frozenset({1}), unstarted_in_control=False)
    elsewhere = [Fault("worker SIGSTOP 5.8s", T0 + 10.0, T0 + 15.8, frozenset({5})),
                 Fault("op: SIGHUP (workers.batch=4)", T0 + 12.0, T0 + 12.0, frozenset(), parent=200),
                 Fault("op: POST /scale?workers=3", T0 + 20.0, T0 + 20.0, frozenset(), parent=200)]
    assert handed([in_transit, *elsewhere], holder=None)["ackwait"] == 1            # the old rule: charged
    report = check(evidence(BACK, [in_transit, *elsewhere], lives=dict(LIVES), handouts=[HOLDER]))
    assert (report.counts["ackwait"], report.counts["ackwait_outside"]) == (0, 1)
    (text,) = [f.text for f in report.findings if f.verdict == "ackwait_outside"]
    assert "handed to pid 1 (connection #3 'chaos-a worker 0') +1.00s" in text and "SIGSTOP" not in text, text
    own_hup = Fault("op: SIGHUP (workers.batch=4)", T0 + 4.0, T0 + 4.0, frozenset(), parent=100)
    assert handed([in_transit, own_hup])["ackwait"] == 1
    assert handed([Fault("worker SIGKILL", T0 + 5.0, T0 + 5.1, frozenset({1}))])["ackwait"] == 1
    own_cut = Fault("network: the parent's connection cut 2s", T0 + 12.0, T0 + 14.0, frozenset(), parent=100)
    assert handed([in_transit, own_cut])["ackwait"] == 1
    # Seed 52: a routine SIGHUP of its supervisor 10 s after the holder's death, which a peer on
    # the consumer leaves to AckWait: it acts on the living workers, not on the dead one's jobs.
    dead = {**LIVES, 1: Life(1, T0, T0 + 5.1, parent=100)}
    later_hup = Fault("op: SIGHUP (workers.max_jobs=35)", T0 + 15.0, T0 + 15.0, frozenset(), parent=100)
    assert check(evidence(BACK, [in_transit, later_hup], lives=dead, handouts=[HOLDER])).counts["ackwait"] == 0
    assert check(evidence(BACK, [in_transit, own_hup], lives=dead, handouts=[HOLDER])).counts["ackwait"] == 1


def test_checker_excuses_a_never_started_wait_by_an_outside_fault_on_its_holder_alone():
    """Seed 604: a worker-cut's pattern also hit an orphan of the same slot; the fault named the
    target's pid only, but the proxy saw it hit the holder's connection (#3): outside. The
    server's faults touch every holder. An outside fault that touched another worker excuses
    nothing (the old rule let it excuse a real defect), nor one on the holder over before it was
    handed the delivery: the window starts at the hand-out, not one AckWait before the return."""
    cut = Fault("network: worker 0's connection cut 3.86s", T0 + 4.0, T0 + 7.9, frozenset({9}), in_control=False,
                conns=frozenset({3}))
    assert (handed([cut])["ackwait"], handed([cut])["ackwait_outside"]) == (0, 1)
    server = Fault("nats-server SIGSTOP 2s", T0 + 8.0, T0 + 10.0, None, in_control=False)
    assert handed([server])["ackwait"] == 0
    other = Fault("network: worker 1's connection stall 5s", T0 + 4.0, T0 + 9.0, frozenset({5}), in_control=False,
                  conns=frozenset({4}))
    assert handed([other], holder=None)["ackwait"] == 0                           # the old rule: excused
    assert handed([other])["ackwait"] == 1
    early = Fault("network: worker 0's connection stall 0.5s", T0 + 0.1, T0 + 0.6, frozenset({1}), in_control=False)
    assert handed([early], holder=None)["ackwait"] == 0                           # the old rule: excused
    assert handed([early])["ackwait"] == 1


def test_checker_counts_a_parent_kill_outside_when_a_cut_of_the_orphans_own_link_spans_its_grace():
    """Seeds 604 and 705: the holder's supervisor SIGKILLed (its orphans must NAK what they hold:
    in control) while an outside cut held the holder's own connection: the orphan could not reach
    NATS when its claim and first NAKs went out, right after the death, so the kill is outside too.
    The same kill with the cut over before it, begun after those words, or on another worker's
    connection, stays the supervisor's."""
    kill = Fault("parent SIGKILL, then a new supervisor", T0 + 5.0, T0 + 5.1, frozenset({1, 2}), parent=100)
    def cut(t0: float, t1: float, conn: int = 3) -> Fault:
        return Fault("network: worker 0's connection cut", T0 + t0, T0 + t1, frozenset({1}), in_control=False,
                     conns=frozenset({conn}))
    assert (handed([kill])["ackwait"], handed([kill])["ackwait_outside"]) == (1, 0)
    assert (handed([kill, cut(4.0, 7.9)])["ackwait"], handed([kill, cut(4.0, 7.9)])["ackwait_outside"]) == (0, 1)
    assert handed([kill, cut(5.3, 8.0)])["ackwait"] == 0                 # begun as the orphan's first words went out
    assert handed([kill, cut(6.5, 8.0)])["ackwait"] == 1                 # after them: its NAK had gone
    assert handed([kill, cut(2.0, 4.0)])["ackwait"] == 1                 # over before the death
    assert handed([kill, cut(4.0, 7.9, conn=4)])["ackwait"] == 1         # another connection
    # Seed 809: the server itself away (SIGKILLed, back 2.9 s later) when the parent died.
    down = Fault("nats-server SIGKILL, back 2.89s later", T0 + 3.9, T0 + 6.8, None, in_control=False)
    assert handed([kill, down])["ackwait"] == 0
    back = Fault("nats-server SIGKILL, back 0.5s later", T0 + 3.9, T0 + 4.4, None, in_control=False)
    assert handed([kill, back])["ackwait"] == 1                         # back before the death
    # Seed 817: a SIGTTOU of that supervisor 10 ms before its SIGKILL, the server stalled 10 ms
    # after: whatever the operation began was the orphan's to finish, over the stalled server.
    stall = Fault("nats-server SIGSTOP 4.63s", T0 + 5.01, T0 + 9.64, None, in_control=False)
    ttou = Fault("op: SIGTTOU", T0 + 4.99, T0 + 4.99, frozenset(), parent=100)
    assert handed([kill, stall, ttou])["ackwait"] == 0
    assert handed([kill, ttou])["ackwait"] == 1                         # no outside fault: the supervisor's
    early = Fault("op: SIGTTOU", T0 + 4.5, T0 + 4.5, frozenset(), parent=100)
    assert handed([kill, stall, early])["ackwait"] == 1                 # 0.5 s before the kill: its own doing


def test_checker_judges_a_fault_a_later_outside_fault_made_moot_with_that_fault():
    """Seed 817 (stop 35): delivery 2 started in worker 1; within 30 ms the rig SIGSTOPped it, its
    supervisor took a SIGTTOU and was SIGKILLed, and the rig SIGKILLed the orphan (outside: its
    supervisor was SIGKILLed around it). The stop, the operation and the parent's kill are in
    control, but the outside kill ended the stop and took the orphan whose remedy the parent's
    kill left: the wait is outside. Each of them alone, or the kill of another worker, charges."""
    late = [("S", 1, 1, 2, 6.60), ("S", 3, 1, 3, 36.6), ("D", 3, 1, 3, 36.7)]
    lives = {1: Life(1, T0, died=T0 + 6.64, parent=100)}
    stop = Fault("worker SIGSTOP 0.57s", T0 + 6.61, T0 + 7.18, frozenset({1}))
    ttou = Fault("op: SIGTTOU", T0 + 6.62, T0 + 6.62, frozenset(), parent=100)
    parent = Fault("parent SIGKILL, then a new supervisor", T0 + 6.63, T0 + 6.63, frozenset({1}), parent=100)
    orphan = Fault("worker SIGKILL", T0 + 6.64, T0 + 6.64, frozenset({1}), in_control=False)
    def charged(faults: list[Fault]) -> int:
        return check(evidence(late, faults, lives=dict(lives))).counts["ackwait"]
    assert charged([stop, ttou, parent, orphan]) == 0
    assert charged([stop, ttou, parent]) == 1                   # nothing outside: the supervisor's
    assert charged([stop, orphan]) == 0 and charged([parent, orphan]) == 0
    other = Fault("worker SIGKILL", T0 + 6.64, T0 + 6.64, frozenset({2}), in_control=False)
    assert charged([stop, parent, other]) == 1                  # another worker killed
    late_kill = Fault("worker SIGKILL", T0 + 9.0, T0 + 9.0, frozenset({1}), in_control=False)
    assert charged([stop, late_kill]) == 1                      # after the stop ended: it had gone on


def test_checker_judges_an_unstarted_jobs_orphan_killed_after_its_first_words_by_its_parents_kill():
    """An orphan NAKs what it has not started at once: killed (outside) within its first words,
    that kill made its parent's moot; killed 1.9 s later, the NAKs should have gone: charged."""
    parent = Fault("parent SIGKILL, then a new supervisor", T0 + 2.0, T0 + 2.0, frozenset({1}), parent=100)
    def orphan_killed(after: float) -> int:
        kill = Fault("worker SIGKILL", T0 + 2.0 + after, T0 + 2.0 + after, frozenset({1}), in_control=False)
        return handed([parent, kill])["ackwait"]
    assert orphan_killed(0.1) == 0
    assert orphan_killed(1.9) == 1


def test_checker_takes_no_operation_as_acting_on_a_holder_stopped_until_its_death():
    """Seed 930: delivery 1 handed to pid 1, SIGSTOPped 4.4 s (outside for what it had not
    started: a peer shares the consumer) and killed by its supervisor's heartbeat check while
    stopped; a SIGTTOU of that supervisor came during the stop. A stopped process acts on nothing
    and this one never resumed: the operation did not keep the job. It still charges when the
    holder resumed before its death."""
    stop = Fault("worker SIGSTOP 4.37s", T0 + 0.9, T0 + 5.27, frozenset({1}), unstarted_in_control=False)
    ttou = Fault("op: SIGTTOU", T0 + 4.1, T0 + 4.1, frozenset(), parent=100)
    def charged(died: float) -> int:
        lives = {**LIVES, 1: Life(1, T0, died=T0 + died, parent=100)}
        return handed([stop, ttou], lives=lives)["ackwait"]
    assert charged(4.8) == 0
    assert charged(6.0) == 1                                    # resumed at +5.27, alive till +6.0


def test_checker_takes_a_wait_whose_in_transit_check_another_workers_outside_link_fault_blocked_as_outside():
    """Seed 982: delivery 1 on the wire to pid 1 when it was SIGKILLed (in control: a lone
    supervisor's in-transit check NAKs such deliveries), but the check needs every live worker's
    proof, and 3 s later a 39 s stall of a sibling's link (outside) kept one from giving it: the
    check gave up (in_transit_skipped), the job came back after AckWait. Outside; charged when
    the stall hit another supervisor's worker, or began after the check would have given up;
    and the supervisor's own link cut after that met no NAK."""
    lives = {**LIVES, 1: Life(1, T0, died=T0 + 2.0, parent=100)}
    kill = Fault("worker SIGKILL", T0 + 2.0, T0 + 2.0, frozenset({1}))
    def stall(pid: int, t0: float) -> Fault:
        return Fault("network: worker 0's connection stall 39s", T0 + t0, T0 + t0 + 39, frozenset({pid}), in_control=False)
    cut = Fault("network: the parent's connection cut 4s", T0 + 14.0, T0 + 18.0, frozenset({100}), parent=100)
    assert handed([kill], lives=lives)["ackwait"] == 1
    assert handed([kill, stall(2, 5.0)], lives=lives)["ackwait"] == 0
    assert handed([kill, stall(2, 5.0), cut], lives=lives)["ackwait"] == 0
    assert handed([kill, stall(5, 5.0)], lives=lives)["ackwait"] == 1          # another supervisor's worker
    assert handed([kill, stall(2, 8.0)], lives=lives)["ackwait"] == 1          # after GIVE_UP


def test_checker_charges_a_never_started_wait_whose_holder_nothing_touched():
    """The proxy wrote delivery 1 to pid 1, which never ran it, and no fault touched pid 1, its
    connection or its supervisor: the supervisor's defect, whatever else happened in the window,
    and the verdict names the holder. A holder that exited (a recycle) is named with its exit."""
    report = check(evidence(BACK, [], lives=dict(LIVES), handouts=[HOLDER]))
    (text,) = [f.text for f in report.findings if f.verdict == "ackwait"]
    assert "handed to pid 1" in text and "no fault touched it" in text, text
    recycled = {**LIVES, 1: Life(1, T0, T0 + 6.0, parent=100)}
    report = check(evidence(BACK, [], lives=recycled, handouts=[HOLDER]))
    assert [f.text for f in report.findings if f.verdict == "ackwait" and "pid 1 gone from its supervisor's workers +6.00s"
            in f.text]


def test_checker_judges_a_holder_dead_before_the_hand_out_by_its_death():
    """The server handed delivery 1 to the pull request of a worker SIGKILLed (with a peer on the
    consumer: in transit, outside) 0.1 s before the proxy read it: the kill counts, from the
    death on. And the wait counts from the hand-out: a redelivery 11 s after it is not an
    AckWait wait (AckWait 30 s), however long after the publish."""
    dead = {**LIVES, 1: Life(1, T0, T0 + 0.9, parent=100)}
    kill = Fault("worker SIGKILL", T0 + 0.85, T0 + 0.9, frozenset({1}), unstarted_in_control=False)
    c = check(evidence(BACK, [kill], lives=dead, handouts=[HOLDER])).counts
    assert (c["ackwait"], c["ackwait_outside"]) == (0, 1)
    late = Handout("chaos-a worker 0", "JOBS", 1, 1, T0 + 20.0, T0 + 20.0, pid=1, conn=3, ppid=100)
    c = check(evidence(BACK, [], lives=dict(LIVES), handouts=[late])).counts
    assert (c["ackwait"], c["ackwait_outside"], c["redelivered"]) == (0, 0, 1)


def test_checker_keeps_the_old_rule_without_a_known_holder():
    """No hand-out of that delivery through the proxy, or one whose process the proxy could not
    name: every fault in the window one AckWait before the return is a culprit, as before."""
    in_transit = Fault("worker SIGKILL", T0 + 5.0, T0 + 5.1, frozenset({1}), unstarted_in_control=False)
    stop = Fault("worker SIGSTOP 5.8s", T0 + 10.0, T0 + 15.8, frozenset({5}))
    for holder in (None, Handout("chaos-a worker 0", "JOBS", 1, 1, T0 + 1.0, T0 + 1.0, pid=0, conn=3),
                   Handout("chaos-a worker 0", "JOBS", 2, 1, T0 + 1.0, T0 + 1.0, pid=1, conn=3)):
        assert handed([in_transit, stop], holder=holder)["ackwait"] == 1, holder
        assert handed([in_transit], holder=holder)["ackwait"] == 0, holder


def said(kind: str, t: float, delay: float = 0.0, pid: int = 1, seq: int = 1) -> Settle:
    return Settle(kind, "JOBS", "", seq, 1, T0 + t, conn=3, pid=pid, name="chaos-a worker 0", delay=delay)


def test_checker_takes_a_job_whose_nak_the_server_had_as_no_ackwait_wait_unless_a_wpi_undid_it():
    """Seed 836: delivery 1 was handed to pid 1 just after its parent's SIGKILL (in control), the
    orphan NAKed it (delay 1 s) and no worker pulled until the successor's link came back: the
    server had the NAK, so no AckWait ran out (nak_waited, reported). A +WPI after the NAK, while
    its delay had not run out, sets a whole AckWait again: charged, "a +WPI after its NAK". A
    +WPI once the delay ran out, a NAK after the job came back or of another job change
    nothing. Seed 604: a server SIGKILL after the NAK, the job back no sooner than an expiry,
    may have lost it: an AckWait wait, outside (the NAK had gone). Seed 1015: a NAK held in its
    own link by a stall is no late NAK; seed 1102: nor one sent at its holder's death, however
    long the holder held the job, nor one its parent sent once its cut link was back."""
    kill = Fault("parent SIGKILL, then a new supervisor", T0 + 0.9, T0 + 1.0, frozenset({1}), parent=100)

    def judged(*settles: Settle, faults: tuple = (kill,)):
        return check(evidence(BACK, list(faults), lives=dict(LIVES), handouts=[HOLDER], settles=list(settles)))
    assert handed([kill])["ackwait"] == 1
    report = judged(said("-NAK", 1.2, delay=1.0))
    assert (report.counts["ackwait"], report.counts["ackwait_outside"], report.counts["nak_waited"]) == (0, 0, 1)
    (text,) = [f.text for f in report.findings if f.verdict == "nak_waited"]
    assert "the server had its NAK: -NAK (delay 1s) by pid 1 (connection #3 'chaos-a worker 0') +1.20s" in text, text
    report = judged(said("-NAK", 1.2, delay=1.0), said("+WPI", 1.5, pid=100))
    assert (report.counts["ackwait"], report.counts["nak_waited"]) == (1, 0)
    assert [f for f in report.findings if f.verdict == "ackwait" and "a +WPI after its NAK" in f.text]
    assert judged(said("-NAK", 1.2, delay=1.0), said("+WPI", 3.0, pid=100)).counts["nak_waited"] == 1
    assert judged(said("-NAK", 31.5)).counts["ackwait"] == 1
    # A NAK the supervisor sent late (half an AckWait after the hand-out) is no excuse: judged.
    assert judged(said("-NAK", 16.5)).counts["ackwait"] == 1 and judged(said("-NAK", 15.5)).counts["nak_waited"] == 1
    # ... unless the server was away meanwhile (seed 985: no NAK can reach a stopped server).
    away = Fault("nats-server SIGSTOP 2s", T0 + 3.0, T0 + 5.0, None, in_control=False)
    assert judged(said("-NAK", 16.5), faults=(kill, away)).counts["nak_waited"] == 1
    # ... or the NAK's own link was stalled, in control or not (seed 1015: a parent's NAK held
    # 11.4 s in its link); another connection's stall is no excuse, nor a cut.
    def stall(conn: int, in_control: bool = True, mode: str = "stall") -> Fault:
        return Fault(f"network: the parent's connection {mode} 14s", T0 + 2.0, T0 + 16.0, frozenset(),
                     in_control=in_control, conns=frozenset({conn}), parent=100)
    assert judged(said("-NAK", 16.5), faults=(kill, stall(3))).counts["nak_waited"] == 1
    assert judged(said("-NAK", 16.5), faults=(kill, stall(3, in_control=False))).counts["nak_waited"] == 1
    assert judged(said("-NAK", 16.5), faults=(kill, stall(4))).counts["ackwait"] == 1
    assert judged(said("-NAK", 16.5), faults=(kill, stall(3, mode="cut"))).counts["ackwait"] == 1
    # A held job is its parent's to NAK from its holder's death on (seed 1102): a NAK at the
    # death is on time however long the holder had held the job; 16 s after it, late, unless
    # the parent had no way to NATS meanwhile (its link cut: the NAK goes when it is back).
    def after_death(nak: float, died: float, *faults: Fault) -> dict:
        lives = {**LIVES, 1: Life(1, T0, T0 + died, parent=100)}
        return check(evidence(BACK, list(faults), lives=lives, handouts=[HOLDER],
                              settles=[said("-NAK", nak, pid=100)])).counts
    assert after_death(20.1, 20.0)["nak_waited"] == 1
    assert after_death(20.1, 20.4)["nak_waited"] == 1          # seen gone once reaped, after the NAK
    assert after_death(20.1, 4.0)["ackwait"] == 1
    cut = Fault("network: the parent's connection cut 15s", T0 + 4.5, T0 + 19.5, frozenset(), parent=100,
                conns=frozenset({9}))
    assert after_death(20.1, 4.0, cut)["nak_waited"] == 1
    other = Fault("network: the parent's connection cut 15s", T0 + 4.5, T0 + 19.5, frozenset(), parent=200,
                  conns=frozenset({9}))
    assert after_death(20.1, 4.0, other)["ackwait"] == 1       # another supervisor's link
    assert judged(said("-NAK", 1.2, seq=2)).counts["ackwait"] == 1
    restart = Fault("nats-server SIGKILL, back 1s later", T0 + 5.0, T0 + 6.0, None, in_control=False)
    report = judged(said("-NAK", 1.2), faults=(kill, restart))
    assert (report.counts["ackwait_outside"], report.counts["nak_waited"]) == (1, 0)
    assert [f for f in report.findings if "may have lost it: nats-server SIGKILL" in f.text]


def test_checker_holds_an_ordered_key_until_its_earlier_jobs_lost_ack_is_made_good():
    """Seed 817 (stop 35): seq 1 of key k ran and its ack was lost; its redelivery was acked unrun
    (the idempotency guard: no journal line) at +31.0 s. Seq 2 of k, NAKed by its first holder,
    was parked by its next until then: the key was busy, the job did not wait for AckWait."""
    lives = {1: Life(1, T0, parent=100), 2: Life(2, T0, parent=100), 3: Life(3, T0, parent=100)}
    def judged(*settles: Settle) -> dict:
        ev = Evidence(stored={1: Stored(1, "j1", T0, order="k"), 2: Stored(2, "j2", T0 + 0.5, order="k")},
                      journal=[Rec(e, pid, seq, d, T0 + t, 0.0, f"j{seq}") for e, pid, seq, d, t in
                               [("S", 3, 1, 1, 1.0), ("D", 3, 1, 1, 1.1), ("S", 2, 2, 2, 31.1), ("D", 2, 2, 2, 31.2)]],
                      faults=[], ack_wait=30.0, origin=T0, lives=lives,
                      handouts=[Handout("chaos-a worker 0", "JOBS", 2, 1, T0 + 2.0, T0 + 2.0, pid=1, conn=3, ppid=100),
                                Handout("chaos-a worker 1", "JOBS", 2, 2, T0 + 3.0, T0 + 3.0, pid=2, conn=4, ppid=100)],
                      settles=list(settles))
        return check(ev).counts
    nak = said("-NAK", 2.05, seq=2)
    assert judged(nak, said("+ACK", 31.0, pid=3, seq=1))["ackwait"] == 0
    assert judged(nak)["ackwait"] == 1                           # no later ack of seq 1: k was free from +1.1 s


def test_checker_takes_a_retrys_nak_lost_with_a_connection_the_server_closed_as_outside():
    """Seed 962: the handler raised at +5.0 s, its worker stopped (in control) across a server
    SIGKILL (outside) that closed its connection at +2.0 s; resumed, it wrote its NAK into that
    dead socket (no NAK reached the server), and the job came back after AckWait. Charged when
    the connection was not closed, or closed by a fault in the supervisor's control."""
    late = [("S", 1, 1, 1, 1.0), ("R", 1, 1, 1, 5.0), ("S", 2, 1, 2, 31.0), ("D", 2, 1, 2, 31.1)]
    stop = Fault("worker SIGSTOP 3.5s", T0 + 1.5, T0 + 5.0, frozenset({1}))
    down = Fault("nats-server SIGKILL, back 2s later", T0 + 2.0, T0 + 4.0, None, in_control=False)
    hand = Handout("chaos-a worker 0", "JOBS", 1, 1, T0 + 0.9, T0 + 0.9, pid=1, conn=3, ppid=100)
    def judged(faults: list[Fault], links: list[Link]) -> dict:
        return check(evidence(late, faults, lives=dict(LIVES), handouts=[hand], links=links)).counts
    closed = Link(3, "chaos-a worker 0", pid=1, ppid=100, closed=T0 + 2.0, how="server")
    assert (judged([stop, down], [closed])["ackwait"], judged([stop, down], [closed])["ackwait_outside"]) == (0, 1)
    assert judged([stop, down], [])["ackwait"] == 1
    cut = Fault("network: worker 0's connection cut", T0 + 2.0, T0 + 2.5, frozenset({1}), conns=frozenset({3}))
    assert judged([stop, cut], [Link(3, "chaos-a worker 0", pid=1, ppid=100, closed=T0 + 2.0, how="cut")])["ackwait"] == 1


# Worker 1's connection #3 (pid 1) closed at +0.5 s with a pull request outstanding (+0.3 s,
# batch 4, 0.5 s): delivery 1 of the job, which BACK brings back at +31.1 s (AckWait 30 s), was
# sent by +1.1 s and the proxy never read it.
CLOSED = Link(3, "chaos-a worker 1", pid=1, ppid=100, closed=T0 + 0.5, how="cut")
PULL = Pull("JOBS", "c", T0 + 0.3, 3, batch=4, expires=0.5)


def test_checker_judges_a_delivery_no_connection_read_by_the_close_it_was_lost_in():
    """Seed 849: the server sent delivery 1 into a pull request of worker 1's connection as a
    worker-cut (outside) closed it, and the parent was SIGKILLed (in control) 0.5 s later: with no
    hand-out, the window rule charged the kill. The candidates are the connections closing, a
    pull request outstanding, at the redelivery less AckWait: all closed by outside faults, the
    wait is outside. One closed by its worker's SIGKILL (in control) is charged; a pull request
    expired or filled before the close, or no candidate, leaves the window rule; a close more than
    a second before the mark is none. Seed 655: the
    same after a delivery that ran, judged as never started, not by the earlier run's worker."""
    cut = Fault("network: worker 1's connection cut 2s", T0 + 0.5, T0 + 2.5, frozenset({1}), in_control=False,
                conns=frozenset({3}))
    kill = Fault("parent SIGKILL, then a new supervisor", T0 + 1.0, T0 + 1.1, frozenset({1, 2}), parent=100)

    def lost(faults: list[Fault], links: tuple = (CLOSED,), pulls: tuple = (PULL,), journal: list = BACK, **kw):
        return check(evidence(journal, faults, lives=dict(LIVES), links=list(links), pulls=list(pulls), **kw))
    report = lost([cut, kill])
    assert (report.counts["ackwait"], report.counts["ackwait_outside"]) == (0, 1)
    (text,) = [f.text for f in report.findings if f.verdict == "ackwait_outside"]
    assert "delivery 1 reached no connection" in text and "#3 'chaos-a worker 1' (pid 1) closed +0.50s by cut" in text
    died = Fault("worker SIGKILL", T0 + 0.45, T0 + 0.46, frozenset({1}))
    assert lost([died, kill], links=[Link(3, "chaos-a worker 1", 1, 100, T0 + 0.5, "client")]).counts["ackwait"] == 1
    filled = [Handout("chaos-a worker 1", "JOBS", 7, 1, T0 + 0.4, T0 + 0.4, pid=1, conn=3)]
    for pulls, kw in (((), {}), ((Pull("JOBS", "c", T0 - 0.5, 3, 4, 0.5),), {}), ((Pull("JOBS", "c", T0 + 0.3, 3),),
                                                                                  {"handouts": filled})):
        assert lost([cut, kill], pulls=pulls, **kw).counts["ackwait"] == 1, pulls
    # Seed 849 again: a worker retired 1.6 s before the mark, closing as its last pull request
    # expired (nothing explains that close): not a candidate, more than LOST_BEFORE before it.
    retired = (Link(6, "chaos-a worker 2", 2, 100, T0 - 0.5, "client"), Pull("JOBS", "c", T0 - 1.0, 6, 4, 0.5))
    assert lost([cut, kill], links=(CLOSED, retired[0]), pulls=(PULL, retired[1])).counts["ackwait"] == 0
    # Seed 52: a job per request, each delivery filling the oldest live one: the last still waited.
    asks = tuple(Pull("JOBS", "c", T0 + t, 3, 1, 0.5) for t in (0.0, 0.1, 0.2, 0.3))
    got = [Handout("chaos-a worker 1", "JOBS", 7, 1, T0 + t, T0 + t, pid=1, conn=3) for t in (0.25, 0.28, 0.35)]
    later = Link(3, "chaos-a worker 1", 1, 100, T0 + 0.75, "cut")
    assert lost([cut, kill], links=(later,), pulls=asks, handouts=got).counts["ackwait"] == 0
    ran = [("S", 2, 1, 1, 0.1), ("S", 5, 1, 3, 31.1), ("D", 5, 1, 3, 31.2)]     # delivery 1 ran; 2 reached nobody
    killed = Fault("worker SIGKILL", T0 + 0.2, T0 + 0.21, frozenset({2}))
    assert lost([killed, cut, kill], journal=ran).counts["ackwait"] == 0
    assert lost([killed, cut, kill], journal=ran, pulls=()).counts["ackwait"] == 1


def test_the_proxy_names_each_delivery_a_stalled_link_kept_from_its_worker(nats_server):
    """chaos/proxy.py reads on through a stall: a delivery the server sent into a stalled link is
    known by its stream sequence and delivery number, with when it came and whether it was ever
    written on (here: never, the link is cut with it unread); one that flowed at once is not."""
    import asyncio
    import contextlib

    import nats

    from chaos.proxy import Proxy

    async def scenario() -> list[Handout]:
        proxy = await Proxy(nats_server).start()
        admin = await nats.connect(nats_server.url)
        worker = await nats.connect(proxy.url, name="w", max_reconnect_attempts=0, allow_reconnect=False)
        try:
            js = admin.jetstream()
            await js.add_stream(name="T", subjects=["t.>"], retention="workqueue")
            sub = await worker.jetstream().pull_subscribe("t.>", durable="c", stream="T")
            await js.publish("t.1", b"1")
            (first,) = await sub.fetch(1, timeout=10)           # flowed: not late
            await first.ack()
            fetching = asyncio.ensure_future(sub.fetch(1, timeout=30))
            await until(lambda: js.consumer_info("T", "c"), lambda i: i.num_waiting == 1)
            await proxy.stall("^w$")
            await js.publish("t.2", b"2")
            await until(lambda: proxy.waiting("^w$"), lambda n: n == 1)
            await proxy.cut("^w$")
            held = await proxy.late()
            fetching.cancel()
            with contextlib.suppress(BaseException):
                await fetching
            return held
        finally:
            await worker.close()
            await admin.close()
            await proxy.close()

    async def until(read, ok) -> None:
        for _ in range(200):
            if ok(await read()):
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the proxy or the server never got there")

    (held,) = asyncio.run(scenario())
    assert (held.name, held.stream, held.seq, held.delivery, held.out) == ("w", "T", 2, 1, None)


CLIENT = """
import asyncio, sys, nats
async def main():
    nc = await nats.connect(sys.argv[1], name="w", allow_reconnect=False)
    sub = await nc.jetstream().pull_subscribe("t.>", durable="c", stream="T")
    (msg,) = await sub.fetch(1, timeout=20)
    print(msg.metadata.sequence.stream, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)   # held until the test closes stdin
asyncio.run(main())
"""


def test_the_proxy_knows_which_process_was_handed_each_delivery(nats_server):
    """chaos/proxy.py records every delivery it carries, with the process holding the client's
    socket (found from the peer's port through /proc): a worker process of its own here, that
    fetches one job and holds it unstarted. Its hand-out names that pid, its parent (us), the
    connection and when it was written on; a cut names whom it hit. Our own connection is ours."""
    import asyncio
    import subprocess
    import sys

    import nats

    from chaos.proxy import Proxy

    async def scenario() -> tuple[int, list[Handout], list, list]:
        proxy = await Proxy(nats_server).start()
        admin = await nats.connect(nats_server.url)
        ours = await nats.connect(proxy.url, name="us")
        child = subprocess.Popen([sys.executable, "-c", CLIENT, proxy.url], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            js = admin.jetstream()
            await js.add_stream(name="T", subjects=["t.>"], retention="workqueue")
            await js.add_consumer("T", durable_name="c", ack_policy="explicit")
            await js.publish("t.1", b"1")
            line = await asyncio.get_running_loop().run_in_executor(None, child.stdout.readline)
            assert line.strip() == "1", line
            t_cut = time.monotonic()
            assert await proxy.cut("^w$") == 1
            # connections(), not the clients as they stand: each pid is looked up in the background
            # (CI on 2643619, loaded: our own connection still read pid 0).
            return child.pid, await proxy.handouts(), await proxy.struck("^w$", t_cut), await proxy.connections()
        finally:
            child.stdin.close()
            child.wait(10)
            await ours.close()
            await admin.close()
            await proxy.close()

    pid, handouts, struck, clients = asyncio.run(scenario())
    (h,) = handouts
    assert (h.name, h.stream, h.consumer, h.seq, h.delivery, h.pid, h.ppid) == ("w", "T", "c", 1, 1, pid, os.getpid())
    assert h.out is not None and h.out >= h.came and h.conn > 0
    assert [(c.conn, c.pid) for c in struck] == [(h.conn, pid)]
    assert {(c.name, c.pid) for c in clients} == {("us", os.getpid()), ("w", pid)}


def test_the_proxy_records_each_settle_pull_request_and_close_a_client_sends_through_it(nats_server):
    """chaos/proxy.py reads what clients send as NATS protocol: a job fetched (a pull request),
    marked in progress, NAKed with a 0.5 s delay, fetched again and TERMed: each settle names the
    job, the delivery, the delay, the connection and our pid; each pull request its consumer and
    batch; a cut names how the connection closed. The reading holds across any chunk boundary.
    A delivery is a MSG line's reply-to only: a fleet heartbeat lists the reply subjects of the
    jobs a supervisor's workers hold, and seed 849's parent was taken to be handed them."""
    import asyncio

    import nats

    from chaos.proxy import Proxy, Upstream, deliveries

    async def scenario() -> tuple[list[Settle], list[Pull], list[Link]]:
        proxy = await Proxy(nats_server).start()
        admin = await nats.connect(nats_server.url)
        worker = await nats.connect(proxy.url, name="w", allow_reconnect=False)
        try:
            js = admin.jetstream()
            await js.add_stream(name="T", subjects=["t.>"], retention="workqueue")
            sub = await worker.jetstream().pull_subscribe("t.>", durable="c", stream="T")
            await js.publish("t.1", b"1")
            (msg,) = await sub.fetch(1, timeout=10)
            await msg.in_progress()
            await msg.nak(delay=0.5)
            (again,) = await sub.fetch(1, timeout=10)
            await again.term()
            await worker.flush()                     # every settle written on to the server
            await proxy.cut("^w$")
            return await proxy.settles(), await proxy.pulls(), await proxy.links()
        finally:
            await worker.close()
            await admin.close()
            await proxy.close()

    settles, pulls, links = asyncio.run(scenario())
    assert [(s.kind, s.stream, s.consumer, s.seq, s.delivery, s.delay) for s in settles] == [
        ("+WPI", "T", "c", 1, 1, 0.0), ("-NAK", "T", "c", 1, 1, 0.5), ("+TERM", "T", "c", 1, 2, 0.0)]
    assert {(s.conn, s.pid, s.name) for s in settles} == {(links[0].conn, os.getpid(), "w")}
    assert len(pulls) >= 2 and {(p.stream, p.consumer, p.batch, p.conn) for p in pulls} == {("T", "c", 1, links[0].conn)}
    assert all(0 < p.expires <= 10 for p in pulls)
    assert [(k.name, k.how, k.closed is not None) for k in links] == [("w", "cut", True)]
    wire = (b'HPUB _INBOX.x 12 14\r\nNATS/1.0\r\n\r\nhi\r\n'
            b'PUB $JS.ACK.T.c.2.9.5.0.0 _INBOX.r 22\r\n-NAK {"delay":1000000}\r\nPING\r\n'
            b'PUB $JS.API.CONSUMER.MSG.NEXT.T.c _INBOX.y 11\r\n{"batch":4}\r\n')
    up = Upstream()
    assert [x for i in range(len(wire)) for x in up.feed(wire[i:i + 1])] == [
        (b"$JS.ACK.T.c.2.9.5.0.0", b'-NAK {"delay":1000000}'), (b"$JS.API.CONSUMER.MSG.NEXT.T.c", b'{"batch":4}')]
    # The other way, a delivery is a MSG line's reply-to, split or not; a payload naming one is none.
    assert deliveries(b"+OK\r\nHMSG t.1 9 $JS.AC", b"K.T.c.2.9.5.0.0 12 14\r\n") == [("T", "c", 9, 2)]
    assert deliveries(b"", b"MSG beat 3 40\r\n$JS.ACK.T.c.2.9.5.0.0 held\r\n") == []


def test_a_connection_gone_during_its_pid_lookup_leaves_the_proxy_readable(nats_server, monkeypatch):
    """A client that closes while the proxy still looks for its pid (seed 604: the run's end broke
    on CancelledError): the drop cancels the connection's writer, which waits for the lookup, and
    must not cancel the lookup with it, or every later read of the records raises."""
    import asyncio

    import chaos.proxy as px

    looking, gone = threading.Event(), threading.Event()

    def slow(port: int, peer_port: int) -> tuple[int, int]:
        looking.set()
        gone.wait(5)                                       # until the client is gone
        return 0, 0
    monkeypatch.setattr(px, "socket_owner", slow)

    async def scenario() -> list:
        loop = asyncio.get_running_loop()
        proxy = await px.Proxy(nats_server).start()
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            assert await loop.run_in_executor(None, looking.wait, 10), "the proxy never looked the client up"
            writer.close()                                 # the writer is waiting for the lookup now
            for _ in range(200):
                if proxy.accepted and not proxy.conns:
                    break
                await asyncio.sleep(0.01)
            gone.set()
            return [await proxy.connections(), await proxy.handouts(), await proxy.struck(".*", 0.0)]
        finally:
            gone.set()
            await proxy.close()
    clients, handouts, struck = asyncio.run(scenario())
    assert [(c.name, c.pid) for c in clients] == [(None, 0)] and handouts == [] and struck == []


def test_checker_takes_a_handler_retry_as_the_reason_for_the_next_delivery():
    retried = [("S", 1, 1, 1, 0.1), ("R", 1, 1, 1, 0.2), ("S", 1, 1, 2, 1.2), ("D", 1, 1, 2, 1.3)]
    c = check(evidence(retried)).counts
    assert (c["unexplained"], c["redelivered"], c["dup"], c["lost"]) == (0, 1, 0, 0)
    silent = [("S", 1, 1, 1, 0.1), ("S", 1, 1, 2, 1.2), ("D", 1, 1, 2, 1.3)]
    assert check(evidence(silent)).counts["unexplained"] == 1
    late = [("S", 1, 1, 1, 0.1), ("R", 1, 1, 1, 0.2), ("S", 1, 1, 2, 30.2), ("D", 1, 1, 2, 30.3)]
    assert check(evidence(late)).counts["ackwait"] == 1          # a retry delay is not an AckWait


def test_checker_judges_unstarted_deliveries_by_the_faults_own_rule():
    """With a peer on the consumer, what was on the wire to a killed worker comes back after
    AckWait (README): the kill is in control for the jobs it held, not for those."""
    never_started = [("S", 2, 1, 2, 30.3), ("D", 2, 1, 2, 30.4)]
    held = [("S", 1, 1, 1, 0.1), ("S", 2, 1, 2, 30.3), ("D", 2, 1, 2, 30.4)]
    kill = Fault("worker SIGKILL", T0 + 0.2, T0 + 0.3, frozenset({1}), unstarted_in_control=False)
    assert check(evidence(never_started, [kill])).counts["ackwait"] == 0
    assert check(evidence(held, [kill])).counts["ackwait"] == 1
    plain = Fault("worker SIGKILL", T0 + 0.2, T0 + 0.3, frozenset({1}))
    assert check(evidence(never_started, [plain])).counts["ackwait"] == 1


def test_checker_adds_up_the_cross_checks_of_a_fleet():
    runs = [("S", 1, 1, 1, 0.1), ("D", 1, 1, 1, 0.2)]
    one = {"crosscheck": {"unexplained_redeliveries": 1, "outstanding": []}}
    two = {"crosscheck": {"unexplained_redeliveries": 2, "outstanding": [{"stream_seq": 1}]}}
    c = check(evidence(runs, statuses=[one, two])).counts
    assert (c["sup_unexplained"], c["sup_open"]) == (3, 1)


def test_checker_takes_a_key_done_under_another_sequence_as_deduplicated():
    """A publisher's retry after the duplicate window stores the key again; the guard acks it unrun."""
    ev = evidence([("S", 1, 1, 1, 0.1), ("D", 1, 1, 1, 0.2)], stored=2)
    ev.stored[2] = Stored(2, "j1", T0 + 1.0)
    c = check(ev).counts
    assert (c["deduplicated"], c["lost"], c["vanished"]) == (1, 0, 0)
    ev.unacked = [2]                                  # still in the stream: the guard never acked it
    assert check(ev).counts["lost"] == 1
    assert check(evidence([], stored=2)).counts["vanished"] == 2


def ordered(journal: list[tuple], faults: list[Fault] = (), stored: int = 2, **kw) -> Evidence:
    """evidence() with every job of one [ordering] key, k."""
    ev = evidence(journal, faults, stored, **kw)
    ev.stored = {s: Stored(s, f"j{s}", T0, "k") for s in ev.stored}
    return ev


def test_checker_flags_a_job_started_before_the_previous_one_of_its_key_ended():
    """seq 2 of key k starts while seq 1 still runs: unexplained, unless a fault touched seq 1's
    worker in between (its link cut past AckWait, so seq 1 ran again elsewhere and that ack let
    the key go on)."""
    runs = [("S", 1, 1, 1, 0.1), ("S", 2, 2, 1, 0.15), ("D", 1, 1, 1, 0.2), ("D", 2, 2, 1, 0.25)]
    c = check(ordered(runs)).counts
    assert (c["reordered"], c["reorder_unexplained"]) == (0, 1)
    cut = Fault("network: worker 0's connection cut", T0 + 0.11, T0 + 0.14, frozenset({1}))
    c = check(ordered(runs, [cut])).counts
    assert (c["reordered"], c["reorder_unexplained"]) == (1, 0)
    in_order = [("S", 1, 1, 1, 0.1), ("D", 1, 1, 1, 0.2), ("S", 2, 2, 1, 0.25), ("D", 2, 2, 1, 0.3)]
    assert check(ordered(in_order)).counts["reorder_unexplained"] == 0
    assert check(evidence(runs, stored=2)).counts["reorder_unexplained"] is None      # [ordering] off


def test_checker_takes_a_killed_run_as_ended_at_its_death_or_its_rerun():
    """seq 1's run dies with its worker (seen a little late), seq 1 runs again, then seq 2: in
    order. seq 1 running again after seq 2 started is a reorder a server SIGKILL can explain."""
    killed = [("S", 1, 1, 1, 0.1), ("S", 3, 1, 2, 0.2), ("D", 3, 1, 2, 0.25), ("S", 2, 2, 1, 0.3), ("D", 2, 2, 1, 0.35)]
    lives = {1: Life(1, T0, T0 + 0.4)}                  # the watcher saw it gone after the rest happened
    assert check(ordered(killed, lives=lives)).counts["reorder_unexplained"] == 0
    again = [("S", 1, 1, 1, 0.1), ("D", 1, 1, 1, 0.2), ("S", 2, 2, 1, 0.3), ("D", 2, 2, 1, 0.35),
             ("S", 3, 1, 1, 0.5), ("D", 3, 1, 1, 0.55)]
    assert check(ordered(again)).counts["reorder_unexplained"] == 1
    server = Fault("nats-server SIGKILL, back 1s later", T0 + 0.25, T0 + 1.25, None, in_control=False)
    c = check(ordered(again, [server])).counts
    assert (c["reordered"], c["reorder_unexplained"]) == (1, 0)


def test_a_delayed_jobs_key_published_again_is_no_firing_of_it():
    """Seed 940: j1 published delayed on key k (its schedule is seq 3, due at +3), then its key
    published again on key q (seq 5, `j1=`, its own subject) while j4 of k ran; the firing came
    as seq 8. Seq 5 keeps its publish's record (key q): no reorder beside j4. Only the firing is
    the delayed job's, and one never seen run is its schedule's seq."""
    pub = Publisher(None)  # type: ignore[arg-type]        # fired() reads only what was published
    pub.delayed = {"j1": Stored(3, "j1", T0 + 3.0, "k")}
    pub.stored = {4: Stored(4, "j4", T0 + 0.9, "k"), 5: Stored(5, "j1", T0 + 1.0, "q")}
    rows = [("S", 1, 4, 1, 1.0, "j4"), ("S", 1, 5, 1, 1.05, "j1"), ("D", 1, 5, 1, 1.1, "j1"),
            ("D", 1, 4, 1, 1.2, "j4"), ("S", 1, 8, 1, 3.1, "j1"), ("D", 1, 8, 1, 3.2, "j1")]
    journal = [Rec(e, pid, seq, d, T0 + t, 0.0, key) for e, pid, seq, d, t, key in rows]
    fired = pub.fired(journal, [], T0)
    assert fired == {8: Stored(8, "j1", T0 + 3.0, "k")}
    ev = Evidence(stored={**pub.stored, **fired}, journal=journal, faults=[], ack_wait=30.0, origin=T0)
    assert check(ev).counts["reorder_unexplained"] == 0
    assert pub.fired(journal[:4], [], T0) == {3: Stored(3, "j1", T0 + 3.0, "k")}   # the firing never ran


def test_a_tick_on_a_keyed_subject_is_of_its_key():
    """Seed 1050 (pools with keys: the tick fires on `jobs.chaos.tick`, key `tick`): an earlier
    tick held in a stalled link kept the later ones parked, with +WPI, until its redelivery was
    acked; the checker took the ticks for unordered jobs kept 26 s and charged them. A tick on
    the plain subject (no third token) is of no key."""
    from types import SimpleNamespace

    def fired(subject: str) -> dict:
        run = SimpleNamespace(sups=[SimpleNamespace(config={"schedules": {"tick": {"every": 1.0, "subject": subject}}})])
        pub = Publisher(run)  # type: ignore[arg-type]
        journal = [Rec("S", 1, 7, 1, T0 + 1.0, 0.0, "tick"), Rec("D", 1, 7, 1, T0 + 1.1, 0.0, "tick")]
        return pub.fired(journal, [], T0)
    assert fired("jobs.chaos.tick") == {7: Stored(7, "tick", T0 + 1.0, "tick")}
    assert fired("jobs.chaos") == {7: Stored(7, "tick", T0 + 1.0, "")}


def test_checker_judges_a_key_within_its_pool():
    """With pools a key is a pool's: pool a's seq 1 and pool b's seq 2 on a key of one name (k)
    may run side by side; two jobs of k in one pool may not."""
    pools = {"main": "workers-a", "side": "workers-b"}
    lives = {1: Life(1, T0, consumer="workers-a"), 2: Life(2, T0, consumer="workers-b")}
    runs = [("S", 1, 1, 1, 0.1), ("S", 2, 2, 1, 0.15), ("D", 1, 1, 1, 0.2), ("D", 2, 2, 1, 0.25)]
    keys = {1: "j1", 2: "b2"}                          # pool b's jobs are keyed bN
    ev = Evidence(stored={s: Stored(s, keys[s], T0, "k") for s in keys}, faults=[], ack_wait=30.0, origin=T0,
                  journal=[Rec(e, pid, seq, d, T0 + t, 0.0, keys[seq]) for e, pid, seq, d, t in runs],
                  pools=pools, lives=lives)
    c = check(ev).counts
    assert (c["reorder_unexplained"], c["wrong_pool"]) == (0, 0)
    ev.pools = {}
    assert check(ev).counts["reorder_unexplained"] == 1
