"""A worker at the edges (issue 22, the worker side): a job received but never run must not eat
the max_jobs budget; a worker whose supervisor is gone gives back what it will not run and exits
promptly; pull requests buffered while disconnected keep their credits; graceful_timeout is the
one the worker was forked with. Real nats-server, real `supervisor start`, real signals."""

from __future__ import annotations

import asyncio
import collections

import nats
import pytest
from harness import publish_now, wait_until

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
