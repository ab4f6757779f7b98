"""A retry delay longer than retry.republish_after: the job is stored again as a one-shot message
schedule for its due time and the original acked, so nothing is ack-pending while it waits
(ConsumerInfo), and it runs once when due, whoever is running then (here: a supervisor started
after the first one stopped). The attempts go on counting across the copy."""

from __future__ import annotations

import asyncio
import time

import nats
from harness import dead_letter_headers, publish_now, wait_until

JSON_LOGS = ("--log-format", "json")


def consumer_state(url: str) -> tuple[int, int]:
    """(num_ack_pending, num_pending) of the work consumer, as the server says."""
    async def run():
        nc = await nats.connect(url)
        try:
            info = await nc.jetstream().consumer_info("JOBS", "workers")
            return info.num_ack_pending, info.num_pending
        finally:
            await nc.close()
    return asyncio.run(run())


def schedules_held(url: str) -> int:
    async def run():
        nc = await nats.connect(url)
        try:
            state = await nc.jetstream().stream_info("JOBS", subjects_filter="_sched.JOBS.>")
            return len(state.state.subjects or {})
        finally:
            await nc.close()
    return asyncio.run(run())


def test_a_long_delay_holds_no_ack_pending_slot_and_the_job_runs_once_when_due_across_a_restart(nats_server,
                                                                                               supervisor_factory):
    """A 4 s delay (base 4, no jitter) past republish_after 1: re-published and acked; while it
    waits the consumer has nothing ack-pending and the stream holds its schedule; the first
    supervisor stops, a second one starts, and the copy runs once, not before it is due."""
    retry = {"republish_after": 1.0, "rules": [{"on": ["RuntimeError"], "base": 4.0, "jitter": 0.0}]}
    first = supervisor_factory(nats_server, args=JSON_LOGS, workers={"count": 1}, retry=retry)
    first.wait_ready(1)
    [seq] = publish_now(nats_server.url, count=1, data="fail-first-attempt")
    failed = first.wait_event("handler_failed", seq=seq)
    failed_at = time.time()
    assert failed["delay"] == 4.0
    wait_until(lambda: consumer_state(nats_server.url) == (0, 0), what="the original acked, nothing pending")
    assert schedules_held(nats_server.url) == 1 and nats_server.stream_msgs() == 1    # only the schedule
    assert first.stop() == 0
    second = supervisor_factory(nats_server, args=JSON_LOGS, workers={"count": 2}, retry=retry)
    second.wait_ready(2)
    wait_until(lambda: second.jobs.done(), what="the copy run when due, by the second supervisor")
    [run] = second.jobs.done()
    assert run.seq != seq and run.delivery == 1 and run.data == "fail-first-attempt"
    assert run.t >= failed_at + 4.0 - 0.5, "not before its due time (4 s after the failure; clocks of one host)"
    wait_until(lambda: nats_server.stream_msgs() == 0, what="the copy acked, its schedule gone")
    assert [r.seq for r in first.jobs.started() + second.jobs.started()] == [seq, run.seq]
    assert consumer_state(nats_server.url) == (0, 0) and schedules_held(nats_server.url) == 0
    assert second.stop() == 0


def test_attempts_count_across_the_copies_and_the_last_is_dead_lettered(nats_server, supervisor_factory):
    """max_attempts 3, every delay re-published: attempt 1 (the original), 2 and 3 (copies, each
    delivery 1 of its own message); the third failure is dead-lettered with Attempts 3."""
    retry = {"republish_after": 0.5, "rules": [{"on": ["KeyError"], "base": 1.0, "jitter": 0.0, "max_attempts": 3}]}
    sup = supervisor_factory(nats_server, args=JSON_LOGS, workers={"count": 1}, retry=retry)
    sup.wait_ready(1)
    publish_now(nats_server.url, count=1, data="raise:KeyError")
    wait_until(lambda: dead_letter_headers(nats_server.url), what="the job dead-lettered at its third attempt")
    starts = sup.jobs.started()
    assert [r.delivery for r in starts] == [1, 1, 1] and len({r.seq for r in starts}) == 3
    assert [e["attempt"] for e in sup.events("handler_failed")] == [1, 2, 3]
    [letter] = dead_letter_headers(nats_server.url)
    assert letter["Supervisor-Dead-Letter-Attempts"] == "3" and letter["Supervisor-Dead-Letter-Error"] == "KeyError"
    assert letter["Supervisor-Dead-Letter-Reason"].endswith("(attempt 3 of 3)")
    wait_until(lambda: nats_server.stream_msgs() == 0, what="nothing left in the stream")
    assert sup.stop() == 0


def test_a_worker_dead_between_the_re_publish_and_its_ack_leaves_one_copy(nats_server, supervisor_factory, tmp_path):
    """The worker stores the copy (PubAck in) and dies before it acks the original (trap:
    tests/handlers/latertraps.py), here only once the copy has fired and run on the other worker
    (its schedule gone, so neither the schedule subject nor the redelivery's look for a waiting
    copy can help). The parent NAKs the original; its second delivery fails again and is
    re-published again: the same Nats-Msg-Id, inside the stream's duplicate window (120 s; the
    whole test takes seconds), is dropped by the server, the original acked, and the job's copy
    runs exactly once. (Red with the Msg-Id left out: a second copy.)"""
    trap = tmp_path / "trap"
    trap.touch()
    retry = {"republish_after": 0.5, "rules": [{"on": ["RuntimeError"], "base": 1.0, "jitter": 0.0}]}
    sup = supervisor_factory(nats_server, args=JSON_LOGS, workers={"count": 2, "handler": "latertraps:gated"},
                             env={"LATER_TRAP": str(trap), "LATER_TRAP_AFTER_COPY": "1"}, retry=retry)
    sup.wait_ready(2)
    [seq] = publish_now(nats_server.url, count=1, data=str(tmp_path))
    sup.wait_event("handler_failed", seq=seq, attempt=2)
    assert not trap.exists(), "the trap fired: the first worker died after storing the copy"
    wait_until(lambda: consumer_state(nats_server.url) == (0, 0) and nats_server.stream_msgs() == 0,
               what="the original acked, the copy run and acked, no schedule left to fire")
    originals = [r for r in sup.jobs.started() if r.seq == seq]
    copies = [r for r in sup.jobs.started() if r.seq != seq]
    assert [r.delivery for r in originals] == [1, 2] and originals[0].pid != originals[1].pid
    assert len(copies) == 1 and copies[0].delivery == 1, f"the copy ran once: {copies}"
    assert [r.seq for r in sup.jobs.done()] == [copies[0].seq]
    [deduped] = sup.events("republish_deduped")
    assert deduped["seq"] == seq and deduped["msg_id"] == f"retry-JOBS-{seq}"
    assert sup.stop() == 0


def test_a_redelivered_original_whose_copy_waits_runs_only_as_the_copy(nats_server, supervisor_factory, tmp_path):
    """The worker stores the copy and dies before the original's ack (trap); the fault that failed
    the job is gone, so the original's rerun would succeed, and the copy would then run the job a
    second time when due, as a sequence no ledger links to the first. The redelivery finds its
    copy's schedule still stored (due 3 s after the failure) and is acked unrun (event
    copy_waiting); the job runs once, as the copy. (Red without the look: done twice.)"""
    trap = tmp_path / "trap"
    trap.touch()
    retry = {"republish_after": 0.5, "rules": [{"on": ["RuntimeError"], "base": 3.0, "jitter": 0.0}]}
    sup = supervisor_factory(nats_server, args=JSON_LOGS, workers={"count": 2, "handler": "latertraps:fails_first"},
                             env={"LATER_TRAP": str(trap)}, retry=retry)
    sup.wait_ready(2)
    [seq] = publish_now(nats_server.url, count=1, data=str(tmp_path))
    wait_until(lambda: sup.events("worker_died") and consumer_state(nats_server.url) == (0, 0)
               and nats_server.stream_msgs() == 0, what="the original settled, the copy run and acked, no schedule left")
    assert not trap.exists(), "the trap fired: the first worker died after storing the copy"
    done = sup.jobs.done()
    assert len(done) == 1 and done[0].seq != seq, f"the job ran once, as its copy: {done}"
    assert [r.delivery for r in sup.jobs.started() if r.seq == seq] == [1], "the original ran only before the copy"
    [waited] = sup.events("copy_waiting", seq=seq)
    assert waited["delivery"] == 2
    assert sup.stop() == 0
