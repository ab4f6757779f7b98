"""The ack fence (workers/runtime/settle.py `confirm`): an acked entry leaves the slot table only
once a fence proved the server read the ack. Until then the parent NAKs it if the worker dies,
so an ack that never arrived costs a prompt redelivery, not AckWait.

tests/integration/test_crash_safety.py kills the worker before its settler runs at all, so it
cannot tell a fence from none. Here the settler runs while the worker's connection goes nowhere:
its ack is written and dropped (tests/support/cutproxy.py), and its fence can get no PONG. A
settler that released the entry without a fence would leave nothing for the parent to NAK at
the death.
"""

from __future__ import annotations

import time

from cutproxy import CutProxy
from harness import publish, wait_until

ACK_WAIT = 60.0
JSON_LOGS = ("--log-format", "json")


def beat_after(sup, t: float) -> bool:
    """The worker's heartbeat task has run since `t` (monotonic, one clock for every process)."""
    [w] = (sup.try_status() or {"workers": {"list": [{}]}})["workers"]["list"]
    age = w.get("heartbeat_age_s")
    return age is not None and time.monotonic() - age > t


def test_an_ack_no_fence_confirmed_stays_in_the_table_and_is_naked_at_death(nats_server, supervisor_factory, tmp_path):
    gate = tmp_path / "finish"
    proxy = CutProxy(nats_server).start()
    try:
        sup = supervisor_factory(nats_server, workers={"count": 1}, consumer={"ack_wait": ACK_WAIT},
                                 nats={"servers": [proxy.url]}, args=JSON_LOGS)
        sup.wait_ready(1)
        publish(nats_server.url, count=1, data=f"until:{gate}")
        [job] = wait_until(lambda: sup.jobs.running(), what="the job running")
        assert proxy.hold("worker")                      # what the worker writes goes nowhere from now
        gate.touch()
        wait_until(lambda: b"+ACK" in proxy.dropped, what="the ack written, and dropped")
        written = time.monotonic()
        # A heartbeat 0.6 s after the ack was written: the settler, woken before it, has had its turn.
        wait_until(lambda: beat_after(sup, written + 0.6), what="a heartbeat of the worker since")
        sup.workers()[0].kill()
        death = sup.wait_event("worker_died", worker_pid=job.pid)
        proxy.release("worker")
        assert death["held"] == [job.seq] and death["naked"] == [job.seq], \
            f"the unconfirmed ack's entry was not kept for the parent to NAK: {death}"
        [record] = [d for d in sup.status()["crosscheck"]["recent_deaths"] if d["pid"] == job.pid]
        assert [(h["stream_seq"], h["state_at_death"]) for h in record["held_jobs"]] == [(job.seq, "acked")]
        again = wait_until(lambda: [r for r in sup.jobs.done() if r.delivery == 2], timeout=ACK_WAIT / 3,
                           what="the job back (NAKed), long before AckWait")[0]
        assert again.seq == job.seq
        wait_until(lambda: nats_server.stream_msgs() == 0, what="the job acked in the end")
        assert sup.stop() == 0
    finally:
        proxy.stop()
