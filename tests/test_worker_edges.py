"""A worker at the edges (issue 22, the worker side): a job received but never run must not eat
the max_jobs budget; a worker whose supervisor is gone gives back what it will not run and exits
promptly; pull requests buffered while disconnected keep their credits; graceful_timeout is the
one the worker was forked with. Real nats-server, real `supervisor start`, real signals."""

from __future__ import annotations

import asyncio
import collections
import signal
import time

import nats
import psutil
import pytest
import tomli_w
from harness import publish_now, wait_until

from supervisor.liveness import DRAIN_MARGIN

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


# ---------------------------------------------------------------- issue 22 item 8: graceful_timeout at fork

def test_a_sighup_lowering_graceful_timeout_does_not_cut_a_draining_workers_grace(nats_server, supervisor_factory,
                                                                                 tmp_path):
    """graceful_timeout is read by a worker at fork (reload=REPLACE). A SIGHUP lowering it from
    30 s to 1 s replaces the worker: the old one retires, running its job under the 30 s it was
    forked with, and the parent must give it that long too, not the new 1 s (+ DRAIN_MARGIN)."""
    gate = tmp_path / "gate"
    sup = supervisor_factory(nats_server, args=JSON_LOGS, workers={"count": 1, "graceful_timeout": 30.0})
    sup.wait_ready(1)
    [old] = sup.workers()
    publish_now(nats_server.url, count=1, data=f"until:{gate}")
    wait_until(lambda: sup.jobs.running(), what="the job running")
    rewrite_config(sup, workers={"graceful_timeout": 1.0})
    sup.signal(signal.SIGHUP)

    def draining():
        return [w for w in sup.status()["workers"]["list"] if w["pid"] == old.pid and w["state"] == "draining"]
    wait_until(draining, what="the old worker retiring (its replacement ready)")
    cut_at = time.monotonic() + 1.0 + DRAIN_MARGIN + 1.0      # past the deadline a live read of the new value gives
    wait_until(lambda: time.monotonic() > cut_at or not old.is_running(), timeout=30, what="the new value's deadline")
    assert old.is_running() and old.status() != psutil.STATUS_ZOMBIE, \
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
