"""A worker's way out: stop pulling, give back what it will not run, let running jobs finish
within graceful_timeout, and NAK what still runs after it.

RETIRING runs what the worker already holds, but gives back at once what is parked for its
key's turn ([ordering]: it may start too late to finish); STOPPING NAKs what has not started (with a delay:
SHUTDOWN_NAK_DELAY) and takes the worker's start_lock to switch, so no handler thread starts a
job behind the shutdown's back (workers/runtime/threads.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Protocol

from workers import Job, Retry
from workers.middleware.chain import Chain
from workers.protocol import slots
from workers.protocol.modes import STOPPING
from workers.protocol.slots import SlotTable
from workers.runtime.puller import PULL_EXPIRES, PULL_MARGIN, Puller
from workers.runtime.settle import Settler, nak_payload
from workers.runtime.threads import HandlerThreads

log = logging.getLogger("worker")

# A shutdown NAKs what it had not started with this delay: every worker of the supervisor is
# stopping too, and one whose pull request is still live would take the job only to NAK it
# again, spending another of consumer.max_deliver. By then every such request has ended.
SHUTDOWN_NAK_DELAY = PULL_EXPIRES + PULL_MARGIN


class ShutdownHost(Protocol):
    """What the shutdown path needs of the worker that owns it (workers/runtime/worker.py Worker)."""
    mode: str
    grace: float                           # graceful_timeout, shorter once the parent is gone
    queue: deque[tuple[Any, int, Job]]
    running: int
    runners: list[asyncio.Task]
    chain: Chain                           # the middleware every job runs through
    table: SlotTable
    sub: Any                               # the subscription our pull requests' messages come to
    changed: asyncio.Event                 # something the wind-down waits for has happened
    pulls: Puller
    settler: Settler
    threads: HandlerThreads

    def set_mode(self, mode: str) -> None: ...
    def parked(self) -> int: ...           # jobs waiting for their limits (workers/middleware/limits.py)
    def take_parked(self) -> list[tuple[Any, int, Job]]: ...
    def take_key_parked(self) -> list[tuple[Any, int, Job]]: ...   # [ordering]'s parked jobs alone
    def release_limits(self, job: Job) -> None: ...


class Shutdown:
    def __init__(self, owner: ShutdownHost, slot: int):
        self.owner = owner
        self.slot = slot
        self.deadline = 0.0              # graceful_timeout from the start of wind_down

    async def wind_down(self) -> None:
        """Stop pulling. Run (RETIRING) or NAK (STOPPING) what was pulled but not started; let
        running jobs finish within graceful_timeout and NAK what still runs after it. Keep the
        subscription until every pull request we sent has ended (filled, 408 on expiry, 409, or
        given up as the puller gives a lost one up: Puller.expire_lost_pull), within
        graceful_timeout: no interest may be dropped while a request is live. An UNSUB, however
        well fenced, races the server itself: a message it has just assigned to our request is
        routed after the UNSUB to nobody, and waits for AckWait (and nats-py's drain() even
        removes the subscription before the server reads the UNSUB). Not the clock's end of a
        request either: across a stall of the link or the server, what the server filled into
        a request comes after it (F7); we exit cleanly, so nothing would NAK it. The settler
        then fences every ack, waiting for NATS until `deadline` (Settler.fence_the_rest)."""
        w = self.owner
        w.table.set_state(slots.DRAINING)
        self.deadline = time.monotonic() + w.grace
        while True:
            # Cleared before anything here awaits: what happens meanwhile (a message that arrives
            # while the NAKs below go out, a job's end, a key's turn, a limit granted, a 408, the
            # credits given up) sets it, and the wait below must see that, not sleep to the
            # deadline with a job in hand or the credits already accounted for.
            w.changed.clear()
            if w.mode == STOPPING:
                await self.nak_queued()
            else:
                await self.give_back_parked()
            now, deadline = time.monotonic(), self.deadline     # hurry() may bring it forward
            busy = bool(w.running or w.queue or w.parked())
            if busy and now >= deadline:
                await self.abandon()
                busy = False
            if not busy and (w.pulls.credits <= 0 or now >= deadline):
                break
            try:
                await asyncio.wait_for(w.changed.wait(), max(0.001, deadline - now))
            except TimeoutError:
                pass
        self.give_up_requests()
        try:
            await w.sub.unsubscribe()
        except Exception as exc:         # closed: nothing more can reach us anyway
            log.debug("worker %d: unsubscribe: %s", self.slot, exc)

    def give_up_requests(self) -> None:
        """Stop listening for our pull requests. One still live when the deadline came (its
        end or 408 held up by a stall of the link or the server, F20) may be filled after we
        stop listening, and what the server sent then is read by nobody: its credits stay in
        the table, so the parent runs the in-transit check at our exit as after a death."""
        w = self.owner
        live = w.pulls.credits
        if live > 0:
            log.warning("worker %d: graceful_timeout (%gs) ran out with a pull request for %d message(s) still "
                        "live; giving it up (what it brings is the supervisor's in-transit check's to NAK, "
                        "or comes back after AckWait)",
                        self.slot, w.grace, live, extra={"event": "pull_request_given_up", "slot": self.slot,
                                                         "credits": live})
        w.pulls.forget(left_live=live > 0)

    def hurry(self, until: float) -> None:
        """The supervisor is gone: a wind-down under way ends by `until` (running jobs, then the
        fence of what was settled), however much of graceful_timeout it had left."""
        if not self.deadline:
            return                       # not under way: it starts from the orphan's grace
        self.deadline = min(self.deadline, until)
        self.owner.settler.hurry(until)
        self.owner.changed.set()

    async def nak_queued(self) -> None:
        """NAK what was pulled and not started: the queue, and what the handler threads have not
        taken yet (in STOPPING they take nothing more: start_lock). The latter went through the
        chain's loop-side hooks (Chain.enter): their after_job hooks hear of the NAK first (the
        [idempotency] guard releases their leases, for their redelivery)."""
        w = self.owner
        admitted = w.threads.take_unstarted()
        w.running -= len(admitted)
        if admitted and w.chain.outer:
            chain, given_back = w.chain, Retry(SHUTDOWN_NAK_DELAY, reason="not started before shutdown")
            await asyncio.gather(*(chain.leave(job, chain.outer, given_back) for _, _, job in admitted))
        admitted.extend(w.queue)
        w.queue.clear()
        admitted.extend(w.take_parked())          # still waiting for their limits
        for _, i, job in admitted:
            await self.nak_unstarted_job(i, job)

    async def give_back_parked(self) -> None:
        """A retirement gives back, at once, what waits for its key's turn ([ordering]): started
        late, such a job could not finish within the grace, and its redelivery would run beside it
        (F16, seed 702: a parked job started 70 ms before graceful_timeout ran out). No delay:
        only this worker is leaving, the others take it now. (A job waiting for a limit keeps
        waiting here: giving it back would spend a delivery attempt a wait must not.)"""
        w = self.owner
        for _, i, job in w.take_key_parked():
            await w.settler.settle(i, job, b"-NAK", "nak", "waiting for its turn when its worker retired")

    async def nak_unstarted_job(self, i: int, job: Job) -> None:
        """A shutdown gives back a job it never started, with a delay (SHUTDOWN_NAK_DELAY), and
        the limits it held for it."""
        self.owner.release_limits(job)
        await self.owner.settler.settle(i, job, nak_payload(SHUTDOWN_NAK_DELAY), "nak", "not started before shutdown")

    async def abandon(self) -> None:
        """graceful_timeout ran out: NAK what still runs (its handler's outcome will never be
        sent: the runners are cancelled first, so no late ack can hit the job's next delivery)."""
        w = self.owner
        w.set_mode(STOPPING)
        await self.nak_queued()
        for task in w.runners:
            task.cancel()
        await asyncio.gather(*w.runners, return_exceptions=True)
        for entry in w.table.snapshot():         # HELD here: taken by a runner, not started yet
            if entry.state in (slots.HELD, slots.RUNNING):
                log.warning("worker %d: job seq=%d still %s after graceful_timeout (%gs); NAKing it",
                            self.slot, entry.stream_seq,
                            "running" if entry.state == slots.RUNNING else "waiting to start", w.grace,
                            extra={"event": "graceful_timeout_nak", "slot": self.slot, "seq": entry.stream_seq,
                                   "delivery": entry.delivery})
                job = Job(data=b"", subject="", headers={}, stream_seq=entry.stream_seq,
                          consumer_seq=entry.consumer_seq, delivery=entry.delivery)
                await w.settler.settle(entry.index, job, b"-NAK", "nak", "still running when graceful_timeout ran out")
        w.running = 0
