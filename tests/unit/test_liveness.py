"""The arbiter's rules about living workers (supervisor/core/liveness.py), on a fake clock: when a
worker is killed, which jobs get +WPI, when a recycled worker retires, when a NAK is repeated."""

import pytest

from supervisor.core import liveness
from supervisor.core.liveness import DRAIN_MARGIN, FRESH_BEAT, RENAK_AFTER, STALE_LINK, Limits
from workers.protocol import slots
from workers.protocol.exits import KillCause

LIM = Limits(heartbeat_timeout=10.0, job_timeout=0.0, ack_wait=30.0)


def entry(seq: int, state: int = slots.RUNNING, held: float = 0.0, started: float = 0.0,
          delivery: int = 1, reply: str = "$JS.ACK.x") -> slots.Entry:
    return slots.Entry(index=seq, state=state, stream_seq=seq, consumer_seq=seq, delivery=delivery,
                       t_held=held, t_started=started, reply=reply)


def test_inspection_beats_the_shortest_deadline():
    assert liveness.inspect_every(LIM) == 0.5
    assert liveness.inspect_every(Limits(10.0, 0.0, 1.8)) == 0.3                 # AckWait / 6
    assert liveness.inspect_every(Limits(10.0, 0.0, 30.0, backoff=(0.6, 5.0))) == pytest.approx(0.1)
    assert liveness.inspect_every(Limits(10.0, 0.4, 30.0)) == 0.1                # job_timeout / 4
    assert liveness.inspect_every(Limits(0.01, 0.0, 30.0)) == 0.02               # never a busy loop


def test_a_silent_worker_is_killed_after_heartbeat_timeout_counted_from_its_last_beat():
    assert liveness.why_kill(110.0, LIM, last_beat=100.0, started_at=0.0, entries=[], drain_deadline=None) is None
    kill = liveness.why_kill(110.5, LIM, last_beat=100.0, started_at=0.0, entries=[], drain_deadline=None)
    assert kill.text.startswith("no heartbeat for 10.5s")
    assert kill.cause == KillCause.HEARTBEAT and kill.cause.blames_jobs and kill.blame is None


def test_a_worker_that_never_beat_is_timed_from_its_fork():
    assert liveness.why_kill(59.0, LIM, last_beat=0.0, started_at=50.0, entries=[], drain_deadline=None) is None
    assert liveness.why_kill(61.0, LIM, last_beat=0.0, started_at=50.0, entries=[], drain_deadline=None)


def test_job_timeout_kills_only_for_a_running_job_past_it():
    lim = Limits(10.0, job_timeout=5.0, ack_wait=30.0)
    held_long = entry(1, state=slots.HELD, held=0.0)
    running = entry(2, started=96.0)
    assert liveness.why_kill(100.0, lim, 100.0, 0.0, [held_long, running], None) is None
    kill = liveness.why_kill(101.5, lim, 101.0, 0.0, [held_long, running], None)
    assert "job seq=2 ran 5.5s" in kill.text
    assert (kill.cause, kill.blame) == (KillCause.JOB_TIMEOUT, 2)                # that job alone is to blame
    assert liveness.why_kill(101.5, LIM, 101.0, 0.0, [running], None) is None    # 0 = no limit


def test_a_drain_past_its_deadline_is_killed():
    deadline = liveness.drain_deadline(100.0, graceful_timeout=30.0)
    assert deadline == 130.0 + DRAIN_MARGIN
    assert liveness.why_kill(deadline, LIM, deadline, 0.0, [], deadline) is None
    kill = liveness.why_kill(deadline + 0.1, LIM, deadline, 0.0, [], deadline)
    assert "past graceful_timeout" in kill.text
    assert kill.cause == KillCause.DRAIN_OVERDUE and not kill.cause.blames_jobs   # the supervisor's doing


def test_pings_go_to_unsettled_jobs_a_third_into_their_ack_wait():
    jobs = [entry(1, state=slots.HELD, held=0.0), entry(2, held=5.0), entry(3, state=slots.ACKED, held=0.0),
            entry(4, held=0.0, reply="")]
    due = liveness.pings_due(10.0, jobs, lambda e: e.t_held, lambda d: 30.0)
    assert [e.stream_seq for e in due] == [1]
    due = liveness.pings_due(15.0, jobs, lambda e: e.t_held, lambda d: 30.0)
    assert [e.stream_seq for e in due] == [1, 2]


def test_a_ping_restarts_the_timer_and_each_delivery_has_its_own_ack_wait():
    job = entry(1, held=0.0, delivery=2)
    pinged = {1: 10.0}
    timer = lambda e: max(e.t_held, pinged.get(e.stream_seq, 0.0))           # noqa: E731
    backoff = lambda d: (3.0, 60.0)[min(d, 2) - 1]                            # noqa: E731
    assert liveness.pings_due(29.0, [job], timer, backoff) == []             # 60 s for delivery 2
    assert liveness.pings_due(30.0, [job], timer, backoff) == [job]


def test_the_stored_timer_of_a_job_that_waited_in_the_stream_starts_at_its_publish_time():
    """F14: nats-server stores a delivery's AckWait timer as the message's timestamp (a restart
    or a new consumer leader counts from it); only a +WPI stores a time of its own."""
    wall, now = 1_000_000.0, 500.0                                      # time.time() and monotonic, at once
    reply = f"$JS.ACK.JOBS.workers.1.7.9.{int((wall - 12.0) * 1e9)}.3"  # published 12 s ago
    held = entry(7, state=slots.HELD, held=now - 1.0, reply=reply)       # delivered 1 s ago
    assert liveness.published_at(reply) == pytest.approx(wall - 12.0)
    assert liveness.stored_timer(held, 0.0, now, wall) == pytest.approx(now - 12.0)
    assert liveness.pings_due(now, [held], lambda e: liveness.stored_timer(e, 0.0, now, wall), lambda d: 30.0) == [held]
    assert liveness.stored_timer(held, now - 0.5, now, wall) == now - 0.5          # pinged since it was held
    just = entry(7, state=slots.HELD, held=now - liveness.STORED_PING_AFTER / 2, reply=reply)
    assert liveness.stored_timer(just, 0.0, now, wall) == just.t_held              # not while a fast job may end
    fresh = entry(8, held=now - 1.0, reply=f"$JS.ACK.JOBS.workers.1.8.10.{int((wall - 2.0) * 1e9)}.0")
    assert liveness.stored_timer(fresh, 0.0, now, wall) == now - 2.0
    assert liveness.pings_due(now, [fresh], lambda e: liveness.stored_timer(e, 0.0, now, wall), lambda d: 30.0) == []
    # v2 subjects (a domain and an account hash), a time in the future (clocks apart), no time
    v2 = f"$JS.ACK.dom.acchash.JOBS.workers.1.7.9.{int((wall - 12.0) * 1e9)}.3.rand"
    assert liveness.published_at(v2) == pytest.approx(wall - 12.0)
    ahead = entry(9, held=now - 1.0, reply=f"$JS.ACK.JOBS.workers.1.9.11.{int((wall + 5.0) * 1e9)}.0")
    assert liveness.stored_timer(ahead, 0.0, now, wall) == now - 1.0
    assert liveness.published_at("$JS.ACK.JOBS.workers.1.7.9.0.0") is None
    assert liveness.published_at("_INBOX.x") is None
    assert liveness.stored_timer(entry(10, held=now - 1.0, reply="$JS.ACK.x"), 0.0, now, wall) == now - 1.0


def test_beat_and_link_freshness_bounds():
    assert liveness.beat_fresh(100.0, 100.0 - FRESH_BEAT)
    assert not liveness.beat_fresh(100.0, 100.0 - FRESH_BEAT - 0.01)
    assert liveness.link_fresh(100.0, 100.0 - STALE_LINK)
    assert not liveness.link_fresh(100.0, 100.0 - STALE_LINK - 0.01)


def test_a_recycled_worker_retires_after_its_last_job_and_its_replacement():
    done = [entry(1, state=slots.ACKED)]
    busy = [entry(1, state=slots.RUNNING)]
    assert liveness.may_retire(True, False, False, done)
    assert not liveness.may_retire(False, False, False, done)       # still has jobs to start
    assert not liveness.may_retire(True, False, False, busy)        # its last job runs
    assert not liveness.may_retire(True, False, True, done)         # replacement not ready yet
    assert not liveness.may_retire(True, True, False, done)         # already draining


def test_rss_is_read_every_few_seconds_and_only_with_a_limit():
    assert not liveness.rss_check_due(100.0, 0.0, max_rss_mb=0)
    assert liveness.rss_check_due(100.0, 95.0, max_rss_mb=200)
    assert not liveness.rss_check_due(100.0, 96.0, max_rss_mb=200)
    assert liveness.rss_over(300 * liveness.MB, 200) == "RSS 300 MB > workers.max_rss_mb=200"
    assert liveness.rss_over(100 * liveness.MB, 200) == ""
    assert liveness.rss_over(10**12, 0) == ""


def test_a_nak_is_repeated_only_after_a_fence_confirmed_it():
    assert not liveness.renak_due(1000.0, None)
    assert not liveness.renak_due(100.0 + RENAK_AFTER - 0.01, 100.0)
    assert liveness.renak_due(100.0 + RENAK_AFTER, 100.0)
