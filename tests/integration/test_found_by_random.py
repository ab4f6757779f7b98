"""Defects the randomized fault suite (python -m chaos --random) found, each forced on its own
against a real nats-server and the real supervisor, with the seed that found it.

These sit in areas other changes are fixing (the in-transit check); each test is the minimal
reproducer of its finding and fails on the code it was found on.
"""

from __future__ import annotations

import os
import signal
import time

from harness import NatsServer, SupervisorProc, base_config, publish_now, wait_until

from chaos.facts import read_journal

ACK_WAIT = 30.0


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
            return
        raise AssertionError("could not get a redelivery onto the wire to a stopped worker in 5 tries")
    finally:
        sup.cleanup()
        server.stop()


def on_the_wire_to_a_stopped_worker(server: NatsServer, sup: SupervisorProc, journal, attempt: int):
    """Publish a job whose first run raises Retry(0.5); once its NAK is out, SIGSTOP the worker and
    wait for the server to redeliver it (into the worker's live pull request). (seq, pid), or
    (None, pid) when the worker read the redelivery before it stopped."""
    pid = next(iter(sup.worker_pids()))
    seq = publish_now(server.url, count=1, data=f"j{attempt}:retry0.5:0.01", subject="jobs.found")[0]
    wait_until(lambda: (s := sup.try_status()) and s["jobs"]["nak"] >= attempt, 30, "the handler's NAK sent",
               interval=0.005)
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
