"""A worker at the edges (issue 22, the worker side): a job received but never run must not eat
the max_jobs budget; a worker whose supervisor is gone gives back what it will not run and exits
promptly; pull requests buffered while disconnected keep their credits; graceful_timeout is the
one the worker was forked with. Real nats-server, real `supervisor start`, real signals."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import time

import nats
import psutil
import pytest
import tomli_w
from harness import alive, backlog_of, publish_now, wait_until

from supervisor.core.liveness import DRAIN_MARGIN
from workers.protocol.events import Settled, Unsent, decode
from workers.runtime.orphan import ORPHAN_GRACE
from workers.runtime.puller import PULL_EXPIRES, PULL_MARGIN

JSON_LOGS = ("--log-format", "json")


def publish_id(url: str, msg_id: str, data: str = "0") -> bool:
    """Publish one job with a Nats-Msg-Id; True when the stream stored it (not a duplicate)."""
    async def run() -> bool:
        nc = await nats.connect(url)
        try:
            ack = await nc.jetstream().publish("jobs.new", data.encode(), headers={"Nats-Msg-Id": msg_id})
            return not ack.duplicate
        finally:
            await nc.close()
    return asyncio.run(run())


# ---------------------------------------------------------------- R1: the max_jobs budget

@pytest.mark.parametrize("handler,concurrency", [("record", 1), ("record_async", 1), ("record", 3),
                                                 ("record_async", 3)],
                         ids=["sync", "async", "sync-c3", "async-c3"])
def test_a_job_acked_as_a_duplicate_does_not_eat_the_max_jobs_budget(nats_server, supervisor_factory, handler,
                                                                     concurrency):
    """max_jobs=3 with [idempotency]: a job re-published after the duplicate window is acked
    without running (DUPLICATE). It was received, not started: the worker must go on pulling,
    run its 3 jobs and be recycled; the 8 jobs after it all run, once each."""
    sup = supervisor_factory(nats_server, args=JSON_LOGS, stream={"duplicate_window": 1.0},
                             idempotency={"enabled": True},
                             workers={"count": 1, "max_jobs": 3, "concurrency": concurrency,
                                      "handler": f"testhandlers:{handler}"})
    sup.wait_ready(1)
    first = sup.worker_pids()
    assert publish_id(nats_server.url, "X")
    wait_until(lambda: len(sup.jobs.done()) == 1, what="job X done")
    # Inside the window the stream drops the copy; the first try after it is stored.
    wait_until(lambda: publish_id(nats_server.url, "X"), what="the re-published X stored", interval=0.1)
    wait_until(lambda: sup.status()["jobs"]["duplicate"] == 1, what="the copy acked as a duplicate, unrun")
    seqs = publish_now(nats_server.url, count=8, data="0")
    wait_until(lambda: sup.jobs.done_seqs() >= set(seqs), what="the 8 jobs after the duplicate all run")
    recycled = sup.wait_event("worker_recycling")
    assert recycled["worker_pid"] in first, "the worker that saw the duplicate recycles after 3 jobs it ran"
    runs = collections.Counter(r.pid for r in sup.jobs.started())
    assert runs[recycled["worker_pid"]] == 3, runs
    assert max(runs.values()) <= 3 and sum(runs.values()) == 9      # X once, the copy never, the 8 once each
    wait_until(lambda: nats_server.stream_msgs() == 0, what="every job acked")
    assert sup.stop() == 0


def running_a_gated_job(supervisor_factory, nats_server, tmp_path, **workers):
    """One worker (JSON logs) running a job that lasts until the test creates the gate file:
    (supervisor, the worker's process, the gate)."""
    gate = tmp_path / "gate"
    sup = supervisor_factory(nats_server, args=JSON_LOGS, workers={"count": 1, **workers})
    sup.wait_ready(1)
    [worker] = sup.workers()
    publish_now(nats_server.url, count=1, data=f"until:{gate}")
    wait_until(lambda: sup.jobs.running(), what="the job running")
    return sup, worker, gate


# ---------------------------------------------------------------- issue 22 item 8: graceful_timeout at fork

def test_a_sighup_lowering_graceful_timeout_does_not_cut_a_draining_workers_grace(nats_server, supervisor_factory,
                                                                                 tmp_path):
    """graceful_timeout is read by a worker at fork (reload=REPLACE). A SIGHUP lowering it from
    30 s to 1 s replaces the worker: the old one retires, running its job under the 30 s it was
    forked with, and the parent must give it that long too, not the new 1 s (+ DRAIN_MARGIN)."""
    sup, old, gate = running_a_gated_job(supervisor_factory, nats_server, tmp_path, graceful_timeout=30.0)
    rewrite_config(sup, workers={"graceful_timeout": 1.0})
    sup.signal(signal.SIGHUP)

    def draining():
        return [w for w in sup.status()["workers"]["list"] if w["pid"] == old.pid and w["state"] == "draining"]
    wait_until(draining, what="the old worker retiring (its replacement ready)")
    cut_at = time.monotonic() + 1.0 + DRAIN_MARGIN + 1.0      # past the deadline a live read of the new value gives
    wait_until(lambda: time.monotonic() > cut_at or not old.is_running(), timeout=30, what="the new value's deadline")
    assert alive(old), \
        f"the parent cut the old worker's grace: {sup.events('worker_died')}"
    gate.touch()
    sup.wait_event("worker_exited", worker_pid=old.pid)
    assert [(r.pid, r.delivery) for r in sup.jobs.done()] == [(old.pid, 1)] and len(sup.jobs.started()) == 1
    assert sup.events("worker_died") == []
    assert sup.stop() == 0


def rewrite_config(sup, **sections):
    for name, values in sections.items():
        sup.config.setdefault(name, {}).update(values)
    sup.config_path.write_text(tomli_w.dumps(sup.config))


# ---------------------------------------------------------------- R3, issue 22 item 3: orphans

def gone(procs: list[psutil.Process]) -> bool:
    return not [p for p in procs if alive(p)]


def in_flight(sup, state: str) -> list[dict]:
    return [e for w in sup.status()["workers"]["list"] for e in w["in_flight"] if e["state"] == state]


@pytest.mark.parametrize("handler", ["record_async", "record"], ids=["async", "sync"])
def test_orphans_give_back_what_they_did_not_start_and_finish_what_runs(nats_server, supervisor_factory, handler):
    """The supervisor SIGKILLed under load, external server: its workers, orphans now, finish the
    jobs they run (1 s, within ORPHAN_GRACE), NAK the ones they pulled and had not started, fence,
    and exit. Nobody is left to NAK at their exit, so without their own NAK the unstarted jobs
    would wait for AckWait (60 s): a next supervisor runs them within AckWait / 2 of the kill,
    and nothing runs twice."""
    ack_wait = 60.0
    seqs = backlog_of(nats_server.url, fast=100, count=16, data="1.0")   # so the workers buffer
    sup = supervisor_factory(nats_server, args=JSON_LOGS, consumer={"ack_wait": ack_wait},
                             workers={"count": 2, "batch": 8, "graceful_timeout": 30.0,
                                      "handler": f"testhandlers:{handler}"})
    # Both workers ready first: one killed while still starting holds nothing and leaves without
    # the orphan's word (seen in CI at -n 6: worker 1 took every job while worker 0 connected).
    wait_until(lambda: (s := sup.try_status()) and sum(w["state"] == "ready" for w in s["workers"]["list"]) == 2,
               what="both workers ready")
    # One worker may have taken every long job (a backlog lets it hold several requests' worth).
    wait_until(lambda: [r for r in sup.jobs.running() if r.seq in seqs]
               and [e for e in in_flight(sup, "held") if e["stream_seq"] in seqs], what="jobs running and jobs held")
    family = sup.workers()
    sup.signal(signal.SIGKILL)
    killed = time.time()
    sup.wait()
    wait_until(lambda: gone(family), timeout=ORPHAN_GRACE + 5, what="the orphans gone within their grace + 5 s")
    log = sup.log()
    assert len(sup.events("worker_orphaned")) == 2 and "BrokenPipeError" not in log and "crashed" not in log, log[-3000:]
    finished = {r.seq for r in sup.jobs.done()} & set(seqs)
    assert finished and {r.seq for r in sup.jobs.started()} & set(seqs) == finished, "what ran finished, once"

    # Four workers: the rest (about 14 jobs of 1 s) drain in half the time two would take.
    again = supervisor_factory(nats_server, workers={"count": 4}, consumer={"ack_wait": ack_wait})
    rest = set(seqs) - finished
    wait_until(lambda: again.jobs.done_seqs() >= rest, timeout=ack_wait, what="the unstarted jobs run by the next one")
    late = [r for r in again.jobs.started() if r.t - killed >= ack_wait / 2]
    assert not late, f"back only after AckWait: the orphans did not NAK them: {late}"
    assert not again.jobs.done_seqs() & finished, "a job the orphan finished ran again: its ack was lost"
    assert sorted(r.seq for r in [*sup.jobs.done(), *again.jobs.done()] if r.seq in seqs) == sorted(seqs)
    wait_until(lambda: nats_server.stream_msgs() == 0, what="every job acked")
    assert again.stop() == 0


def test_orphans_of_an_embedded_server_exit_at_once(tmp_path, supervisor_factory):
    """The embedded nats-server dies with the supervisor: its orphans can settle nothing, so they
    exit at once (event worker_gave_up) instead of running their 40 s jobs under a 60 s
    graceful_timeout for acks nobody can take. Nothing of ours is left a few seconds later."""
    sup = supervisor_factory(None, args=JSON_LOGS, embedded={"store_dir": str(tmp_path / "store")},
                             workers={"count": 2, "graceful_timeout": 60.0})
    url = sup.wait_ready(2)["nats"]["servers"][0]
    publish_now(url, count=4, data="40")
    wait_until(lambda: len(sup.jobs.running()) == 2, what="two jobs running")
    family = psutil.Process(sup.proc.pid).children(recursive=True)
    assert len(family) == 3                          # 2 workers + the embedded nats-server
    sup.signal(signal.SIGKILL)
    sup.wait()
    wait_until(lambda: gone(family), timeout=ORPHAN_GRACE + 5, what="every worker and the nats-server gone")
    assert len(sup.events("worker_gave_up")) == 2, sup.log()[-3000:]
    assert not [r for r in sup.jobs.done()]


def test_a_drain_under_way_is_cut_to_the_orphans_grace_when_the_parent_dies(nats_server, supervisor_factory,
                                                                          tmp_path):
    """The supervisor is stopping (SIGTERM, graceful_timeout 60 s, a job that runs on) and is
    SIGKILLed mid-drain (systemd's stop timeout, the OOM killer). Its worker, now an orphan,
    must not wait out the 60 s it had: it NAKs the job after ORPHAN_GRACE and exits."""
    sup, worker, gate = running_a_gated_job(supervisor_factory, nats_server, tmp_path, graceful_timeout=60.0)
    sup.signal(signal.SIGTERM)
    wait_until(lambda: [w for w in sup.status()["workers"]["list"] if w["state"] == "draining"], what="the drain")
    sup.signal(signal.SIGKILL)
    sup.wait()
    wait_until(lambda: gone([worker]), timeout=ORPHAN_GRACE + 5, what="the orphan gone, its drain cut short")
    assert sup.events("worker_orphaned") and sup.events("graceful_timeout_nak"), sup.log()[-3000:]
    assert not gate.exists()


# ---------------------------------------------------------------- each way a worker learns its parent died

def test_a_worker_still_in_its_init_hook_dies_with_its_parent(nats_server, supervisor_factory, tmp_path):
    """The parent-death signal alone: a worker still in workers.init runs no loop, so it cannot
    look at its parent; only the signal (SIGTERM, default action) ends it. Without it the worker
    would wait in its init hook for good."""
    sup = supervisor_factory(nats_server, workers={"count": 1, "init": "testhandlers:gate_init"},
                             env={"GATE_DIR": str(tmp_path)})
    # Its title is set at the end of become_child, after prctl(PR_SET_PDEATHSIG).
    [worker] = wait_until(lambda: [p for p in sup.workers() if "supervisor: worker" in " ".join(p.cmdline())],
                          what="the worker in its init hook")
    sup.signal(signal.SIGKILL)
    sup.wait()
    wait_until(lambda: gone([worker]), timeout=10, what="the worker gone with its parent, its init still waiting")
    assert not (tmp_path / "open").exists()


def test_a_worker_that_lost_its_parent_death_signal_still_sees_its_parent_gone(nats_server, supervisor_factory,
                                                                              tmp_path):
    """The ppid check alone: an init hook that changes the worker's credentials (drops privileges)
    makes the kernel clear the parent-death signal. The heartbeat's check of the parent pid still
    finds the supervisor gone: the worker gives its running job ORPHAN_GRACE, NAKs it and exits."""
    sup, worker, gate = running_a_gated_job(supervisor_factory, nats_server, tmp_path,
                                            init="testhandlers:lose_parent_death_signal_init")
    sup.signal(signal.SIGKILL)
    sup.wait()
    wait_until(lambda: gone([worker]), timeout=ORPHAN_GRACE + 10, what="the orphan gone")
    assert sup.events("worker_orphaned") and sup.events("graceful_timeout_nak"), sup.log()[-3000:]
    assert not gate.exists()


# ---------------------------------------------------------------- the event pipe (workers/runtime/events.py)

def test_events_to_a_parent_that_is_gone_are_dropped_not_raised():
    from workers.runtime.events import EventPipe

    read_fd, write_fd = os.pipe()
    os.close(read_fd)                    # the parent is gone
    pipe = EventPipe(write_fd, slot=0)
    try:
        pipe.send(Settled(1, 1, "ack"))  # BrokenPipeError before: the orphan's drain died of it
        pipe.send(Settled(2, 1, "ack"))
        assert pipe.closed and not pipe.backlog
    finally:
        os.close(write_fd)


def test_events_to_a_parent_that_does_not_read_wait_without_blocking_and_arrive_whole():
    from workers.runtime.events import EventPipe

    read_fd, write_fd = os.pipe()
    pipe = EventPipe(write_fd, slot=0)
    try:
        sent = 0
        while not pipe.backlog:          # fill the pipe: the next event no longer fits
            pipe.send(Unsent(sent, 1, "ack", "x" * 200))
            sent += 1
        for seq in range(sent, sent + 10):
            pipe.send(Unsent(seq, 1, "ack", "x" * 200))    # kept, returns at once
        sent += 10
        assert pipe.backlog
        os.set_blocking(read_fd, False)
        data = os.read(read_fd, 1 << 16)     # the parent takes what the pipe held: room again
        pipe.drain(timeout=5.0)              # the worker's exit: the rest goes in
        assert not pipe.backlog
        while True:
            try:
                data += os.read(read_fd, 1 << 16)
            except BlockingIOError:
                break
        assert [decode(line).seq for line in data.splitlines()] == list(range(sent)), "whole, in order"
    finally:
        os.close(read_fd)
        os.close(write_fd)


# ---------------------------------------------------------------- R8: pull requests and reconnects

def test_no_pull_request_is_kept_for_after_a_reconnect(nats_server, supervisor_factory):
    """While a worker reconnects, nats-py buffers what it publishes and sends it once connected.
    A pull request buffered so is live on the new connection, yet the worker had given up its
    credits: every ~2 s of outage one more. With 1 job per request and a 4-entry slot table
    (concurrency 1, batch 1), 10 s away meant 5 requests plus a fresh one: more messages than the
    table holds, the rest NAKed at once ("table full"), each spending a delivery. Now no request
    is published while not connected (the probe pulls_while_down_init logs any: pull_buffered),
    no message comes that the worker's credits do not account for (pull_unasked), and every job
    runs at its first delivery."""
    from cutproxy import CutProxy

    proxy = CutProxy(nats_server).start()
    try:
        sup = supervisor_factory(nats_server, args=JSON_LOGS, nats={"servers": [proxy.url]},
                                 consumer={"ack_wait": 60.0}, workers={"count": 1, "concurrency": 1, "batch": 1,
                                                                       "init": "testhandlers:pulls_while_down_init"})
        sup.wait_ready(1)
        [worker] = sup.worker_pids()
        assert proxy.refuse("worker")
        sup.wait_event("nats_disconnected", pid=worker)
        away = time.monotonic() + 5 * (PULL_EXPIRES + PULL_MARGIN)     # the outage: 5 of the puller's rounds
        wait_until(lambda: time.monotonic() > away, what="the outage")
        seqs = publish_now(nats_server.url, count=12, data="0.3")    # a backlog waits for the reconnect
        proxy.admit()
        sup.wait_event("nats_reconnected", pid=worker)
        wait_until(lambda: sup.jobs.done_seqs() >= set(seqs), what="the backlog done")
        assert sup.events("pull_buffered") == [], "pull requests kept by nats-py for after the reconnect"
        assert sup.events("pull_unasked") == [], "messages came that no request of the worker's accounted for"
        bounced = [(r.seq, r.delivery) for r in sup.jobs.started() if r.delivery > 1]
        assert bounced == [], f"deliveries spent on messages nobody asked for: {bounced}"
        assert nats_server.consumer()["num_redelivered"] == 0
        assert sup.stop() == 0
    finally:
        proxy.stop()
