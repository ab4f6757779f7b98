"""workers.soft_timeout in real workers against a real nats-server: SoftTimeout interrupts a
runaway pure-Python loop (sync, in its thread) and a sleeping async job (cancelled) without
killing the worker, and [retry] retries it like any failure; the hard workers.job_timeout still
kills a job the soft limit cannot reach (asleep inside C); soft_timeout >= job_timeout is exit 2."""

from __future__ import annotations

import pytest
from harness import publish_now, run_cli, wait_until

JSON_LOGS = ("--log-format", "json")


@pytest.mark.parametrize("handler, payload", [("record", "hog"), ("record_async", "long-once:120")],
                         ids=["sync-runaway-loop", "async-asleep"])
def test_a_soft_timeout_interrupts_the_job_and_the_worker_lives_on(nats_server, supervisor_factory, handler, payload):
    sup = supervisor_factory(nats_server, args=JSON_LOGS, workers={
        "count": 1, "concurrency": 2, "handler": f"testhandlers:{handler}", "soft_timeout": 0.5,
        "job_timeout": 60.0, "retry_backoff": [0.1]})
    sup.wait_ready(1)
    [pid] = sup.worker_pids()
    [seq] = publish_now(nats_server.url, count=1, data=payload)
    others = publish_now(nats_server.url, count=4, data="0.05")       # beside it, in the other thread / task
    wait_until(lambda: {seq, *others} <= sup.jobs.done_seqs(), what="every job done, the long one at its 2nd try")
    runs = [(r.event, r.delivery) for r in sup.jobs.records() if r.seq == seq]
    assert runs == [("start", 1), ("start", 2), ("done", 2)], runs          # delivery 1 never finished
    [failed] = sup.events("handler_failed", seq=seq)
    assert (failed["delivery"], failed["error"], failed["delay"]) == (1, "workers.SoftTimeout", 0.1)
    assert sup.worker_pids() == {pid} and not sup.events("worker_killed") and not sup.events("worker_died")
    wait_until(lambda: nats_server.stream_msgs() == 0, what="every job acked (the journal's 'done' comes first)")
    assert sup.stop() == 0


def test_the_hard_job_timeout_still_kills_what_the_soft_one_cannot_reach(nats_server, supervisor_factory):
    """A sync job asleep in time.sleep (C): SoftTimeout is raised only once the sleep returns, so
    at job_timeout the parent kills the worker and NAKs the job; its rerun is quick."""
    sup = supervisor_factory(nats_server, args=JSON_LOGS, workers={
        "count": 1, "soft_timeout": 0.5, "job_timeout": 2.0})
    sup.wait_ready(1)
    [pid] = sup.worker_pids()
    [seq] = publish_now(nats_server.url, count=1, data="long-once:120")
    killed = sup.wait_event("worker_killed", worker_pid=pid)
    assert "job_timeout" in killed["reason"]
    wait_until(lambda: seq in sup.jobs.done_seqs(), what="the job rerun by the next worker")
    assert [r.delivery for r in sup.jobs.done() if r.seq == seq] == [2]
    assert sup.stop() == 0


def test_a_soft_timeout_not_below_the_hard_one_exits_2(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[workers]\nhandler = "workers.examples:noop"\nsoft_timeout = 5.0\njob_timeout = 5.0\n')
    result = run_cli("start", "--config", str(path), tmp=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "workers.soft_timeout: must be below workers.job_timeout (5)" in result.stderr
