"""Handler middleware (workers/middleware/) in real workers against a real nats-server: the order
and the place of the hooks, a failing hook retrying its job (never acking it unrun) while the
worker keeps working, Retry / Reject / Duplicate from a hook, the max_jobs budget of jobs a hook
kept from running, and a drain with a job inside the chain. The hooks journal every call
(tests/handlers/testmiddleware.py) beside the handler's start/done lines."""

from __future__ import annotations

import asyncio
import collections
import os
import signal

import nats
import pytest
from harness import backlog_of, dead_letter_headers, publish_now, wait_until

JSON_LOGS = ("--log-format", "json")
KINDS = {"sync-c1": ("record", "Outer", 1), "sync-c3": ("record", "Outer", 3), "async-c3": ("record_async", "OuterAsync", 3)}
HOOK_FAILURES = ("hook-before-fails", "hook-after-fails", "hook-around-fails", "hook-skips")


def with_middleware(supervisor_factory, nats_server, kind: str, **sections):
    handler, outer, concurrency = KINDS[kind]
    workers = {"count": 1, "concurrency": concurrency, "handler": f"testhandlers:{handler}", "retry_backoff": [0.1],
               "middleware": [f"testmiddleware:{outer}", "testmiddleware:Inner"], **sections.pop("workers", {})}
    return supervisor_factory(nats_server, args=JSON_LOGS, workers=workers, **sections)


def journal(sup, seq: int, delivery: int | None = None) -> list[str]:
    """The events of one job (of one delivery), in the order they were written."""
    return [r.event for r in sup.jobs.records() if r.seq == seq and delivery in (None, r.delivery)]


def threads_of(sup, event: str) -> set[str]:
    return {r.data.split(":")[0] for r in sup.jobs.records() if r.event == event}


@pytest.mark.parametrize("kind", list(KINDS))
def test_hooks_run_in_order_and_a_failing_hook_retries_its_job(nats_server, supervisor_factory, kind):
    """Two middleware around a sync handler (its threads) or an async one (the loop), the inner
    one's hooks async and talking to NATS. Hooks that raise on a job's first delivery: the job
    comes back (it was NAKed, not acked: the journal shows its second delivery) and runs once
    its hooks let it; Reject dead-letters it unrun; the one worker lives through all of it."""
    sup = with_middleware(supervisor_factory, nats_server, kind)
    sup.wait_ready(1)
    [pid] = sup.worker_pids()
    payloads = [*HOOK_FAILURES, "hook-after-retries", "hook-before-rejects", *["0"] * 6]
    seqs = dict(zip(payloads[:6], [s for p in payloads[:6] for s in publish_now(nats_server.url, count=1, data=p)]))
    plain = publish_now(nats_server.url, count=6, data="0")
    wait_until(lambda: nats_server.stream_msgs() == 0, what="every job acked or dead-lettered")

    # The order, for a plain job: the onion, outermost first in and last out.
    assert journal(sup, plain[0]) == ["mw:A.before", "mw:A.around-in", "mw:B.before", "start", "done",
                                      "mw:B.after:ack", "mw:A.around-out", "mw:A.after:ack"]
    assert threads_of(sup, "mw:A.before") <= ({"MainThread"} if kind.startswith("async") else
                                              {f"handler_{k}" for k in range(KINDS[kind][2])})
    assert threads_of(sup, "mw:B.before") == {"MainThread"}          # async hooks: on the loop
    # A failing hook: the first delivery is NAKed (retried), never acked unrun.
    first = {p: journal(sup, seqs[p], 1) for p in seqs}
    assert first["hook-before-fails"] == ["mw:A.before", "mw:A.around-in", "mw:B.before", "mw:A.after:fail"]
    assert first["hook-after-fails"] == ["mw:A.before", "mw:A.around-in", "mw:B.before", "start", "done",
                                         "mw:B.after:ack", "mw:A.after:fail"]
    assert first["hook-around-fails"] == ["mw:A.before", "mw:A.around-in", "mw:A.after:fail"]
    assert first["hook-skips"] == ["mw:A.before", "mw:A.around-in", "mw:A.after:fail"]
    assert first["hook-after-retries"][-1] == "mw:A.after:retry"
    for p in (*HOOK_FAILURES, "hook-after-retries"):
        assert journal(sup, seqs[p], 2)[-1] == "mw:A.after:ack", (p, journal(sup, seqs[p]))
    runs = collections.Counter(r.seq for r in sup.jobs.done())
    assert all(runs[seqs[p]] == 1 for p in ("hook-before-fails", "hook-around-fails", "hook-skips"))
    assert runs[seqs["hook-after-fails"]] == 2 and runs[seqs["hook-after-retries"]] == 2
    assert all(runs[s] == 1 for s in plain)
    where = {e["seq"]: e["where"] for e in sup.events("middleware_failed")}
    assert where == {seqs["hook-before-fails"]: "testmiddleware:Inner.before_job",
                     seqs["hook-after-fails"]: "testmiddleware:Inner.after_job",
                     seqs["hook-around-fails"]: f"testmiddleware:{KINDS[kind][1]}.around",
                     seqs["hook-skips"]: f"testmiddleware:{KINDS[kind][1]}.around"}
    # Reject from a hook: dead-lettered after that one delivery, its handler never ran.
    rejected = seqs["hook-before-rejects"]
    assert runs[rejected] == 0 and journal(sup, rejected)[-1] == "mw:A.after:reject"
    [letter] = dead_letter_headers(nats_server.url)
    assert letter["Supervisor-Dead-Letter-Sequence"] == str(rejected) and "rejecting on purpose" in \
        letter["Supervisor-Dead-Letter-Reason"]
    assert sup.worker_pids() == {pid} and not sup.events("worker_task_failed")
    assert sup.stop() == 0
    assert [r.event for r in sup.jobs.records() if r.seq == 0] == ["mw:B.setup:slot0", "mw:B.close"]


@pytest.mark.parametrize("kind", ["sync-c3", "async-c3"])
def test_jobs_a_hook_kept_from_running_do_not_eat_the_max_jobs_budget(nats_server, supervisor_factory, kind):
    """max_jobs=3: two jobs NAKed by a before_job (Retry) before their handler ran were received,
    not started (R1). The worker must go on pulling, run 3 jobs and be recycled."""
    sup = with_middleware(supervisor_factory, nats_server, kind, workers={"max_jobs": 3})
    sup.wait_ready(1)
    first = sup.worker_pids()
    skipped = [s for _ in range(2) for s in publish_now(nats_server.url, count=1, data="hook-before-retries")]
    plain = publish_now(nats_server.url, count=6, data="0")
    wait_until(lambda: sup.jobs.done_seqs() >= {*skipped, *plain}, what="every job run")
    recycled = sup.wait_event("worker_recycling")
    assert recycled["worker_pid"] in first
    runs = collections.Counter(r.pid for r in sup.jobs.started())
    assert runs[recycled["worker_pid"]] == 3, runs
    assert sum(runs.values()) == 8 and len(sup.jobs.done()) == 8    # each job once; the NAKed ones not at delivery 1
    assert all(journal(sup, s, 1)[-1] == "mw:A.after:retry" for s in skipped)
    wait_until(lambda: nats_server.stream_msgs() == 0, what="every job acked")
    assert sup.stop() == 0


def test_a_drain_finishes_the_job_inside_the_chain_and_naks_the_rest_before_it(nats_server, supervisor_factory,
                                                                               tmp_path):
    """SIGTERM while a sync job runs inside the middleware: it finishes, its after_job hooks run
    and it is acked; what was pulled and not started goes back without entering the chain (no
    hook saw it); the middleware is closed; the supervisor exits 0 with nothing ack-pending."""
    gate = tmp_path / "gate"
    sup = with_middleware(supervisor_factory, nats_server, "sync-c1", workers={"graceful_timeout": 60.0})
    sup.wait_ready(1)
    [running] = publish_now(nats_server.url, count=1, data=f"until:{gate}")
    waiting = publish_now(nats_server.url, count=3, data="0")
    wait_until(lambda: running in {r.seq for r in sup.jobs.running()}, what="the gated job running")
    sup.signal(signal.SIGTERM)

    def draining():
        status = sup.try_status()
        return status and [w for w in status["workers"]["list"] if w["state"] == "draining"]
    wait_until(draining, what="the worker draining, its job still running")
    gate.touch()
    assert sup.wait() == 0
    assert journal(sup, running)[-3:] == ["mw:B.after:ack", "mw:A.around-out", "mw:A.after:ack"]
    assert all(journal(sup, s) == [] for s in waiting), "a job NAKed at the stop never entered the chain"
    assert [r.event for r in sup.jobs.records() if r.seq == 0][-1] == "mw:B.close"
    [exited] = sup.events("worker_exited")
    assert exited["naked"] == [], "the worker left jobs for the parent's backstop NAK"
    assert nats_server.stream_msgs() == 3 and not sup.events("graceful_timeout_nak")


def test_middleware_sees_a_duplicate_acked_unrun_by_the_guard(nats_server, supervisor_factory):
    """[idempotency] is the innermost middleware: a job re-published after the duplicate window
    passes the user's before_job, the guard acks it unrun, and after_job is told "duplicate"."""
    sup = with_middleware(supervisor_factory, nats_server, "sync-c1", stream={"duplicate_window": 1.0},
                          idempotency={"enabled": True})
    sup.wait_ready(1)

    async def publish(nc):
        ack = await nc.jetstream().publish("jobs.new", b"0", headers={"Nats-Msg-Id": "D"})
        return None if ack.duplicate else ack.seq

    def publish_once() -> int | None:
        async def run():
            nc = await nats.connect(nats_server.url)
            try:
                return await publish(nc)
            finally:
                await nc.close()
        return asyncio.run(run())

    original = publish_once()
    wait_until(lambda: len(sup.jobs.done()) == 1, what="the job done")
    copy = wait_until(publish_once, what="the copy stored once the window passed", interval=0.1)
    wait_until(lambda: sup.status()["jobs"]["duplicate"] == 1, what="the copy acked as a duplicate")
    assert journal(sup, copy) == ["mw:A.before", "mw:A.around-in", "mw:B.before", "mw:B.after:duplicate",
                                  "mw:A.after:duplicate"]
    assert journal(sup, original)[-1] == "mw:A.after:ack"
    assert sup.stop() == 0


BEHIND = 8        # jobs stored behind the gated one
ROUNDS = 5        # setups tried until one admits jobs behind the gated one (each 1-3 s)


def gated_with_admitted_behind(sup, server, pid: int, gate) -> tuple[int, set[int]]:
    """A gated job running in the stopped-then-resumed worker with BEHIND jobs stored after it,
    and the held jobs that went through the loop-side before_job (empty after 5 s: none did)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        [running] = backlog_of(server.url, fast=40, count=1, data=f"until:{gate}")
        publish_now(server.url, count=BEHIND, data="0")
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: running in {r.seq for r in sup.jobs.running()}, what="the gated job running")

    def held() -> set[int] | None:  # pulled, not started, through before_job (a job is held before it is)
        status = sup.try_status()
        seqs = status and {e["stream_seq"] for w in status["workers"]["list"] for e in w["in_flight"]
                           if e["state"] == "held"}
        admitted = seqs and {s for s in seqs if journal(sup, s) == ["mw:B.before"]}
        return admitted or None
    try:
        return running, wait_until(held, timeout=5, what="jobs pulled and admitted, not started")
    except AssertionError:
        return running, set()


def test_a_sync_handlers_async_only_middleware_runs_on_the_loop_and_hears_of_a_drain(nats_server, supervisor_factory,
                                                                                    tmp_path):
    """A middleware whose hooks are all `async def` (Inner alone) around a sync handler runs on the
    worker's loop for a chunk of jobs at once, before the threads take them (Chain.enter/leave;
    the [idempotency] guard's path). The same rules hold there; and a job it admitted that a
    SIGTERM gives back before a thread took it has its after_job told "retry"."""
    sup = supervisor_factory(nats_server, args=JSON_LOGS, workers={
        "count": 1, "concurrency": 1, "handler": "testhandlers:record", "retry_backoff": [0.1],
        "graceful_timeout": 60.0, "middleware": ["testmiddleware:Inner"]})
    sup.wait_ready(1)
    seqs = {p: publish_now(nats_server.url, count=1, data=p)[0]
            for p in ("hook-before-fails", "hook-after-fails", "hook-before-rejects", "hook-after-retries")}
    plain = publish_now(nats_server.url, count=40, data="0")     # also teaches the worker its jobs are fast
    wait_until(lambda: nats_server.stream_msgs() == 0, what="every job acked or dead-lettered")
    assert journal(sup, plain[0]) == ["mw:B.before", "start", "done", "mw:B.after:ack"]
    assert threads_of(sup, "mw:B.before") == threads_of(sup, "mw:B.after:ack") == {"MainThread"}
    assert journal(sup, seqs["hook-before-fails"], 1) == ["mw:B.before"]
    assert journal(sup, seqs["hook-after-fails"], 1) == ["mw:B.before", "start", "done", "mw:B.after:ack"]
    for p in ("hook-before-fails", "hook-after-fails", "hook-after-retries"):
        assert journal(sup, seqs[p], 2)[-1] == "mw:B.after:ack", (p, journal(sup, seqs[p]))
    assert journal(sup, seqs["hook-before-rejects"]) == ["mw:B.before"] and len(dead_letter_headers(nats_server.url)) == 1
    assert {e["where"] for e in sup.events("middleware_failed")} == {"testmiddleware:Inner.before_job",
                                                                     "testmiddleware:Inner.after_job"}
    # The drain: one job running, some pulled and admitted by the loop-side hooks, not started. A
    # worker buffers jobs behind a running one only from a backlog (workers/runtime/pulls.py): it
    # is stored while the worker is stopped, fast jobs ahead so that the worker learns they are.
    # Only jobs handed to the threads in the gated job's chunk are admitted while it runs (a chunk
    # is entered at once, Threads.hand_over); one pulled after it waits unentered, and a drain NAKs
    # it with no hook to tell. Where the pulls split the backlog is the server's and the load's:
    # when no job shared the gated one's chunk, the gate opens, the rest runs, and the state is
    # set up again (the assertions below are on the round that had it).
    [pid] = [w["pid"] for w in sup.status()["workers"]["list"]]
    for attempt in range(ROUNDS):
        running, admitted = gated_with_admitted_behind(sup, nats_server, pid, tmp_path / f"gate{attempt}")
        if admitted:
            break
        (tmp_path / f"gate{attempt}").touch()
        wait_until(lambda: nats_server.stream_msgs() == 0, what="a round without admitted jobs run out")
    assert admitted, f"in {ROUNDS} rounds no job was admitted behind the gated one"
    gate = tmp_path / f"gate{attempt}"
    sup.signal(signal.SIGTERM)
    wait_until(lambda: all(journal(sup, s)[-1:] == ["mw:B.after:retry"] for s in admitted),
               what="the jobs given back at the stop told their after_job hooks")
    gate.touch()
    assert sup.wait() == 0
    assert journal(sup, running)[-1] == "mw:B.after:ack"
    assert all(journal(sup, s) == ["mw:B.before", "mw:B.after:retry"] for s in admitted)
    [exited] = sup.events("worker_exited")
    assert exited["naked"] == [] and nats_server.stream_msgs() == BEHIND
