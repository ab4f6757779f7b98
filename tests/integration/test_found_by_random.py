"""Defects the randomized fault suite (python -m chaos --random) found, each forced on its own
against a real nats-server and the real supervisor, with the seed that found it.

These sit in areas other changes are fixing (the in-transit check); each test is the minimal
reproducer of its finding and fails on the code it was found on.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import nats
import psutil
import pytest
from harness import NatsServer, SupervisorProc, backlog_of, base_config, publish_now, wait_until

from chaos import scenarios
from chaos.checker import VERDICTS
from chaos.core import run_with
from chaos.facts import read_journal
from chaos.rig import CONSUMER, STREAM, SUBJECT, Run
from supervisor.core.ledger import NAK_READ_NAKED, NAK_UNSENT
from supervisor.parent.safety.in_transit import SLACK
from supervisor.parent.safety.peers import SUSPECT_GRACE
from workers.protocol.limitkeys import LEASE_TTL
from workers.runtime.puller import PULL_EXPIRES
from workers.runtime.settle import PINGS_WAIT
from workers.runtime.shutdown import SHUTDOWN_NAK_DELAY

ACK_WAIT = 30.0
JSON_LOGS = ("--log-format", "json")


def test_a_retry_on_its_way_to_a_worker_that_dies_comes_back_at_once(tmp_path):
    """Found by `python -m chaos --random --seed 8 --minutes 0.3` on 59a97ac (a worker SIGSTOPped
    right after its handler raised, then killed by the heartbeat check): the handler's NAK
    (Retry, or an exception with workers.retry_backoff) brought the job back, on the wire to
    that worker, which never read it. The in-transit check skips every job the ledger expects
    back from a NAK, so it skipped this one although the NAK had already been redelivered:
    the job came back only after AckWait (30 s), with the ledger calling it "NAKed at
    delivery 1". A NAK's expectation ends when its redelivery went out; the job must be back
    as soon as any other job on the wire to a dead worker (about a second)."""
    server = NatsServer(tmp_path / "store").start()
    journal = tmp_path / "journal.log"
    cfg = base_config(server, tmp_path, workers={"count": 1, "handler": "chaos.handlers:journal",
                                                 "heartbeat_timeout": 60.0, "batch": 16},
                      consumer={"ack_wait": ACK_WAIT}, restart={"poison_after_crashes": 100})
    sup = SupervisorProc(tmp_path, cfg, env={"CHAOS_JOURNAL": str(journal)}).start()
    try:
        sup.wait_ready()
        # A death in the supervisor's first moments waits for AckWait by design (it cannot tell yet
        # that no other supervisor shares the consumer, nor read the consumer from before the death):
        # the case here starts once it can (seen under load: a kill 0.5 s after the start).
        wait_until(lambda: (s := sup.try_status()) and s["peers"]["alone"] and s["consumer"]["num_pending"] is not None,
                   30, "the supervisor sure it is alone, with a ConsumerInfo reading")
        for attempt in range(1, 6):
            seq, pid = on_the_wire_to_a_stopped_worker(server, sup, journal, attempt)
            if seq is None:
                continue                  # the redelivery was read before the stop: try again
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            back = wait_until(lambda: [r for r in read_journal(journal) if r.seq == seq and r.event == "S"
                                       and r.delivery > 1], ACK_WAIT + 15, "the job run again")
            took = back[0].t - killed
            assert took < ACK_WAIT / 2, (f"seq {seq}: its redelivery was on the wire to worker {pid} when it was "
                                         f"SIGKILLed; it came back {took:.1f}s later (AckWait {ACK_WAIT:g}s)")
            # The evidence: the in-transit check found the redelivery and NAKed it, the ledger
            # explains the next one by that, and the job ran to its end once.
            status = sup.status()
            assert status["peers"]["in_transit_checks"]["redeliveries_naked"] == 1, status["peers"]
            wait_until(lambda: any(r.seq == seq and r.event == "D" for r in read_journal(journal)), 30, "the job done")
            assert [r.delivery for r in read_journal(journal) if r.seq == seq and r.event == "D"] == [back[0].delivery]
            crosscheck = wait_until(lambda: (c := sup.status()["crosscheck"])["in_transit_redeliveries"] >= 1 and c,
                                    10, "the redelivery explained as in transit")
            assert crosscheck["unexplained_redeliveries"] == 0, crosscheck
            return
        raise AssertionError("could not get a redelivery onto the wire to a stopped worker in 5 tries")
    finally:
        sup.cleanup()
        server.stop()


def on_the_wire_to_a_stopped_worker(server: NatsServer, sup: SupervisorProc, journal, attempt: int):
    """Publish a job whose first run raises Retry(0.2); once its NAK is out, SIGSTOP the worker and
    wait for the server to redeliver it (into the worker's live pull request). (seq, pid), or
    (None, pid) when the worker read the redelivery before it stopped."""
    pid = next(iter(sup.worker_pids()))
    seq = publish_now(server.url, count=1, data=f"j{attempt}:retry0.2:0.01", subject="jobs.found")[0]
    wait_until(lambda: (s := sup.try_status()) and s["jobs"]["nak"] >= attempt, 30, "the handler's NAK sent",
               interval=0.005)
    # The worker asks again only after its NAK: stopped before that, it has no request at the
    # server for the redelivery to go out on (the job then waits in the queue, which proves nothing).
    # And its NAK fenced (/status `settling` 0): stopped with the NAK sent and not yet proven read,
    # the worker's death leaves the job to AckWait by design (F10: the parent cannot tell whether
    # the NAK landed), which is not the case here (seen once at -n 6 in CI).
    wait_until(lambda: server.consumer()["num_waiting"] >= 1 and not any(
        w["settling"] for w in sup.status()["workers"]["list"]), 5,
        "the worker's next pull request at the server, its NAK fenced", interval=0.005)
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: server.consumer()["num_redelivered"] >= attempt, 5, "the NAKed job redelivered")
    except AssertionError:
        pass
    started_again = [r for r in read_journal(journal) if r.seq == seq and r.delivery > 1]
    if started_again or server.consumer()["num_redelivered"] < attempt:
        os.kill(pid, signal.SIGCONT)
        wait_until(lambda: any(r.seq == seq and r.event == "D" for r in read_journal(journal)), 60, "the job done")
        return None, pid
    return seq, pid


def test_a_worker_dead_while_the_parents_link_stalls_leaves_nothing_on_the_wire_to_ackwait(tmp_path):
    """Found by `python -m chaos --random --seed 80 --minutes 1` on main at 12000a2: a worker
    SIGSTOPped (killed by the heartbeat check) while the parent's own link was stalled. The
    in-transit check gives up at the first obstacle of the outage ("another supervisor may hold
    deliveries of this consumer": a parent that cannot hear the ledger subject cannot tell it
    is alone; here "ConsumerInfo failed: nats: timeout") and says what was on the wire "comes
    back after AckWait (explained as in transit)"; it did come back after AckWait, and the
    ledger counted it unexplained all the same. The stall healed long before: the check can
    run then, as the held-back NAKs do. Here the stall lasts 6 s, a burst is published right
    after the SIGSTOP so the stopped worker's waiting pull request takes some of it, and a job
    on the wire to the dead worker must be back long before AckWait (30 s)."""
    def stalled_parent_dead_worker(run: Run) -> None:
        scenarios.single(run, proxy=True, workers={"count": 2, "heartbeat_timeout": 2.0})
        run.load(10, rate=5, what="0.05")
        scenarios.flowing(run, 10)
        time.sleep(1.5)                  # the schedule: both workers idle, each with a pull request waiting
        t0 = time.monotonic()
        assert run.bg.call(run.proxy.stall(scenarios.PARENT)) == 1, "the parent's link is not through the proxy"
        victim = sorted(run.sup.worker_pids())[0]
        stop = run.fault("worker SIGSTOP, killed by the heartbeat check", time.monotonic(), pids={victim})
        os.kill(victim, signal.SIGSTOP)
        run.load(8, rate=200, what="0.05")   # a burst: the stopped worker's pull request takes some of it
        wait_until(lambda: not run.watcher.alive(victim), 30, "the heartbeat check to kill the stopped worker")
        stop.t1 = run.watcher.lives[victim].died or time.monotonic()
        time.sleep(max(0.0, t0 + 6.0 - time.monotonic()))     # the stall lasts 6 s in all
        run.bg.call(run.proxy.heal(scenarios.PARENT))
        run.fault("network: the parent's connection stalled 6 s", t0, time.monotonic(), pids=set())

    for attempt in range(3):
        result = run_with("stalled-parent-dead-worker", attempt, stalled_parent_dead_worker, dict(VERDICTS),
                          tmp_path / f"run{attempt}")
        assert not result.error, result.summary()
        on_the_wire = [f for f in result.findings if f.verdict == "bounced" or "never started" in f.text]
        if on_the_wire:                        # something was on the wire at the death: the case
            break
    else:
        raise AssertionError("no job was on the wire to the dead worker in 3 tries")
    assert result.counts["ackwait"] == 0, result.summary()
    assert result.passed, result.summary()



STALL = 5.0                 # two long jobs' 1.5 s, then two pull requests' lives (PULL_EXPIRES + PULL_MARGIN)
WORKER_0 = r" worker 0$"    # the proxy's name pattern for worker 0's connection


def test_a_worker_killed_after_a_stall_has_no_more_on_its_wire_than_its_credits(tmp_path):
    """Found by `python -m chaos --random --seed 18 --minutes 0.25` on d89b94e: a worker SIGKILLed
    just after a 3.2 s server SIGSTOP; "8 unaccounted message(s), more than the 5 the dead
    worker(s) asked for": the in-transit check left all of them to AckWait. The worker saw no
    PONG and no 408 while the server was stopped, gave its pull request up 2 s after sending it
    (PULL_EXPIRES + PULL_MARGIN) and asked again, and again; the server, running again, read
    all those requests at once, each living PULL_EXPIRES from then, and filled every one, while
    the credits counted the last. To the worker a stalled server and a stalled link are one
    thing (nothing read, nothing answered); the link stall, through the proxy, has an exact
    length and lets jobs be stored meanwhile. The only worker runs two 1.5 s jobs (so it has no
    request out) when its link stalls for STALL s; it asks again when they end, jobs are
    published, it is SIGSTOPped just before the heal (the requests the heal hands the server
    are filled into a socket nobody reads) and SIGKILLed once the server has filled them.
    Every job must be back long before AckWait."""
    def stalled_worker_killed(run: Run) -> None:
        scenarios.single(run, proxy=True, workers={"count": 1, "concurrency": 2, "batch": 2,
                                                   "heartbeat_timeout": 60.0})
        [victim] = run.sup.worker_pids()
        ready = time.monotonic()
        run.load(2, rate=100, what="1.5")
        wait_until(lambda: len(run.running()) == 2, 30, "two long jobs running: no pull request out")
        # The check's lower bound: a ConsumerInfo answered after the worker started and more than
        # SLACK before the worker's last answer from NATS, which is about when the stall begins.
        polled = wait_until(lambda: (age := run.sup.status()["consumer"].get("poll_age_s")) is not None
                            and (t := time.monotonic() - age) > ready and t, 30, "a poll by the supervisor's monitor since")
        wait_until(lambda: time.monotonic() > polled + 2 * SLACK, 5, "that poll more than SLACK old")
        t0 = time.monotonic()
        assert run.bg.call(run.proxy.stall(WORKER_0)) == 1, "worker 0's link is not through the proxy"
        run.load(8, rate=200, what="0.01")
        wait_until(lambda: pending(run) >= 8, 10, "the jobs stored, none delivered")
        time.sleep(max(0.0, t0 + STALL - time.monotonic()))   # the stall's length
        os.kill(victim, signal.SIGSTOP)
        kill = run.fault("worker SIGSTOP, SIGKILL after its link's stall", time.monotonic(), pids={victim})
        run.bg.call(run.proxy.heal(WORKER_0))
        wait_until(lambda: pending(run) <= 6, 10, "the server filling worker 0's requests")
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: not run.watcher.alive(victim), 30, "worker 0 gone")
        kill.t1 = time.monotonic()

    result = run_with("stalled-worker-killed", 0, stalled_worker_killed, dict(VERDICTS), tmp_path / "run")
    assert not result.error, result.summary()
    assert [f for f in result.findings if f.verdict == "bounced"], f"nothing on the wire at the death: {result.summary()}"
    assert result.counts["ackwait"] == 0, result.summary()
    assert result.passed, result.summary()


def pending(run: Run) -> int:
    state = run.bg.call(run.queue_state())
    return state[1] if state else -1


STOP = 3.5                  # seed 18's 3.2 s, and past when the worker gives a request read before it up
NEXT, PING, PONG, TIMEOUT = b"MSG.NEXT", b"PING\r\n", b"PONG\r\n", b"408 Request Timeout"


@pytest.mark.parametrize("fault", ["server-stop", "link-stall"])
def test_what_a_request_read_before_a_stall_sends_after_it_is_on_the_worker_credits(tmp_path, fault):
    """F7's second form. CI on 176dad2, seed 18 in the suite: a worker SIGKILLed 0.05 s after a
    3.2 s server SIGSTOP ended had 6 jobs on its wire and no credits for them, 40 ms after "a
    message came that none of its pull requests accounted for"; the 6 waited for AckWait. The
    idle worker's request R1 (2 messages) is read by the server, and a PONG after it comes back,
    just before the stall. R1 expires inside it, and its 408 waits: the server, stopped, sends
    it once it runs again (it checks a request's expiry before filling it); a stalled link
    holds it. The worker gave R1's credits up PULL_EXPIRES + PULL_MARGIN after that PONG and
    asked again (R2). Then R1's 408 comes and takes R1's unfilled count from the credits, which
    count R2's alone: none left, R2 live. With the link stalled, a job published meanwhile also
    fills part of R1 and arrives on R2's credits. The worker answers the 408 with a new request
    (its credits are 0): right then it is SIGSTOPped, and jobs are published for whatever
    requests are live (all within a request's life: nothing expires unread), and the worker is
    SIGKILLed once the server has filled them. Every job on its wire must be NAKed at once by
    the in-transit check; none may wait for AckWait. Red with the credits given up on the clock
    (`Puller.expire_lost_pull` before the fix): "4 (or 3) unaccounted message(s), more than the
    2 (or 1) the dead worker(s) asked for"."""
    def stalled_then_killed(run: Run) -> None:
        server = run.start_server()
        run.connect([server.url])
        proxy = run.start_proxy(server)
        run.bg.call(proxy.tap(WORKER_0, (NEXT, PING), (PONG, TIMEOUT)))   # from its first PING: PONGs match by count
        run.start_supervisor([proxy.url], workers={"count": 1, "concurrency": 2, "batch": 2, "heartbeat_timeout": 60.0})
        [victim] = run.sup.worker_pids()
        alone_and_polled(run, time.monotonic())
        t_req = wait_until(lambda: last_request_read(run), 30, "the worker's request read, with time left to live")
        t0 = time.monotonic()
        if fault == "server-stop":
            server.pause()
        else:
            assert run.bg.call(proxy.stall(WORKER_0)) == 1, "worker 0's link is not through the proxy"
            run.load(1, rate=100, what="3").result(5)        # into R1, and the stalled link
        assert not [t for t, what in tapped(run) if what == NEXT and t_req < t < t0], "a request went out just before"
        time.sleep(max(0.0, t0 + STOP - time.monotonic()))   # the stall's length
        server.resume() if fault == "server-stop" else run.bg.call(proxy.heal(WORKER_0))
        run.fault(f"{fault} of {STOP:g}s", t0, time.monotonic(), pids=set(), in_control=False)
        asked = sum(what == NEXT and t0 < t for t, what in tapped(run))
        wait_until(lambda: answered_408(run, t0), 10, "R1's 408 read, and a request asked after it", interval=0.002)
        os.kill(victim, signal.SIGSTOP)
        kill = run.fault("worker SIGSTOP, SIGKILL after a stall", time.monotonic(), pids={victim})
        run.notes.append(f"the worker asked {asked} time(s) during the {fault}")
        run.load(6, rate=1000, what="0.01", window=6).result(30)
        wait_until(lambda: pending(run) in range(6) and waiting(run) == 0, 10, "the server filling worker 0's requests")
        assert not [t for t, what in tapped(run) if what == TIMEOUT and t > kill.t0], "a request expired unread"
        alone_and_polled(run, time.monotonic() - 30)
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: not run.watcher.alive(victim), 30, "worker 0 gone")
        kill.t1 = time.monotonic()

    result = run_with(f"{fault}-killed-worker", 0, stalled_then_killed, dict(VERDICTS), tmp_path / "run")
    assert not result.error, result.summary()
    assert [f for f in result.findings if f.verdict == "bounced"], f"nothing on the wire at the death: {result.summary()}"
    assert result.counts["ackwait"] == 0, result.summary()
    assert result.passed, result.summary()


@pytest.mark.parametrize("grace", [10.0, 1.0], ids=["within-grace", "grace-ends-in-the-stall"])
def test_a_worker_stopping_while_its_link_stalls_listens_until_its_request_is_over(tmp_path, grace):
    """Found while fixing F7's second form, by reading the stopping path: a worker told to stop
    (a drain, a scale-down, a recycle) waits for its last pull request to end before it drops
    its subscription, but it took the end from the clock (PULL_EXPIRES + PULL_MARGIN after the
    server read it). The idle worker's request R1 is read, then its link stalls; two jobs
    published meanwhile fill R1 into the stalled link; the worker is SIGTERMed. By the clock R1
    was over within the stall: the worker unsubscribed, and the two jobs reached it after the
    stall for nobody. It exited cleanly, so no in-transit check ran: they came back after
    AckWait, explained by nothing. Now the worker keeps listening until its credits are
    accounted for (the jobs come and are NAKed as a stopping worker NAKs what it holds),
    within graceful_timeout.

    F20, found by `python -m chaos --random --seed 966` (a scale-down with graceful_timeout 1 s
    during a 7 s stall of the worker's link): when graceful_timeout runs out first, the worker
    gives its live request up and exits cleanly, with what the server filled into it still on
    the stalled link. Its table keeps the credits it gave up, so the parent runs the in-transit
    check as after a death and NAKs those jobs at once; and the worker's exit is bounded by its
    deadline, not by nats-py's drain and flush timeouts (10 s each on a stalled link), so the
    check still has a ConsumerInfo from before the worker's last answer. Red before: the two
    jobs came back after AckWait, the worker 20 s in closing its connection."""
    def stopping_through_a_stall(run: Run) -> None:
        server = run.start_server()
        run.connect([server.url])
        proxy = run.start_proxy(server)
        run.bg.call(proxy.tap(WORKER_0, (NEXT, PING), (PONG,)))
        run.start_supervisor([proxy.url], workers={"count": 1, "concurrency": 2, "batch": 2, "heartbeat_timeout": 60.0,
                                                   "graceful_timeout": grace})
        [victim] = run.sup.worker_pids()
        alone_and_polled(run, time.monotonic())
        t_req = wait_until(lambda: last_request_read(run), 30, "the worker's request read, with time left to live")
        t0 = time.monotonic()
        assert run.bg.call(proxy.stall(WORKER_0)) == 1, "worker 0's link is not through the proxy"
        assert not [t for t, what in tapped(run) if what == NEXT and t_req < t < t0], "a request went out just before"
        run.load(2, rate=100, what="0.01").result(5)
        wait_until(lambda: run.bg.call(run.queue_state()) == (2, 0, 2), STOP, "R1 filled into the stalled link")
        stop = run.fault("worker SIGTERM during its link's stall", time.monotonic(), pids={victim})
        os.kill(victim, signal.SIGTERM)
        if grace < STOP:                 # the stall outlasts the worker: it exits inside it
            wait_until(lambda: exited(victim), grace + 10, "worker 0 exited within its grace and a bounded close")
        time.sleep(max(0.0, t0 + STOP - time.monotonic()))   # the stall's length
        run.bg.call(proxy.heal(WORKER_0))
        run.fault(f"link-stall of {time.monotonic() - t0:.1f}s", t0, time.monotonic(), pids=set(), in_control=False)
        wait_until(lambda: not run.watcher.alive(victim), 30, "worker 0 exited")
        stop.t1 = time.monotonic()
        if grace < STOP:
            status = wait_until(lambda: (s := run.sup.status())["peers"]["in_transit_checks"]["runs"] and s, 10,
                                "the in-transit check run for the credits the worker gave up")
            assert status["peers"]["in_transit_checks"]["naked"] == 2, status["peers"]

    result = run_with("stopping-through-a-stall", 0, stopping_through_a_stall, dict(VERDICTS), tmp_path / "run")
    assert not result.error, result.summary()
    assert result.counts["ackwait"] == 0, result.summary()
    assert result.passed, result.summary()


def exited(pid: int) -> bool:
    """The process has exited. (Not the chaos watcher's word: it counts a worker gone once its
    parent is, and an orphan runs on, finishing and NAKing, after that.)"""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_an_orphans_nak_redelivered_to_a_worker_that_dies_comes_back_at_once(tmp_path):
    """F9, found by `python -m chaos --random --seed 18 --minutes 0.25` on this branch (1 run of 8):
    the parent SIGKILLed and a new supervisor started; the orphaned workers NAKed what they had
    not started (with the shutdown's 2 s delay) and announced it; the redeliveries went to a
    worker of the new supervisor, which was SIGKILLed before it read them. The in-transit check
    finds first deliveries above its lower bound; a redelivery it finds only for its own workers'
    NAKs (F1), so these two waited for AckWait. Here alpha's only worker holds jobs it has not
    started when alpha is SIGKILLed (the worker SIGSTOPped meanwhile, so the NAKs come once beta
    runs); beta's only worker has a request waiting, made fresh by a short job, when the NAKs'
    delay ends: its link is stalled right after that request, so what the server hands it stays
    on its wire, and it is SIGKILLed once the orphan has said goodbye. The redeliveries must be
    back at once, NAKed by beta's check; none may wait for AckWait."""
    alpha_worker, beta_worker = r"^alpha worker 0$", r"^beta worker 0$"

    def orphan_nak_on_the_wire(run: Run) -> None:
        proxy, alpha, orphan = alpha_running_one_and_holding_more(run, alpha_worker, "1.0")
        run.bg.call(proxy.tap(beta_worker, (NEXT,)))
        os.kill(orphan, signal.SIGSTOP)
        t_kill = time.monotonic()
        alpha.proc.kill()
        alpha.proc.wait()
        run.stopped.add(run.sups.index(alpha))                  # on purpose: no death to count
        parent = run.fault("parent SIGKILL, its worker SIGSTOPped", t_kill, pids={orphan})
        beta = run.start_supervisor([proxy.url], nats={"name": "beta"},
                                    workers={"count": 1, "concurrency": 2, "batch": 2, "heartbeat_timeout": 60.0})
        [victim] = beta.worker_pids()
        alone_and_polled(run, time.monotonic())
        os.kill(orphan, signal.SIGCONT)
        t_nak = wait_until(lambda: min((t for t, _ in run.bg.call(proxy.tapped(alpha_worker))), default=None),
                           10, "the orphan's NAKs")
        wait_until(lambda: exited(orphan), 10, "the orphan gone")
        parent.t1 = time.monotonic()
        time.sleep(max(0.0, t_nak + 1.3 - time.monotonic()))   # the schedule: a job ends just before the delay
        done = run.done_count()
        run.load(1, rate=100, what="0.2").result(5)
        ran = wait_until(lambda: run.done_count() > done and run.tail.poll(), 5, "the short job done")
        last_done = max(r.t for r in ran if r.event == "D")
        wait_until(lambda: [t for t, what in tapped_on(run, beta_worker) if what == NEXT and t > last_done], 5,
                   "beta's worker asking again", interval=0.002)
        assert run.bg.call(proxy.stall(beta_worker)) == 1, "beta's worker's link is not through the proxy"
        kill = run.fault("worker link stalled, then SIGKILL", time.monotonic(), pids={victim})
        assert time.monotonic() < t_nak + 1.9, "too late: the redeliveries may have gone out already"
        wait_until(lambda: waiting(run) == 0, 5, "the redeliveries handed to beta's worker's requests")
        wait_until(lambda: [o for o in beta.status()["peers"]["gone"] if "orphan of" in o], 10, "the orphan's goodbye")
        alone_and_polled(run, time.monotonic() - 30)
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: not run.watcher.alive(victim), 30, "beta's worker gone")
        kill.t1 = time.monotonic()
        run.bg.call(proxy.heal(beta_worker))

    result = run_with("orphan-nak-on-the-wire", 0, orphan_nak_on_the_wire, dict(VERDICTS), tmp_path / "run")
    assert not result.error, result.summary()
    assert [f for f in result.findings if f.verdict == "redelivered"], result.summary()
    assert result.counts["ackwait"] == 0, result.summary()
    assert result.passed, result.summary()


def test_an_orphans_naks_reach_a_successor_that_started_after_it_left(tmp_path):
    """F9's successor, started only after the orphan left: found by `python -m chaos --random
    --seed 18 --minutes 0.25` on branch f7 (1 run of 20, with the orphans' fleet claim): the new
    supervisor took 2.6 s to start on the loaded box, the orphans had NAKed what they had not
    started and said goodbye before it listened on the ledger subject; the redeliveries went to its
    worker, SIGKILLed right after a server stop before reading them, and 6 jobs waited for
    AckWait. (Before the claim, the poller's release of what the dead parent's last heartbeat
    listed brought them back, by luck: seed 52.) An orphan now leaves its NAKs and goodbye in the
    fleet bucket too, and every supervisor reads those records from its start. Here alpha's worker
    holds jobs it has not started, alpha is SIGKILLed, and the orphan NAKs them and exits; then
    beta starts, its worker's first pull request reaches the server and its link stalls right
    after (the redeliveries stay on its wire), and the worker is SIGKILLed: they must be back at
    once. Red without the record: every one of them after AckWait."""
    alpha_worker, beta_worker = r"^alpha worker 0$", r"^beta worker 0$"

    def orphan_gone_before_its_successor(run: Run) -> None:
        proxy, alpha, orphan = alpha_running_one_and_holding_more(run, alpha_worker, "0.5")
        t_kill = time.monotonic()
        alpha.proc.kill()
        alpha.proc.wait()
        run.stopped.add(run.sups.index(alpha))                  # on purpose: no death to count
        parent = run.fault("parent SIGKILL", t_kill, pids={orphan})
        wait_until(lambda: exited(orphan), 10, "the orphan gone")
        parent.t1 = time.monotonic()
        naks = [t for t, _ in run.bg.call(proxy.tapped(alpha_worker))]
        assert naks, "the orphan NAKed nothing"
        # Their delay over: the redeliveries wait for the first pull request to come (beta's worker's).
        time.sleep(max(0.0, max(naks) + SHUTDOWN_NAK_DELAY + 0.2 - time.monotonic()))
        run.bg.call(proxy.hold(beta_worker, NEXT, after=True))
        beta = run.start_supervisor([proxy.url], nats={"name": "beta"},
                                    workers={"count": 1, "heartbeat_timeout": 60.0})
        [victim] = beta.worker_pids()
        wait_until(lambda: run.bg.call(proxy.holding(beta_worker)), 10, "beta's worker's request out, its link held")
        kill = run.fault("worker link held, then SIGKILL", time.monotonic(), pids={victim})
        wait_until(lambda: [o for o in beta.status()["peers"]["gone"] if "orphan of" in o], 10,
                   "the orphan's record read")
        wait_until(lambda: waiting(run) == 0, 10, "the redeliveries handed to beta's worker's request")
        alone_and_polled(run, time.monotonic() - 30)
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: not run.watcher.alive(victim), 30, "beta's worker gone")
        kill.t1 = time.monotonic()
        run.bg.call(proxy.reset(beta_worker))
        wait_until(lambda: beta.status()["peers"]["in_transit_checks"]["redeliveries_naked"], 15, "the redeliveries NAKed")

    result = run_with("orphan-gone-before-its-successor", 0, orphan_gone_before_its_successor, dict(VERDICTS),
                      tmp_path / "run")
    assert not result.error, result.summary()
    assert [f for f in result.findings if f.verdict == "bounced"], f"nothing on the wire at the death: {result.summary()}"
    assert result.counts["ackwait"] == 0, result.summary()
    assert result.passed, result.summary()


def alpha_running_one_and_holding_more(run: Run, alpha_worker: str, seconds: str):
    """A server, the proxy (alpha's worker's NAKs tapped), supervisor alpha with one worker that
    runs a job of `seconds` and holds at least two more it has not started. (proxy, alpha, its worker's pid)"""
    server = run.start_server()
    run.connect([server.url])
    proxy = run.start_proxy(server)
    run.bg.call(proxy.tap(alpha_worker, (b"-NAK",)))
    alpha = run.start_supervisor([proxy.url], nats={"name": "alpha"},
                                 workers={"count": 1, "batch": 8, "heartbeat_timeout": 60.0})
    run.load(40, rate=400, what="0", window=8).result(30)     # fast jobs: the worker learns its job time
    wait_until(lambda: run.done_count() == 40, 30, "the warm-up done")
    [orphan] = alpha.worker_pids()
    # A backlog of fast jobs, then the long ones, stored while the worker is stopped: on a backlog
    # it buffers whatever the spread of its job times (pulls.py), so it runs a long job and holds
    # more, on a loaded box too (without a backlog it takes only what it can start until the fleet
    # has seen KNOWN_JOBS jobs).
    os.kill(orphan, signal.SIGSTOP)
    run.load(100, rate=5000, what="0", window=32).result(30)
    fast_until = run.bg.call(run.nc.jetstream().stream_info(STREAM)).state.last_seq
    run.load(6, rate=400, what=seconds, window=6).result(30)
    os.kill(orphan, signal.SIGCONT)
    wait_until(lambda: len([e for w in alpha.status()["workers"]["list"] for e in w["in_flight"]
                            if e["state"] == "held" and e["stream_seq"] > fast_until]) >= 2, 30,
               "alpha's worker running a long job and holding more")
    return proxy, alpha, orphan


PARENT = r"^jetstream-supervisor$"    # the proxy's name pattern for the parent's own connection


def test_a_nak_unsent_at_a_workers_death_waits_for_ackwait_named_at_the_death(tmp_path):
    """F10, found by `python -m chaos --random --seed 18 --minutes 0.25` on branch f7 (1 run of 10):
    a handler failed just after a server stop (its NAK with a 0.36 s delay) and its worker was
    SIGKILLed 0.1 s later, the NAK still unsent. Its table entry was SETTLED (a NAK published, not
    fenced): the parent must not NAK it again, since that NAK may still be in the dead worker's
    socket or in a stalled link and land on the next holder's delivery (a NAK matches by
    sequence): the job would run twice. So it waits for AckWait, and the wait must be attributed:
    the ledger names it at the death, with that cause, and the redelivery is explained by it.
    Here the handler raises Retry(0.5) and the worker's link holds its NAK (the proxy stalls the
    connection right before forwarding it); the worker is SIGKILLed with the NAK in the link, which
    is then reset (the NAK never lands). Back after AckWait, not NAKed by the parent, named at the
    death ("its NAK was unsent when the worker died; ..."), explained with that cause in /status,
    the log and the checker's view (an AckWait wait outside the supervisor's control only because
    the ledger named that job, delivery and pid), 0 unexplained. Red before the ledger named such
    waits: the checker's ackwait=1 (a worker SIGKILL is in the supervisor's control)."""
    ack_wait = 5.0
    seen: dict = {}

    def nak_held_in_the_link(run: Run) -> None:
        proxy = proxied(run, ack_wait)
        run.bg.call(proxy.tap(PARENT, (b"-NAK",)))
        run.bg.call(proxy.hold(WORKER_0, b"-NAK"))
        run.start_supervisor([proxy.url], workers={"count": 1, "heartbeat_timeout": 60.0})
        [victim] = run.sup.worker_pids()
        run.load(1, rate=100, what="retry0.5:0.01").result(5)
        t_held = wait_until(lambda: run.bg.call(proxy.holding(WORKER_0)), 10, "the worker's NAK held in its link")[0]
        wait_until(lambda: run.sup.status()["jobs"]["nak"] == 1, 5, "the worker's table: its NAK published")
        link = run.fault("worker link holding its NAK", t_held, pids={victim}, in_control=False)
        run.signal_worker(victim, signal.SIGKILL, "worker SIGKILL")
        seen["died"] = time.monotonic()
        assert run.bg.call(proxy.reset(WORKER_0)) == 1, "the dead worker's connection is gone from the proxy"
        link.t1 = time.monotonic()
        seen["status"] = wait_until(lambda: (s := run.sup.status())["crosscheck"]["left_to_ack_wait"]
                                    and s["crosscheck"]["left_to_ack_wait"][0]["came_back_after_s"] is not None and s,
                                    ack_wait + 15, "the job back, after AckWait")
        seen["parent_naks"] = run.bg.call(proxy.tapped(PARENT))
        seen["log"] = run.sup.log()

    result = run_with("nak-unsent-at-a-death", 0, nak_held_in_the_link, dict(VERDICTS), tmp_path / "run")
    assert not result.error, result.summary()
    assert seen["parent_naks"] == [], f"the parent NAKed: {seen['parent_naks']}"
    cc = seen["status"]["crosscheck"]
    [left] = cc["left_to_ack_wait"]
    why = "its NAK was unsent when the worker died; a second NAK could land on the next holder"
    assert (left["delivery"], left["state_at_death"], left["naked"], left["waits"]) == (1, "settled", False, why), left
    assert left["came_back_after_s"] >= left["due_after_s"] - 0.5, left        # after AckWait, not sooner
    assert cc["held_jobs_left_to_ack_wait"] == 1 and cc["unexplained_redeliveries"] == 0, cc
    assert re.search(rf"died: .*seq {left['stream_seq']} \(delivery 1\) left to AckWait: {re.escape(why)}", seen["log"])
    assert re.search(rf"seq={left['stream_seq']} redelivered \(delivery 2\).*at its death.*: {re.escape(why)}", seen["log"])
    assert (result.counts["ackwait"], result.counts["ackwait_outside"]) == (0, 1), result.summary()
    outside = [f.text for f in result.findings if f.verdict == "ackwait_outside"]
    assert outside and "named at the death" in outside[0] and why in outside[0], result.summary()
    assert result.passed, result.summary()


@pytest.mark.parametrize(("heal", "delay"), [("after-the-nak", 1.0), ("once-raised", 3.0)])
def test_a_ping_that_reaches_the_server_after_a_retrys_nak_does_not_stretch_its_delay(tmp_path, heal, delay):
    """F19 (F15's third point, seed 604's started waits): a handler's Retry(0.1) came back after a
    whole AckWait. The parent's +WPI and the worker's NAK go out on two connections; a +WPI the
    server reads after a NAK with a delay restarts the AckWait timer that NAK set (nats-server
    consumer.go: processNak sets the delivery's timestamp to now - AckWait + delay,
    progressUpdate to now), so the retry waits a whole AckWait. Here the job runs until the test
    says; its +WPI (due at a third of AckWait) is held in the parent's link by the proxy; then the
    handler raises Retry, and the parent's link flows again either once the server has processed
    the worker's NAK (its advisory: the worker waited the whole delay, under PINGS_WAIT, for the
    round, then NAKed plain) or as soon as the handler raised (the round's fence comes back and
    the worker NAKs with the rest of its delay, long before PINGS_WAIT). Red before the handshake
    (slots.PINGS_BEGUN): the +WPI landed after the NAK and the job ran again an AckWait later."""
    ack_wait = 12.0
    seen: dict = {}

    def retry_while_a_ping_is_in_the_link(run: Run) -> None:
        proxy = proxied(run, ack_wait)
        naked: list[float] = []

        async def on_nak(msg) -> None:
            naked.append(time.monotonic())
        run.bg.call(run.nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.MSG_NAKED.{STREAM}.{CONSUMER}", cb=on_nak))
        run.bg.call(proxy.hold(PARENT, b"+WPI"))
        gate = run.dir / "gate"
        run.start_supervisor([proxy.url], env={"CHAOS_GATE": str(gate)},
                             workers={"count": 1, "heartbeat_timeout": 60.0})
        run.load(1, rate=100, what=f"retry{delay}:0.01").result(5)
        wait_until(lambda: run.bg.call(proxy.holding(PARENT)), ack_wait, "the parent's +WPI held in its link")
        gate.touch()
        if heal == "once-raised":
            wait_until(lambda: any(r.event == "R" for r in read_journal(run.journal)), 10, "the handler raised",
                       interval=0.005)
            run.bg.call(proxy.heal(PARENT))
        seen["naked"] = wait_until(lambda: list(naked), 10, "the worker's NAK processed by the server")[0]
        run.bg.call(proxy.heal(PARENT))
        seen["back"] = wait_until(lambda: [r for r in read_journal(run.journal) if r.event == "S" and r.delivery == 2],
                                  ack_wait + 15, "the job run again")[0]
        seen["raised"] = next(r for r in read_journal(run.journal) if r.event == "R")

    result = run_with("ping-after-a-nak", 0, retry_while_a_ping_is_in_the_link, dict(VERDICTS), tmp_path / "run")
    assert not result.error, result.summary()
    took = seen["back"].t - seen["raised"].t
    assert took < ack_wait / 2, (f"Retry({delay:g}) ran again {took:.1f}s after it was raised (AckWait {ack_wait:g}s): "
                                 f"a +WPI landed after its NAK")
    if heal == "once-raised":      # the fence, not PINGS_WAIT, let the NAK go; and with its delay kept
        assert seen["naked"] - seen["raised"].t < PINGS_WAIT * 0.75, seen
        assert took > delay - 0.5, f"ran again {took:.1f}s after Retry({delay:g})"
    assert result.passed, result.summary()


def proxied(run: Run, ack_wait: float):
    """A server with the consumer's AckWait, the runner's client on it, and the proxy in front."""
    run.ack_wait = ack_wait
    server = run.start_server()
    run.connect([server.url])
    return run.start_proxy(server)


@pytest.mark.parametrize("order", ["advisory, death", "death, advisory"])
def test_a_retry_read_by_the_server_before_its_workers_death_comes_back_at_once(tmp_path, order):
    """F18, found by CI at `-n 6` on the test above this module's first (its original flake): a
    handler's Retry, the worker's NAK read by the server, which redelivered the job into that
    worker's own pull request, and the worker killed before the NAK's fence came back, so its
    entry was still SETTLED: the parent cannot tell from the table whether the NAK was read, so by
    F10 the job waited for AckWait. The server's MSG_NAKED advisory (sent from inside processNak)
    tells it: once it came, the in-transit check NAKs the redelivery on the dead worker's wire.
    Here the worker's link is held one way right after its NAK reaches the server: the NAK, its
    fence's PING and its next pull request go on, the PONG and the redelivery (delivery 2) wait
    in the proxy. Once the test's own subscription has the advisory and the proxy has delivery 2
    for the worker, it is SIGKILLed: the job must run again (delivery 3) long before AckWait
    (30 s), by the parent's NAK, once, acked, explained. Red on main: back after AckWait.
    "death, advisory": the parent's own link is stalled from before the job until its ledger has
    the death (the job named left to AckWait, NAK_UNSENT), so the advisory reaches it after."""
    seen: dict = {}

    def nak_read_then_killed(run: Run) -> None:
        proxy = proxied(run, ACK_WAIT)
        advisories: list[dict] = []

        async def on_naked(msg) -> None:
            advisories.append(json.loads(msg.data))
        run.bg.call(run.nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.MSG_NAKED.{STREAM}.{CONSUMER}", cb=on_naked))
        run.bg.call(proxy.tap(PARENT, (b"-NAK",)))
        run.bg.call(proxy.hold(WORKER_0, b"-NAK", after=True, one_way=True))
        run.start_supervisor([proxy.url], workers={"count": 1, "heartbeat_timeout": 60.0}, log={"format": "json"})
        [victim] = run.sup.worker_pids()
        wait_until(lambda: (s := run.sup.try_status()) and s["peers"]["alone"], 30, "the supervisor sure it is alone")
        if order == "death, advisory":
            seen["stalled"] = time.monotonic()
            assert run.bg.call(proxy.stall(PARENT)) == 1, "the parent's link is not through the proxy"
        seq = seen["seq"] = publish_run(run, "f18:retry0:0.01")
        wait_until(lambda: [a for a in advisories if (a["stream_seq"], a["deliveries"]) == (seq, 1)], 10,
                   "the server's advisory: it processed the worker's NAK")
        wait_until(lambda: [h for h in run.bg.call(proxy.handouts()) if (h.seq, h.delivery) == (seq, 2)
                            and re.search(WORKER_0, h.name) and h.out is None], 10,
                   "the redelivery sent into the worker's own pull request, held in its link")
        workers = run.sup.status()["workers"]["list"]
        assert [w["settling"] for w in workers] == [1], f"not F18: its NAK's entry is not held unfenced: {workers}"
        seen["killed"] = time.monotonic()
        run.signal_worker(victim, signal.SIGKILL, "worker SIGKILL, its NAK read, its fence not back")
        if order == "death, advisory":
            named = wait_until(lambda: run.sup.status()["crosscheck"]["left_to_ack_wait"], 10, "the death recorded")
            assert [w["waits"] for w in named] == [NAK_UNSENT], named      # no advisory yet
            run.bg.call(proxy.heal(PARENT))
            run.fault("network: the parent's connection stalled", seen["stalled"], time.monotonic(), pids=set())
        seen["back"] = wait_until(lambda: started(run, seq, 3), ACK_WAIT + 15, "the job run again") and time.monotonic()
        wait_until(lambda: any(r.seq == seq and r.event == "D" for r in read_journal(run.journal)), 10, "the job done")
        seen["parent_naks"] = [t for t, _ in run.bg.call(proxy.tapped(PARENT)) if t > seen["killed"]]
        seen["status"] = wait_until(lambda: (s := run.sup.status())["crosscheck"]["left_to_ack_wait"]
                                    and s["crosscheck"]["left_to_ack_wait"][0]["came_back_after_s"] is not None and s,
                                    10, "the ledger saw it back")
        seen["redelivered"] = run.sup.events("redelivered", seq=seq)
        seen["naked"] = run.sup.events("in_transit_naked")
        seen["journal"] = [r for r in read_journal(run.journal) if r.seq == seq]

    result = run_with("nak-read-at-a-death", 0, nak_read_then_killed, dict(VERDICTS), tmp_path / "run")
    assert not result.error, result.summary()
    took = seen["back"] - seen["killed"]
    assert took < ACK_WAIT / 2, f"back {took:.1f}s after the kill (AckWait {ACK_WAIT:g}s): left to AckWait"
    assert seen["parent_naks"], "the parent sent no NAK after the death"
    seq = seen["seq"]
    assert [n["seqs"] for n in seen["naked"]] == [[seq]], seen["naked"]
    [left] = seen["status"]["crosscheck"]["left_to_ack_wait"]
    assert (left["stream_seq"], left["delivery"], left["waits"]) == (seq, 1, NAK_READ_NAKED), left
    assert [(e["delivery"], e["why"].endswith(NAK_READ_NAKED)) for e in seen["redelivered"]] == [(3, True)], \
        seen["redelivered"]
    assert [(r.event, r.delivery) for r in seen["journal"]] == [("S", 1), ("R", 1), ("S", 3), ("D", 3)], seen["journal"]
    cc = seen["status"]["crosscheck"]
    assert cc["unexplained_redeliveries"] == 0 and cc["in_transit_naked"] == 1, cc
    assert result.counts["ackwait"] == 0 and result.passed, result.summary()


def test_a_slot_whose_link_cannot_reach_nats_does_not_halt_a_pool_that_serves(tmp_path):
    """F21, found by `python -m chaos --random --seed 997 --minutes 1`: the rig stalled worker 0's
    connections (new ones too) for 39 s; each new worker 0 failed to connect (exit 4) and after
    restart.boot_failures_to_halt of them in a row the supervisor halted, stopping the workers
    that served. A worker that cannot reach NATS while others of its pool serve has a link
    problem, not a crash loop: it backs off and tries again, and does not count toward the halt.
    Here boot_failures_to_halt is 3: worker 0's link is stalled, worker 0 SIGKILLed, and its
    replacements fail at least 4 times while worker 1 serves; the supervisor runs on, and once
    the link heals a worker 0 gets ready."""
    seen: dict = {}

    def one_slot_cut_off(run: Run) -> None:
        proxy = proxied(run, 30.0)
        run.start_supervisor([proxy.url], workers={"count": 2, "heartbeat_timeout": 60.0},
                             restart={"boot_failures_to_halt": 3, "backoff_initial": 0.01, "backoff_max": 0.05})
        pid0 = next(w["pid"] for w in run.sup.status()["workers"]["list"] if w["slot"] == 0)
        assert run.bg.call(proxy.stall(WORKER_0)) == 1, "worker 0's link is not through the proxy"
        os.kill(pid0, signal.SIGKILL)
        wait_until(lambda: "halting" in (log := run.sup.log())
                   or len(re.findall(r"worker 0 \(pid \d+\) died: exit code 4", log)) >= 4, 90,
                   "worker 0's replacements failing to reach NATS")
        assert "halting" not in run.sup.log(), "the supervisor halted while worker 1 served"
        status = run.sup.status()
        seen["ready"] = [w["slot"] for w in status["workers"]["list"] if w["state"] == "ready"]
        seen["alive"] = run.sup.proc.poll() is None
        run.bg.call(proxy.heal(WORKER_0))
        seen["back"] = wait_until(lambda: [w for w in run.sup.status()["workers"]["list"]
                                           if w["slot"] == 0 and w["state"] == "ready"], 60, "a worker 0 ready")
        seen["log"] = run.sup.log()

    result = run_with("slot-cut-off", 0, one_slot_cut_off, dict(VERDICTS), tmp_path / "run")
    assert not result.error, result.summary()
    assert seen["alive"] and seen["ready"] == [1], seen["ready"]
    assert "halting" not in seen["log"]
    assert result.passed, result.summary()


def tapped_on(run: Run, pattern: str) -> list[tuple[float, bytes]]:
    return run.bg.call(run.proxy.tapped(pattern))


def tapped(run: Run) -> list[tuple[float, bytes]]:
    return run.bg.call(run.proxy.tapped(WORKER_0))


def answered_408(run: Run, since: float) -> bool:
    """A 408 came to the worker after `since`, and a pull request of its went out after that."""
    seen = tapped(run)
    first = min((t for t, what in seen if what == TIMEOUT and t > since), default=None)
    return first is not None and any(what == NEXT and t > first for t, what in seen)


def alone_and_polled(run: Run, since: float) -> float:
    """The supervisor sure it is alone, and a poll of its monitor since `since`, SLACK old."""
    wait_until(lambda: (s := run.sup.try_status()) and s["peers"]["alone"], 30, "the supervisor sure it is alone")
    polled = wait_until(lambda: (age := run.sup.status()["consumer"].get("poll_age_s")) is not None
                        and (t := time.monotonic() - age) > since and t, 30, "a poll by the supervisor's monitor since")
    wait_until(lambda: time.monotonic() > polled + 2 * SLACK, 5, "that poll more than SLACK old")
    return polled


def last_request_read(run: Run) -> float | None:
    """When the worker's last pull request went out, once the PONG to the second PING after it
    came back (the first may belong to a check that began before the request: the worker's
    liveness check proves a request read with a PING it began after it, Puller.server_read), and
    while the request still has a good part of PULL_EXPIRES to live at the server; else None."""
    seen = tapped(run)
    requests = [t for t, what in seen if what == NEXT]
    pings = [t for t, what in seen if what == PING]
    pongs = [t for t, what in seen if what == PONG]      # the n-th answers the n-th PING
    if not requests:
        return None
    after = [n for n, t in enumerate(pings) if t > requests[-1]]
    answered = len(after) >= 2 and len(pongs) > after[1]
    return requests[-1] if answered and time.monotonic() < requests[-1] + 0.7 * PULL_EXPIRES else None


def waiting(run: Run) -> int:
    """Pull requests waiting at the server (-1 while it does not answer)."""
    try:
        return run.bg.call(run.nc.jetstream().consumer_info(STREAM, CONSUMER, timeout=2)).num_waiting or 0
    except Exception:
        return -1


def test_an_orphans_naks_are_explained_to_the_supervisor_that_gets_their_redeliveries(nats_server,
                                                                                        supervisor_factory):
    """Found by `python -m chaos --random --seed 20 --minutes 1` (a fleet of two, one parent
    SIGKILLed) and seed 85 (one supervisor and the successor started at once): an orphaned
    worker NAKs the jobs it pulled and had not started, and their redeliveries go to the other
    supervisor's workers. Its parent used to announce a worker's NAKs on the ledger subject;
    dead, it announces nothing, and the other supervisor's ledger counted each redelivery
    unexplained: a false ack_wait_too_short. Alpha and beta share the consumer; alpha's worker
    runs a job and holds more when alpha is SIGKILLed. Beta runs them (before AckWait: the
    orphan NAKed them) and explains every one by the orphan's word; the orphan, having spoken,
    says goodbye."""
    same = {"consumer": {"ack_wait": 2 * ACK_WAIT},
            "workers": {"count": 1, "batch": 8, "graceful_timeout": 30.0, "handler": "testhandlers:record"}}
    seqs = set(backlog_of(nats_server.url, fast=100, count=16, data="1.0"))   # so alpha's worker buffers
    alpha = supervisor_factory(nats_server, args=JSON_LOGS, **same)
    wait_until(lambda: [r for r in alpha.jobs.running() if r.seq in seqs] and
               [e for e in held(alpha) if e["stream_seq"] in seqs], what="alpha's worker running a job and holding more")
    [worker] = alpha.workers()
    worker.suspend()        # holds on to what it has while beta starts
    # Beta's four workers run the 1 s jobs alpha did not finish in a quarter of the time one takes.
    beta = supervisor_factory(nats_server, args=JSON_LOGS, **{**same, "workers": {**same["workers"], "count": 4}})
    beta.wait_ready(4)
    wait_until(lambda: beta.status()["peers"]["heard"], what="beta has heard alpha")
    worker.resume()
    alpha.signal(signal.SIGKILL)
    alpha.wait()
    wait_until(lambda: (alpha.jobs.done_seqs() | beta.jobs.done_seqs()) >= seqs, 2 * ACK_WAIT, "every job done")
    back = {r.seq for r in beta.jobs.started() if r.delivery > 1} & seqs
    assert back, "none of the orphan's jobs came back to beta: nothing was forced"
    wait_until(lambda: [o for o in beta.status()["peers"]["gone"] if "orphan of" in o], 15, "the orphan's goodbye")
    whys = {e["seq"]: e["why"] for e in beta.events("redelivered") if e["seq"] in back}
    assert set(whys) == back and all("its supervisor gone" in why for why in whys.values()), whys
    crosscheck = beta.status()["crosscheck"]
    assert crosscheck["unexplained_redeliveries"] == 0 and not beta.events("unexplained_redelivery"), crosscheck
    assert not [a for a in beta.status()["alerts"] if a["kind"] == "ack_wait_too_short"], beta.status()["alerts"]


def held(sup: SupervisorProc) -> list[dict]:
    return [e for w in sup.status()["workers"]["list"] for e in w["in_flight"] if e["state"] == "held"]


def test_a_job_that_waited_in_the_stream_is_not_redelivered_by_a_server_restart_while_held(tmp_path):
    """F14. Found by `python -m chaos --random --seed 604 --minutes 1` on 095ebed (replayed on
    83ff657): 10 jobs ran twice, 5-17 s after a nats-server SIGKILL, between two live workers of
    one supervisor, no fault on either. nats-server keeps a delivery's AckWait timer in memory
    from the delivery, but stores the message's own timestamp for it (consumer.go deliverMsg:
    updateDelivered(..., pmsg.ts)); only a +WPI stores a time of its own. The restarted server
    counted AckWait from the publish time: held jobs that had waited in the stream about AckWait,
    and that the parent had not pinged yet (a third of AckWait after it was held), were handed
    to the next pull request a second or two after the restart while their holders ran them or,
    with [ordering], kept them parked for their key's turn (then both deliveries start). Here:
    a job stored about AckWait ago runs 6 s in the supervisor's one worker; the server is
    SIGKILLed and restarted 1-3 s into it (a ping by the delivery's time is due after 4 s),
    and a client of the test's asks the consumer for a job as another worker would: it must get
    none while the worker runs it, and the job must run once."""
    ack_wait, long_job = 12.0, 6.0
    server = NatsServer(tmp_path / "store").start()
    cfg = base_config(server, tmp_path, workers={"count": 1, "concurrency": 1, "handler": "testhandlers:record"},
                      consumer={"ack_wait": ack_wait})
    sup = SupervisorProc(tmp_path, cfg).start()          # makes the stream and the consumer as configured
    try:
        sup.wait_ready()
        assert sup.stop() == 0
        [seq] = publish_now(server.url, count=1, data=f"{long_job}")
        stored = time.time()
        # The job must be about AckWait old when it is delivered (a backlog's jobs are), so that
        # the restarted server finds its stored timer out a second or two after the restart.
        wait_until(lambda: time.time() - stored > ack_wait - 1.0, ack_wait + 5, "the job about AckWait old")
        sup.start()
        started = wait_until(lambda: [r for r in sup.jobs.started() if r.seq == seq], 30, "the job started")
        t0 = time.monotonic()
        # With the fix it is pinged at the first inspection a second after it was held (1.5 s at
        # most). Without it the first ping is due a third of AckWait in (4 s): the kill comes first.
        wait_until(lambda: pings(sup) >= 1 or time.monotonic() - t0 > 2.5, 10, "a ping, or 2.5 s")
        # The server's consumer store writes at most every 100 ms (filestore.go flushLoop): a
        # SIGKILL sooner after the +WPI finds the publish time stored still (F14's window left).
        seen = time.monotonic()
        wait_until(lambda: time.monotonic() - seen >= 0.3, 5, "the +WPI in the consumer's store")
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        server.start()
        taken = pull_one(server.url, seconds=3.0)
        assert taken is None, f"the restarted server handed out seq {taken[0]} (delivery {taken[1]}) while its worker ran it"
        wait_until(lambda: seq in sup.jobs.done_seqs(), 60, "the job done")
        wait_until(lambda: server.consumer()["num_ack_pending"] == 0, 30, "nothing left ack pending")
        assert [(r.seq, r.delivery) for r in sup.jobs.started()] == [(seq, 1)] and started
    finally:
        sup.cleanup()
        server.stop()


def pull_one(url: str, seconds: float) -> tuple[int, int] | None:
    """(stream seq, delivery) of what one pull request on the consumer gets within `seconds`
    (left unacked), or None: what another worker would have been handed."""
    async def run() -> tuple[int, int] | None:
        nc = await nats.connect(url)
        try:
            sub = await nc.jetstream().pull_subscribe_bind(CONSUMER, STREAM)
            try:
                [msg] = await sub.fetch(1, timeout=seconds)
            except nats.errors.TimeoutError:
                return None
            return msg.metadata.sequence.stream, msg.metadata.num_delivered
        finally:
            await nc.close()
    return asyncio.run(run())


def pings(sup: SupervisorProc) -> int:
    """+WPI the supervisor has sent (/metrics)."""
    _, text = sup.get("/metrics")
    found = re.search(r"^jetstream_supervisor_in_progress_pings_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    return int(float(found.group(1))) if found else 0


@pytest.mark.parametrize("whose, end", [("peer", "heal"), ("peer", "reset"), ("own", "heal"), ("own", "reset")])
def test_a_redelivery_only_a_peers_word_explains_is_explained_across_a_link_fault(tmp_path, whose, end):
    """F13, found by `python -m chaos --random --seed 600 --minutes 1` on 095ebed (two supervisors
    on one consumer, parent links stalled and cut): a supervisor counted as unexplained the
    redelivery of a job its peer's worker had NAKed, its peer's word on the ledger subject (core
    NATS) held in a stalled link past SUSPECT_GRACE, or lost with the link. Two supervisors, one
    worker each, one job at a time: R's worker runs a 4 s job; N's worker takes a job that raises
    Retry(0.3), then a long one, so the redelivery goes to R's worker when its job ends. The word
    is held: `peer`, N's parent link stalls right before the proxy forwards N's NAK announcement;
    `own`, R's parent link is stalled before N's worker NAKs. Held past the grace, the link is
    then healed (the word arrives late) or reset (the word is gone; N says it again when R asks
    for what it missed). Red before F13's fix: R counted the redelivery unexplained at the grace."""
    run = Run(f"f13-{whose}-{end}", tmp_path / "run", quick=True)
    try:
        server = run.start_server()
        run.connect([server.url])
        proxy = run.start_proxy(server)
        one = {"workers": {"count": 1, "concurrency": 1, "heartbeat_timeout": 60.0},
               "fleet": {"heartbeat": 30.0},      # the fleet's view sees nobody silent: the ledger subject alone
               "log": {"format": "json"}}
        sups = {name: run.start_supervisor([proxy.url], nats={"name": name}, **one) for name in ("alpha", "beta")}
        wait_until(lambda: all(s.status()["peers"]["heard"] for s in sups.values()), 20, "each supervisor heard the other")
        z = publish_run(run, "z:4")
        r_name = next(n for n, s in sups.items() if started(run, z, 1) in s.worker_pids())
        n_name = next(n for n in sups if n != r_name)
        receiver, naker = sups[r_name], sups[n_name]
        if whose == "peer":
            run.bg.call(proxy.hold(f"^{n_name}$", b'"naks"'))
        else:
            run.bg.call(proxy.stall(f"^{r_name}$"))
        x = publish_run(run, "x:retry0.3:0.05")
        publish_run(run, "y:15")
        assert started(run, x, 1) in naker.worker_pids(), "the retried job went to the wrong worker"
        if whose == "peer":
            wait_until(lambda: run.bg.call(proxy.holding(f"^{n_name}$")), 10, "the NAK's announcement held")
        wait_until(lambda: started(run, x, 2), 20, "the retried job redelivered", interval=0.02)
        assert started(run, x, 2) in receiver.worker_pids(), "the redelivery went to the wrong worker"
        back = next(r.t for r in read_journal(run.journal) if r.seq == x and r.event == "S" and r.delivery == 2)
        # Held past the grace: without the fix, R has judged the redelivery by now.
        wait_until(lambda: time.monotonic() > back + SUSPECT_GRACE + 2.0 and receiver.try_status(), 30,
                   "the grace over, by a status answered after it")
        link = f"^{n_name if whose == 'peer' else r_name}$"
        run.bg.call(proxy.heal(link) if end == "heal" else proxy.reset(link))
        if end == "reset":
            run.bg.call(proxy.heal(link))
        judged = wait_until(lambda: [e for e in receiver.events() if e.get("seq") == x and e["event"] in
                                     ("redelivery_explained", "unexplained_redelivery")], 30, "R's ledger judging it")
        assert judged[0]["event"] == "redelivery_explained", f"R counted it unexplained: {judged}"
        assert "NAKed by a worker at delivery 1" in judged[0]["why"], judged
        crosscheck = receiver.status()["crosscheck"]
        assert crosscheck["unexplained_redeliveries"] == 0, crosscheck
        assert not receiver.events("unexplained_redelivery"), receiver.events("unexplained_redelivery")
        if end == "reset":
            assert whose == "own" or naker.status()["peers"]["words_lost"] == 0
            assert receiver.status()["peers"]["words_lost"] == 0, receiver.status()["peers"]
    finally:
        run.close()


def publish_run(run: Run, payload: str) -> int:
    """Publish one job; its stream sequence, once a worker has started it."""
    seq = run.bg.call(run.nc.jetstream().publish(SUBJECT, payload.encode())).seq
    wait_until(lambda: started(run, seq, 1), 20, f"seq {seq} ({payload}) started")
    return seq


def started(run: Run, seq: int, delivery: int) -> int | None:
    """The pid of the worker that started `seq`'s `delivery`, if one has."""
    return next((r.pid for r in read_journal(run.journal) if r.seq == seq and r.event == "S" and r.delivery == delivery),
                None)


def test_what_was_on_a_peers_dead_workers_wire_is_explained_where_it_comes_back(tmp_path):
    """F13's second form, seed 600 again (seq 85 on 095ebed; 81, 83 and 90 once the words were
    delayed no more): a worker SIGKILLed with a job on its wire; with a peer on the consumer the
    in-transit check stands down (README), so the job comes back after AckWait, and its own
    supervisor's ledger explains that as in transit at the death, but the redelivery went to the
    peer's worker, whose ledger had only its own deaths. Beta's two workers run long jobs (no pull
    request out); alpha's worker's first pull request reaches the server and its link is held right
    after; a job stored then is filled into it, and the worker is SIGKILLed (its replacement waits
    30 s: restart.backoff_initial) while beta starts a third worker (SIGTTIN). The job comes back
    after AckWait (6 s) to that worker (within the death's window: a redelivery that waited for a
    worker long after AckWait is not attributed, by design): beta explains it by alpha's word about
    the death. Red before: unexplained."""
    run = Run("f13-in-transit", tmp_path / "run", quick=True, ack_wait=6.0)
    try:
        server = run.start_server()
        run.connect([server.url])
        proxy = run.start_proxy(server)
        one = {"concurrency": 1, "heartbeat_timeout": 60.0}
        beta = run.start_supervisor([proxy.url], nats={"name": "beta"}, workers={"count": 2, **one},
                                    log={"format": "json"})
        for _ in range(2):
            publish_run(run, "long:60")
        alpha_worker = r"^alpha worker 0$"
        run.bg.call(proxy.hold(alpha_worker, NEXT, after=True))
        alpha = run.start_supervisor([proxy.url], nats={"name": "alpha"}, workers={"count": 1, **one},
                                     restart={"backoff_initial": 30.0, "backoff_max": 30.0})
        wait_until(lambda: run.bg.call(proxy.holding(alpha_worker)), 20, "alpha's worker's request out, its link held")
        wait_until(lambda: alpha.status()["peers"]["heard"] and beta.status()["peers"]["heard"], 20,
                   "each supervisor heard the other")
        seq = run.bg.call(run.nc.jetstream().publish(SUBJECT, b"wire:0.01")).seq
        wait_until(lambda: run.bg.call(proxy.waiting(alpha_worker)) == 1, 10, "the job filled into alpha's held link")
        [victim] = alpha.worker_pids()
        os.kill(victim, signal.SIGKILL)
        os.kill(beta.proc.pid, signal.SIGTTIN)
        wait_until(lambda: not run.watcher.alive(victim), 30, "alpha's worker gone")
        came = wait_until(lambda: [e for e in beta.events("redelivered") if e["seq"] == seq], 6.0 + 30, "the job back")
        assert started(run, seq, 1) is None, "the job ran before its worker died: nothing was in transit"
        assert came[0]["why"], "beta did not explain the redelivery at once"
        assert f"in transit to worker 0 (pid {victim}) at its death" in came[0]["why"] and "(on " in came[0]["why"], came
        wait_until(lambda: started(run, seq, 2), 10, "the job run")
        crosscheck = wait_until(lambda: (c := beta.status()["crosscheck"])["suspects"] == 0 and c, 10, "beta's verdicts")
        assert crosscheck["unexplained_redeliveries"] == 0 and crosscheck["in_transit_redeliveries"] == 1, crosscheck
    finally:
        run.close()


def test_a_dead_workers_limit_slot_is_released_once_its_parents_link_is_back(tmp_path):
    """Found by `python -m chaos --random --seed 1102` on d8a30f7 ([limits] concurrency 1): the
    worker holding the slot died while its parent's link was cut; the parent's one try to
    release the slot failed (a request held in nats-py's buffer for its 5 s timeout; the cut
    lasted 6.9 s), and nothing limited ran until the slot's lease ran out (10 s), long after the
    link was back. The release is now tried again once NATS takes it, within the lease: here,
    end to end through a 2 s cut, the parent logs `limit_released` for the dead worker (only a
    slot that still names it is purged) and the job it held runs again. A cut longer than the
    request's timeout and still short of the lease leaves too thin a margin to force the old
    failure here every time; the retry itself is forced in tests/unit/test_limit_release.py
    (red before: one try)."""
    seen: dict = {}

    def killed_during_a_cut(run: Run) -> None:
        proxy = proxied(run, ACK_WAIT)
        run.start_supervisor([proxy.url], workers={"count": 2, "heartbeat_timeout": 60.0}, log={"format": "json"},
                             limits={"one": {"concurrency": 1, "subjects": [f"{SUBJECT}.>", SUBJECT]}})
        seq = seen["seq"] = publish_run(run, "slot:30:0.01")     # holds the slot; its redelivery is short
        holder = seen["holder"] = started(run, seq, 1)
        t0 = time.monotonic()
        assert run.bg.call(proxy.cut(PARENT)) == 1, "the parent's link is not through the proxy"
        run.signal_worker(holder, signal.SIGKILL, "worker SIGKILL holding the limit slot")
        wait_until(lambda: run.sup.events("worker_died", worker_pid=holder), 10, "the death reaped")
        time.sleep(max(0.0, t0 + 2.0 - time.monotonic()))      # the cut's length
        run.bg.call(proxy.heal(PARENT))
        run.fault("network: the parent's connection cut", t0, time.monotonic(), pids=set())
        # Only a slot whose value still names the dead worker is purged and logged: one its lease
        # freed is gone, and nothing is said.
        wait_until(lambda: run.sup.events("limit_released", worker_pid=holder), LEASE_TTL,
                   "the dead worker's slot released by its parent")
        wait_until(lambda: started(run, seq, 2), 30, "the job it held run again")
        seen["failed"] = run.sup.events("limit_release_failed")

    result = run_with("limit-slot-of-a-death-in-a-cut", 0, killed_during_a_cut, dict(VERDICTS), tmp_path / "run")
    assert not result.error, result.summary()
    assert not seen["failed"], seen["failed"]          # and `limit_released` came: the slot still named it
    assert result.passed, result.summary()


def test_a_sync_job_running_past_graceful_timeout_keeps_its_limit_slot_until_its_worker_is_gone(tmp_path):
    """F23, found by `python -m chaos --random --seed 1170` on 43e3401: [limits] concurrency 1,
    a sync handler, graceful_timeout 1 s. A stopping worker's job ran on in its handler thread
    past the grace (a thread cannot be cancelled: the job is NAKed, the process ends soon
    after), and the worker's exit gave back the slot while that thread still ran: the other
    worker started a limited job 15 ms before the process was gone. Now such an exit keeps its
    slots, and its parent releases them once it has reaped the worker: the other worker's next
    limited job starts after the parent logged the exit. Red before: it started before."""
    seen: dict = {}

    def stopped_past_its_grace(run: Run) -> None:
        proxy = proxied(run, ACK_WAIT)
        run.start_supervisor([proxy.url], workers={"count": 2, "graceful_timeout": 1.0, "heartbeat_timeout": 60.0},
                             log={"format": "json"}, limits={"one": {"concurrency": 1, "subjects": [SUBJECT]}})
        seq = publish_run(run, "long:6:0.01")                 # holds the slot, past the grace
        holder = seen["holder"] = started(run, seq, 1)
        waiting = [run.bg.call(run.nc.jetstream().publish(SUBJECT, f"w{k}:0.01".encode())).seq for k in range(3)]
        wait_until(lambda: run.sup.status()["limits"]["one"]["waiting"] >= 1, 10, "a job waiting for the slot")
        run.signal_worker(holder, signal.SIGTERM, "worker SIGTERM, its sync job running past graceful_timeout")
        wait_until(lambda: all(started(run, s, 1) for s in waiting), 30, "the waiting jobs run")
        [exited] = run.sup.events("worker_exited", worker_pid=holder)
        seen["exited"] = exited["ts"]
        seen["first"] = min(r.wall for r in read_journal(run.journal) if r.seq in waiting and r.event == "S")

    result = run_with("sync-job-past-its-grace-with-a-limit", 0, stopped_past_its_grace, dict(VERDICTS),
                      tmp_path / "run")
    assert not result.error, result.summary()
    assert seen["first"] > seen["exited"], (f"a limited job started {seen['exited'] - seen['first']:.3f}s before "
                                            f"the parent had reaped worker {seen['holder']}, whose job still ran")
    assert result.passed, result.summary()
