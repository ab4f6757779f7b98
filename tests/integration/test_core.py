"""The core (issue 2): forked workers share one durable pull consumer, crashed workers are
replaced, SIGTERM drains. Real nats-server, real processes, real signals."""

import os
import re
import selectors
import signal
import subprocess
import sys
import time

import psutil
from harness import NatsServer, alive, backlog_of, child_env, popen_at_a_terminal, publish, run_cli, wait_until

ACK_WAIT = 60.0      # far longer than any wait below: a job back within seconds was NAKed, not expired


def overlap(records) -> int:
    """The most jobs that ran at the same instant."""
    events = sorted([(r.t, 1) for r in records if r.event == "start"] + [(r.t, -1) for r in records if r.event == "done"])
    best = now = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def test_seed_first_experiment(nats_server, supervisor_factory, tmp_path):
    """3 workers, 30 jobs of 0.2 s: 30 deliveries, 30 unique, none redelivered, spread over all
    three pids, run in parallel; `supervisor lag` reads pending=0 ackPending=0 afterwards."""
    sup = supervisor_factory(nats_server, workers={"count": 3})
    sup.wait_ready(3)
    publish(nats_server.url, count=30, data="0.2")
    wait_until(lambda: len(sup.jobs.done()) >= 30, what="30 jobs done")
    wait_until(lambda: nats_server.stream_msgs() == 0, what="every job acked (work queue empty)")

    done = sup.jobs.done()
    assert len(done) == 30
    assert len({r.seq for r in done}) == 30
    assert all(r.delivery == 1 for r in done)
    assert len({r.pid for r in done}) == 3, "jobs must spread over all three workers"
    assert {r.pid for r in done} == sup.worker_pids()
    assert overlap(sup.jobs.records()) == 3, "three jobs must run at once"
    elapsed = max(r.t for r in done) - min(r.t for r in sup.jobs.started())
    print(f"30 jobs of 0.2 s on 3 workers took {elapsed:.2f} s (one worker: 6 s)")

    lag = run_cli("lag", "--server", nats_server.url)
    assert lag.returncode == 0, lag.stderr
    assert "pending=0 " in lag.stdout and "ackPending=0 " in lag.stdout and "redelivered=0 " in lag.stdout
    assert "delivered=30 " in lag.stdout and "ackFloor=30" in lag.stdout
    assert sup.stop() == 0


def test_sigkill_mid_job_is_replaced_and_job_redone(nats_server, supervisor_factory):
    """The job a SIGKILLed worker was running is NAKed at once: with AckWait 60 s it is redone
    by another worker within seconds, which only the supervisor's NAK explains."""
    sup = supervisor_factory(nats_server, workers={"count": 2}, consumer={"ack_wait": ACK_WAIT},
                             args=("--log-format", "json"))
    sup.wait_ready(2)
    before = sup.worker_pids()
    publish(nats_server.url, count=1, data="long-once:30")
    victim = wait_until(lambda: sup.jobs.running(), what="the job to start")[0]
    psutil.Process(victim.pid).send_signal(signal.SIGKILL)
    t_kill = time.time()

    redone = wait_until(lambda: [r for r in sup.jobs.started() if r.seq == victim.seq and r.delivery == 2],
                        timeout=ACK_WAIT / 3, what="the job redelivered long before AckWait")[0]
    assert redone.pid != victim.pid
    assert redone.t - t_kill < ACK_WAIT / 6, "back within seconds: NAKed, not left to AckWait"
    wait_until(lambda: [r for r in sup.jobs.done() if r.seq == victim.seq], what="the job redone")
    wait_until(lambda: nats_server.stream_msgs() == 0, what="the job acked")
    sup.wait_ready(2)
    after = sup.worker_pids()
    assert victim.pid not in after and len(after) == 2 and after != before
    death = sup.wait_event("worker_died", worker_pid=victim.pid)
    assert "SIGKILL" in death["cause"] and death["held"] == [victim.seq] and death["naked"] == [victim.seq]
    assert sup.stop() == 0


def test_sigterm_drains_in_flight_jobs(tmp_path, supervisor_factory):
    """SIGTERM with 6 jobs in flight: all 6 finish and are acked once, exit 0, nothing redelivered
    afterwards, no worker or nats-server left. The embedded server's store is reopened after the
    supervisor is gone to prove the acks reached it before shutdown."""
    store = tmp_path / "store"
    sup = supervisor_factory(None, workers={"count": 3, "concurrency": 2}, embedded={"store_dir": str(store)})
    status = sup.wait_ready(3)
    url = status["nats"]["servers"][0]
    publish(url, count=6, data="3")
    wait_until(lambda: len(sup.jobs.running()) == 6, what="6 jobs in flight")
    family = [p for p in psutil.Process(sup.proc.pid).children(recursive=True)]
    sup.signal(signal.SIGTERM)
    assert sup.wait() == 0

    done = sup.jobs.done()
    assert len(done) == 6 and len({r.seq for r in done}) == 6 and all(r.delivery == 1 for r in done)
    wait_until(lambda: not any(alive(p) for p in family),
               timeout=10, what="no child process left")
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(store) in " ".join(p.info["cmdline"] or [])]

    server = NatsServer(store).start()
    try:
        c = server.consumer()
        assert c["num_ack_pending"] == 0 and c["num_pending"] == 0 and c["num_redelivered"] == 0
        assert c["delivered"]["consumer_seq"] == 6 and c["ack_floor"]["consumer_seq"] == 6
        assert server.stream_msgs() == 0
    finally:
        server.stop()


def test_drain_naks_pulled_but_not_started(nats_server, supervisor_factory):
    """Jobs a draining worker pulled but never started are NAKed by the worker itself, at once:
    not left to AckWait, not to graceful_timeout (which the stop would then wait out, the
    queue never emptying), not to the parent's backstop NAK at the worker's exit."""
    grace = 60.0
    # A backlog of fast jobs ahead: the worker learns they are fast and pulls batches, so jobs
    # behind the first long one wait in its buffer. An async handler: no thread hand-off in its timings.
    warm = 100
    backlog_of(nats_server.url, fast=warm, count=4, data="3.0")
    sup = supervisor_factory(nats_server, workers={"count": 1, "concurrency": 1, "batch": 4, "graceful_timeout": grace,
                                                   "handler": "testhandlers:record_async"},
                             consumer={"ack_wait": 300.0}, args=("--log-format", "json"))
    first = wait_until(lambda: [r for r in sup.jobs.running() if r.seq > warm], what="a long job running")[0]
    def held():
        return [e for w in sup.status()["workers"]["list"] for e in w["in_flight"]
                if e["state"] == "held" and e["stream_seq"] > warm]
    # Up to 3 (batch 4); how many depends on the measured job time, at least one is the case to force.
    pulled = {e["stream_seq"] for e in wait_until(held, what="jobs pulled but not started")}
    sup.signal(signal.SIGTERM)
    # The drain waits only for the running 3 s job and its last pull request: long before grace.
    assert sup.wait(timeout=grace / 2) == 0
    assert [r.seq for r in sup.jobs.done()] == [*range(1, warm + 1), first.seq]
    [exited] = sup.events("worker_exited")
    assert exited["naked"] == [], "the worker left jobs for the parent's backstop NAK"
    assert sup.events("graceful_timeout_nak") == []
    assert nats_server.stream_msgs() == 3
    again = supervisor_factory(nats_server, workers={"count": 3}, consumer={"ack_wait": 300.0})
    wait_until(lambda: len(again.jobs.done()) == 3, timeout=60, what="the 3 others processed long before AckWait")
    redelivered = {r.seq for r in again.jobs.started() if r.delivery == 2}
    assert redelivered >= pulled and max(r.delivery for r in again.jobs.started()) == 2, "NAKed once, by the drain"
    assert again.stop() == 0


def test_publish_with_msg_id_is_deduplicated(nats_server, tmp_path):
    first = publish(nats_server.url, count=5, data="0", extra=("--msg-id", "order"))
    assert "5 stored, 0 duplicates" in first
    again = publish(nats_server.url, count=7, data="0", extra=("--msg-id", "order"))
    assert "2 stored, 5 duplicates" in again
    assert nats_server.stream_msgs() == 7


def test_double_ack_acks_synchronously(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 2, "double_ack": True})
    sup.wait_ready(2)
    publish(nats_server.url, count=10, data="0")
    wait_until(lambda: nats_server.stream_msgs() == 0, what="every job acked")
    assert len(sup.jobs.done()) == 10
    wait_until(lambda: sup.status()["jobs"]["ack"] == 10, what="acks counted")
    assert sup.stop() == 0


def read_lines(proc: subprocess.Popen, n: int, timeout: float) -> list[str]:
    """n lines of proc's stdout, or an AssertionError after `timeout` (never a hang)."""
    lines, buffer = [], b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while len(lines) < n:
            left = deadline - time.monotonic()
            assert left > 0, f"only {len(lines)} of {n} lines within {timeout:g}s: {lines}"
            if sel.select(left):
                chunk = os.read(proc.stdout.fileno(), 4096)
                assert chunk, f"the process closed its output after {lines}"
                buffer += chunk
                *done, buffer = buffer.split(b"\n")
                lines += [line.decode() for line in done]
    return lines[:n]


def test_lag_watch_is_a_ticker_with_a_time_column(nats_server, supervisor_factory, tmp_path):
    sup = supervisor_factory(nats_server, workers={"count": 1})
    sup.wait_ready(1)
    ticker = popen_at_a_terminal([sys.executable, "-m", "supervisor", "lag", "--server", nats_server.url, "--watch", "0.2"],
                                 stdout=subprocess.PIPE, env=child_env(), cwd=tmp_path)
    try:
        lines = read_lines(ticker, 3, timeout=30)
        ticker.send_signal(signal.SIGINT)
        assert ticker.wait(10) == 0
    finally:
        if ticker.poll() is None:
            ticker.kill()
            ticker.wait()
        ticker.stdout.close()
    pattern = r"^\s*\d+\.\ds pending=\d+\s+ackPending=\d+\s+redelivered=\d+\s+delivered=\d+\s+ackFloor=\d+$"
    assert all(re.match(pattern, line) for line in lines), lines
    assert sup.stop() == 0
