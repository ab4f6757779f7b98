"""Delivery promises of the README that no other test would notice breaking (issue 17), each
against a real nats-server, real workers and real signals:

1. a dead worker's job whose AckWait has run out is not NAKed (the NAK would hit its next
   delivery, held by another worker: NAKs match by stream sequence);
2. a handler's exception is NAKed with workers.retry_backoff by delivery count;
3. workers.double_ack acks synchronously: each +ACK is a request with a reply inbox.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import nats
import pytest
from harness import publish, wait_until

# ---------------------------------------------------------------- 1. no NAK once AckWait has run out

# consumer.backoff replaces AckWait per delivery: the first delivery expires after FIRST_ACK_WAIT
# (so the server itself redelivers a job its worker still runs), the second only after
# SECOND_ACK_WAIT (longer than the whole test: delivery 2 is never redelivered by expiry).
FIRST_ACK_WAIT, SECOND_ACK_WAIT = 6.0, 300.0


def held_for(status: dict, pid: int, seq: int) -> float:
    """How long (per /status) worker `pid` has been running job `seq`; 0 if it is not."""
    return max((j["age_s"] for w in status["workers"]["list"] if w["pid"] == pid
                for j in w["in_flight"] if j["stream_seq"] == seq), default=0.0)


def test_a_dead_workers_job_past_its_ack_wait_is_not_naked(nats_server, supervisor_factory, tmp_path):
    """Worker A runs delivery 1 past its AckWait (no +WPI: progress_pings off), the server hands
    delivery 2 to worker B, then A is SIGKILLed. policy.nak_is_safe must withhold A's NAK: the
    reply subject differs, but the server matches a NAK by stream sequence, so it would NAK B's
    delivery 2 and the job would start a third time beside it."""
    gate = tmp_path / "gate"
    sup = supervisor_factory(nats_server, args=("--log-format", "json"),
                             workers={"count": 2, "progress_pings": False, "batch": 1},
                             consumer={"ack_wait": FIRST_ACK_WAIT, "backoff": [FIRST_ACK_WAIT, SECOND_ACK_WAIT]})
    sup.wait_ready(2)
    publish(nats_server.url, count=1, data=f"until:{gate}")
    first = wait_until(lambda: [r for r in sup.jobs.started() if r.delivery == 1], what="delivery 1 running")[0]
    # The server redelivers after FIRST_ACK_WAIT, to B: A runs one job at a time and asks for none.
    sup.wait_event("redelivered", seq=first.seq, delivery=2)
    second = wait_until(lambda: [r for r in sup.jobs.started() if r.delivery == 2], what="delivery 2 running")[0]
    assert second.pid != first.pid, f"delivery 2 went to the worker still running delivery 1: {sup.jobs.records()}"

    # nak_is_safe withholds a NAK once the entry is held longer than AckWait less a margin: kill
    # A only when the parent itself reports delivery 1 running for a whole AckWait (running
    # counts from the start, after it was held), whatever the load delayed.
    wait_until(lambda: held_for(sup.status(), first.pid, first.seq) >= FIRST_ACK_WAIT,
               what=f"delivery 1 held by its worker for {FIRST_ACK_WAIT:g}s")
    os.kill(first.pid, signal.SIGKILL)
    died = sup.wait_event("worker_died", worker_pid=first.pid)
    assert died["held"] == [first.seq], died
    assert died["naked"] == [], f"NAKed a job whose AckWait had run out: {died}"

    # A NAK, had one been sent, was fenced before worker_died was logged; the server would then
    # hand delivery 3 to the first free puller before any new job (redeliveries go first). So once
    # A's replacement is ready and a later job has run, a delivery 3 would have started.
    sup.wait_ready(2)
    publish(nats_server.url, count=1, data="0")
    wait_until(lambda: any(r.seq != first.seq for r in sup.jobs.done())
               or any(r.seq == first.seq and r.delivery > 2 for r in sup.jobs.started()),
               what="a later job done (or the job started a third time, taking the free worker)")
    assert [(r.pid, r.delivery) for r in sup.jobs.started() if r.seq == first.seq] == \
        [(first.pid, 1), (second.pid, 2)], f"the job started again beside delivery 2: {sup.jobs.records()}"
    assert second in sup.jobs.running() and second.pid in sup.worker_pids(), "delivery 2 still running"

    gate.touch()
    wait_until(lambda: any(r.seq == first.seq for r in sup.jobs.done()), what="delivery 2 done")
    assert sorted(r.delivery for r in sup.jobs.started() if r.seq == first.seq) == [1, 2], sup.jobs.records()
    wait_until(lambda: nats_server.stream_msgs() == 0, what="the job acked")
    assert sup.stop() == 0


# ---------------------------------------------------------------- 2. handler exceptions: retry_backoff

RETRY_BACKOFF = (1.0, 6.0)
ACK_WAIT = 60.0


def test_a_failing_handler_is_naked_with_retry_backoff_by_delivery(nats_server, supervisor_factory):
    """A handler that raises is NAKed with a delay of retry_backoff[delivery - 1]: the server holds
    the job back at least that long. Upper bounds, generous ones: under the next delay (delivery d
    used its own entry, not d+1's) and far under AckWait (the NAK's redelivery, not an expiry's)."""
    sup = supervisor_factory(nats_server, workers={"count": 1, "retry_backoff": list(RETRY_BACKOFF)},
                             consumer={"ack_wait": ACK_WAIT, "max_deliver": 3})
    sup.wait_ready(1)
    publish(nats_server.url, count=1, data="fail")
    starts = wait_until(lambda: s if len(s := sup.jobs.started()) == 3 else None, timeout=45,
                        what="three deliveries of the failing job")
    assert [(r.seq, r.delivery) for r in starts] == [(1, 1), (1, 2), (1, 3)]
    gaps = [b.t - a.t for a, b in zip(starts, starts[1:])]
    bounds = [(RETRY_BACKOFF[0], RETRY_BACKOFF[1]), (RETRY_BACKOFF[1], ACK_WAIT / 2)]
    assert all(lo <= gap < hi for gap, (lo, hi) in zip(gaps, bounds)), \
        f"gaps between deliveries {gaps}, expected within {bounds} (retry_backoff {RETRY_BACKOFF})"
    assert sup.stop() == 0


# ---------------------------------------------------------------- 3. double_ack: the ack is a request

class AckTap:
    """A plain core-NATS subscriber on $JS.ACK.> in a thread of its own: it sees every ack, NAK
    and +WPI anyone publishes, with the reply subject it carries."""

    def __init__(self, url: str):
        self.url = url
        self.seen: list[tuple[str, str, bytes]] = []      # (subject, reply, payload)
        self.ready = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self.main(),), daemon=True)
        self.stop_now: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def main(self) -> None:
        self.loop, self.stop_now = asyncio.get_running_loop(), asyncio.Event()
        nc = await nats.connect(self.url)
        try:
            async def got(msg):
                self.seen.append((msg.subject, msg.reply, msg.data))
            await nc.subscribe("$JS.ACK.>", cb=got)
            await nc.flush()                     # the server has the subscription before we publish
            self.ready.set()
            await self.stop_now.wait()
        finally:
            await nc.close()

    def __enter__(self) -> AckTap:
        self.thread.start()
        assert self.ready.wait(30), "the $JS.ACK.> tap did not subscribe"
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.stop_now.set)
        self.thread.join(30)

    def acks(self) -> list[tuple[str, str, bytes]]:
        return [m for m in list(self.seen) if m[2] == b"+ACK"]


@pytest.mark.parametrize("double_ack", [True, False])
def test_double_ack_sends_each_ack_as_a_request(nats_server, supervisor_factory, double_ack):
    """With workers.double_ack every +ACK carries a reply inbox (nats-py's ack_sync: the server
    answers once the ack is stored and the worker waits for that); without it, none does."""
    sup = supervisor_factory(nats_server, workers={"count": 2, "double_ack": double_ack})
    sup.wait_ready(2)
    with AckTap(nats_server.url) as tap:
        publish(nats_server.url, count=5, data="0.05")
        wait_until(lambda: len(tap.acks()) >= 5 and nats_server.stream_msgs() == 0, what="five jobs acked")
        acks = tap.acks()
    assert len(acks) == 5, acks
    replies = [reply for _, reply, _ in acks]
    if double_ack:
        assert all(replies), f"an ack without a reply subject (not a request): {acks}"
    else:
        assert not any(replies), f"an ack sent as a request with double_ack off: {acks}"
    assert sup.stop() == 0
