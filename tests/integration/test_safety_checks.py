"""The AckWait checks on the parent's delayed NAKs (issue 22, "tests that stayed green with their
promise broken"): a NAK sent late may hit the job's next delivery, held by someone else (NAKs
match by stream sequence: nats-server processNak), so a held-back NAK and a re-NAK are sent only
while the delivery they were built for is surely still the pending one. Each test reaches the
branch where the check says no, and goes red when the check is removed (the mutations are
named in each docstring). Real nats-server, real supervisor, real signals."""

from __future__ import annotations

import signal
import time

import psutil
from harness import publish_now, wait_until

from supervisor.core.liveness import RENAK_AFTER
from supervisor.parent.safety.in_transit import NOT_CONNECTED

JSON_LOGS = ("--log-format", "json")


def test_a_nak_held_back_past_its_ack_wait_is_not_sent(nats_server, supervisor_factory, tmp_path):
    """Worker A dies holding job J while the parent is disconnected: its NAK is held back. The
    outage outlasts J's AckWait, so the server hands J (delivery 2) to worker B, alive. When the
    parent is back, the held-back NAK (built for delivery 1) would NAK B's delivery: it must be
    dropped (event held_back_expired), and J runs at deliveries 1 and 2 only.
    Mutation: deaths.py send_held_back, `if nak_is_safe(...)` -> `if True`: red (held_back_sent,
    and J's third delivery runs beside the second)."""
    from linkfaults import Refuse

    ack_wait = 6.0
    gate = tmp_path / "gate"
    proxy = Refuse(nats_server).start()
    try:
        sup = supervisor_factory(nats_server, workers={"count": 2}, consumer={"ack_wait": ack_wait},
                                 nats={"servers": [proxy.url]}, args=JSON_LOGS)
        sup.wait_ready(2)
        seq = publish_now(nats_server.url, count=1, data=f"until:{gate}")[0]
        first = wait_until(lambda: [r for r in sup.jobs.running() if r.seq == seq], what="J running")[0]
        proxy.refuse("jetstream-supervisor")
        wait_until(lambda: not sup.status()["nats"]["connected"], what="the parent disconnected")
        psutil.Process(first.pid).send_signal(signal.SIGKILL)
        sup.wait_event("nak_held_back", seq=seq)
        [held] = sup.status()["crosscheck"]["naks_in_doubt"]      # named while it waits, for a death meanwhile
        assert (held["stream_seq"], held["delivery"], held["pid"]) == (seq, 1, first.pid), held
        second = wait_until(lambda: [r for r in sup.jobs.started() if r.seq == seq and r.delivery == 2],
                            timeout=4 * ack_wait, what="J's AckWait over: delivery 2 to a live worker")[0]
        assert second.pid != first.pid
        proxy.allow()
        wait_until(lambda: sup.status()["nats"]["connected"], what="the parent reconnected")
        sup.wait_event("held_back_expired", seq=seq)
        assert not sup.events("held_back_sent"), "a NAK built for delivery 1 went out after its AckWait"
        assert sup.status()["crosscheck"]["naks_in_doubt"] == []
        # The same tick that dropped it would have sent it: had it, delivery 3 would start at once.
        # Proof it did not: J finishes at delivery 2, and nothing else ever started it.
        gate.touch()
        wait_until(lambda: seq in sup.jobs.done_seqs(), what="J done")
        wait_until(lambda: nats_server.stream_msgs() == 0, what="J acked")
        assert [r.delivery for r in sup.jobs.started() if r.seq == seq] == [1, 2]
        assert sup.stop() == 0
    finally:
        proxy.stop()


def test_a_death_while_the_parent_is_away_is_listed_in_transit_unchecked(nats_server, supervisor_factory):
    """Worker W, SIGSTOPped with its pull request live, is sent job J (on its wire, in no table);
    the parent's link is refused; W is SIGKILLed. The in-transit check needs NATS: it waits, and
    a supervisor killed now would leave J to AckWait with nothing naming it (seed 700). So
    /status `crosscheck.in_transit_unchecked` names W's death, the window of first deliveries
    its wire may have held (J in it) and why the check waits. The link back, the check runs: J
    is NAKed (back long before AckWait) and the entry is gone.
    Without the field: red (KeyError); with the window's lower bound taken from the newest
    reading before the death instead of W's last proof: red (`after_seq` is J)."""
    from linkfaults import Refuse
    from test_reliability import catch_in_flight

    ack_wait = 60.0
    proxy = Refuse(nats_server.port).start()
    try:
        sup = supervisor_factory(nats_server, workers={"count": 1}, consumer={"ack_wait": ack_wait},
                                 restart={"backoff_initial": 0.05}, nats={"servers": [proxy.url]})
        sup.wait_ready(1)
        wait_until(lambda: sup.status()["peers"]["alone"], timeout=30, what="the supervisor sure it is alone")
        victim = psutil.Process(sup.workers()[0].pid)
        seq = catch_in_flight(sup, nats_server, victim)
        # The parent's own reading shows J delivered before W dies: only W's last proof may bound
        # the window from below (J is above it), never the newest reading before the death.
        wait_until(lambda: (sup.status()["consumer"]["delivered_stream_seq"] or 0) >= seq,
                   what="a ConsumerInfo of the parent's covering J's delivery")
        proxy.refuse("jetstream-supervisor")
        wait_until(lambda: not sup.status()["nats"]["connected"], what="the parent disconnected")
        victim.kill()
        [row] = wait_until(lambda: sup.status()["crosscheck"]["in_transit_unchecked"], what="the death listed")
        assert (row["pid"], row["slot"], row["consumer"], row["why"]) == (victim.pid, 0, "workers", NOT_CONNECTED), row
        assert row["credits"] >= 1 and row["after_seq"] is not None and row["after_seq"] < seq, row
        assert row["up_to_seq"] is None, row        # no ConsumerInfo since the death: the parent is away
        assert seq not in {r.seq for r in sup.jobs.started()}
        proxy.allow()
        wait_until(lambda: seq in sup.jobs.done_seqs(), timeout=ack_wait / 2, what="J found, NAKed and done")
        cc = sup.status()["crosscheck"]
        assert cc["in_transit_naked"] == 1 and cc["in_transit_unchecked"] == [], cc
        assert sup.stop() == 0
    finally:
        proxy.stop()


def test_a_renak_after_the_ack_wait_of_the_nak_it_repeats_is_not_sent(nats_server, supervisor_factory, tmp_path):
    """Worker A dies holding job J; the parent NAKs it. Worker B, the only other one, is SIGSTOPped
    (a loop that does not read: whatever the server sends it, nobody sees). Nobody reports J
    again, so RENAK_AFTER (4 s) after the NAK was fenced a re-NAK is due; but AckWait (3 s) since
    the NAK has run out: the delivery it caused may be redelivered to a live holder by now, and a
    NAK by stream sequence would take the job from it. No re-NAK may go out.
    Mutation: deaths.py renak_unseen, drop `or not nak_is_safe(now, n.sent_at, ...)`: red (event renak).
    When the re-NAK was due is known without a clock: two SIGHUPs, each logged by a later tick of
    the loop than the last, sent after the re-NAK was due; the audit of the first one's tick ran
    after that moment, and every tick audits."""
    ack_wait = 3.0
    gate = tmp_path / "gate"
    sup = supervisor_factory(nats_server, workers={"count": 2, "heartbeat_timeout": 120.0},
                             consumer={"ack_wait": ack_wait}, restart={"backoff_initial": 60.0, "backoff_max": 60.0},
                             args=JSON_LOGS)
    sup.wait_ready(2)
    seq = publish_now(nats_server.url, count=1, data=f"until:{gate}")[0]
    first = wait_until(lambda: [r for r in sup.jobs.running() if r.seq == seq], what="J running")[0]
    other = next(iter(sup.worker_pids() - {first.pid}))
    psutil.Process(other).send_signal(signal.SIGSTOP)
    try:
        psutil.Process(first.pid).send_signal(signal.SIGKILL)
        died = sup.wait_event("worker_died", worker_pid=first.pid)
        assert died["naked"] == [seq]
        due = time.monotonic() + RENAK_AFTER   # the NAK's fence ended before worker_died was logged
        wait_until(lambda: time.monotonic() > due, timeout=RENAK_AFTER + 1, what="the re-NAK due")
        for n in (1, 2):
            sup.signal(signal.SIGHUP)
            wait_until(lambda n=n: len(sup.events("signal", signal="SIGHUP")) == n, what=f"SIGHUP {n} handled")
        assert not [r for r in sup.jobs.started() if r.seq == seq and r.delivery > 1], "nobody saw J again"
        assert not sup.events("renak"), "a re-NAK went out after the AckWait of the NAK it repeats"
    finally:
        psutil.Process(other).send_signal(signal.SIGCONT)
    gate.touch()
    wait_until(lambda: seq in sup.jobs.done_seqs(), what="J done")
    sup.stop()
