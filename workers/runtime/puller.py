"""Asking for work: a worker's pull requests and the credits they carry.

The puller issues raw pull requests to $JS.API.CONSUMER.MSG.NEXT (not js.fetch, see docs/DESIGN.md)
and counts credits (messages asked for and not yet received or expired), so the worker never has
more messages on the way than it can start now plus a prefetch sized from the measured job time
and pull round trip (workers/runtime/pulls.py, the pure policy; this is its mechanism).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Protocol

from nats.js.api import Header

from workers.protocol.modes import SERVING
from workers.protocol.slots import SlotTable
from workers.runtime.pulls import PullSizer
from workers.runtime.settle import REFUSED

log = logging.getLogger("worker")

# A pull request lives this long: an idle worker renews it this often. A stopping or retiring
# worker keeps its subscription until its last request has ended (shutdown.py), and nats-server
# 2.15 cannot end one early: its waiting queue ends a request filled, at its expiry (a 408 with the
# unfilled count) or, silently, once its reply subject has no interest; a later request from the
# same inbox, no_wait or not, replaces nothing. Dropping interest is safe only where the server
# routes the delivery itself (one it routes to a closed subscription goes back to the consumer at
# once: consumer.go didNotDeliver), not across a route, a leaf node or a gateway, and never once
# nats-py has dropped its side. So an idle drain waits out what is left of its last request, half
# of this on average (docs/RELIABILITY.md, "An idle drain"). 0.5 s, from 1 s: an idle stop or
# retirement ends a quarter second sooner, for 2 requests a second from an idle worker (its
# liveness PINGs are 4); a test that catches a request live still has time to act on it.
PULL_EXPIRES = 0.5
PULL_MARGIN = 1.0           # past a request's local expiry, before its credits are given up (the server's
                            # clock starts when the request arrives; one round trip at most)
STALL = 0.5                 # a liveness round trip this much longer than the link's quickest lately: the
                            # server or the link may have stopped meanwhile (expire_lost_pull)
RTTS_KEPT = 16              # liveness round trips remembered for that (4 s of them)


class PullHost(Protocol):
    """What pulling needs of the worker that owns it (workers/runtime/worker.py Worker)."""
    nc: Any                                # the worker's connection, made once the worker runs
    table: SlotTable
    mode: str
    wake_pull: asyncio.Event               # room for more: pull now
    changed: asyncio.Event                 # wind_down waits on it

    def outstanding(self) -> int: ...      # queued and running jobs
    def busy(self) -> int: ...             # jobs that take a handler (queued, running, ...)
    def waiting(self) -> int: ...          # received jobs parked for their key's turn ([ordering])
    def limit_state(self) -> tuple[int, bool]: ...   # jobs parked for a full limit; one held for its turn


class Puller:
    def __init__(self, owner: PullHost, slot: int, sizer: PullSizer, job_limit: int, next_subject: str):
        self.owner = owner
        self.slot = slot
        self.sizer = sizer
        self.job_limit = job_limit
        self.next_subject = next_subject
        self.inbox = ""                  # where our requests' messages come: set once connected
        self.credits = 0                 # messages asked for and not yet received or expired
        self.pull_deadline = 0.0         # when the last outstanding pull request expires
        self.last_sent = 0.0             # when the last one was sent ...
        self.read_by: float | None = None    # ... and by when the server had surely read it (server_read)
        self.pull_sent = 0.0             # when a request left alone towards a backlog (its round trip)
        self.received = 0                # messages received, ever (max_jobs caps what we ask for) ...
        self.given_back = 0              # ... less those settled without running (see not_started)
        self.last_refusal = ("", 0.0)
        self.unasked = 0                 # messages that came with no credit to account for them ...
        self.unasked_said = 0.0          # ... and when we last said so
        self.unsent = False              # nats-py refused our last pull request
        self.rtts: deque[float] = deque(maxlen=RTTS_KEPT)   # recent liveness round trips ...
        self.stalled = False             # ... the last one was slow or unanswered ...
        self.resumed = 0.0               # ... and when the first quick one after such came back

    async def run(self) -> None:
        """Pull while the worker is SERVING."""
        w = self.owner
        while w.mode == SERVING:
            n = self.pull_size()
            if n > 0 and await self.request(n):
                continue
            w.wake_pull.clear()       # a reconnect, a free entry or a finished job wakes us
            try:
                await asyncio.wait_for(w.wake_pull.wait(), PULL_EXPIRES)
            except TimeoutError:
                pass

    async def request(self, n: int) -> bool:
        """Ask for `n` messages; False when not connected, or when nats-py refused the request
        (REFUSED: reconnecting with its buffer full): nothing is on its way, and the next try
        waits for a wake-up (a reconnect is one)."""
        w = self.owner
        if not w.nc.is_connected:
            # nats-py would buffer it and send it after the reconnect, one more live request every
            # round of the outage while its credits had expired: more messages than we asked for,
            # NAKed as "table full" (a delivery spent each), credits too low at a death (R8).
            return False
        now = time.monotonic()
        # Nothing else on its way and a backlog to serve it at once: its first message
        # times a round trip (a request the server holds until a publish times nothing).
        self.pull_sent = now if not self.credits and self.sizer.pending_run else 0.0
        credits, deadline, sent, read_by = self.credits, self.pull_deadline, self.last_sent, self.read_by
        self.credits += n
        w.table.set_credits(self.credits)
        self.pull_deadline = now + PULL_EXPIRES
        self.last_sent, self.read_by = now, None
        body = b'{"batch":%d,"expires":%d}' % (n, int(PULL_EXPIRES * 1e9))
        try:
            await w.nc.publish(self.next_subject, body, reply=self.inbox)
        except REFUSED as exc:
            self.credits, self.pull_deadline, self.last_sent, self.read_by = credits, deadline, sent, read_by
            w.table.set_credits(credits)
            if not self.unsent:          # once per outage: it is retried every PULL_EXPIRES
                log.info("worker %d: pull request not sent (%s); asking again once NATS takes it", self.slot,
                         type(exc).__name__, extra={"event": "pull_unsent", "error": type(exc).__name__})
            self.unsent = True
            return False
        self.unsent = False
        return True

    def reconnected(self, now: float) -> None:
        """A new connection. A request of the old one may still deliver on it: one nats-py had
        not written yet goes out now, and one the server still holds finds our inbox subscribed
        again. So its credits stay, live for PULL_EXPIRES from now at most (the server's clock
        starts when it reads the request); expire_lost_pull frees them after, if nothing came.
        Forgetting them let both the old request and a fresh one deliver (R8)."""
        if self.credits > 0:
            self.pull_deadline = max(self.pull_deadline, now + PULL_EXPIRES)
            # A ping on the new connection proves nothing about what the old one carried; the
            # first one answered from now on starts the clock as the reconnect did (R8).
            self.last_sent, self.read_by = now, None
        self.rtts.clear()                # another server, maybe: another round trip (stalls are told by it)

    def answered(self, ping_sent: float, now: float) -> None:
        """The worker's liveness PING sent at `ping_sent` was answered by `now` (Worker.liveness):
        the server read our requests sent before it; a slow answer is a stall; a quick one may
        prove our requests over (expire_lost_pull)."""
        self.server_read(ping_sent, now)
        rtt = now - ping_sent
        quickest = min(self.rtts, default=rtt)
        self.rtts.append(rtt)
        if rtt > quickest + STALL:
            self.stalled = True
            return
        if self.stalled:
            self.stalled, self.resumed = False, now
        self.expire_lost_pull(ping_sent)

    def unanswered(self) -> None:
        """A liveness PING went unanswered within its timeout: a stall of the server or the link."""
        self.stalled = True

    def server_read(self, ping_sent: float, now: float) -> None:
        """A PING sent at `ping_sent` was answered by `now`: the server had read everything we sent
        before it on this connection, our last pull request included if it went out before."""
        if self.read_by is None and self.credits > 0 and ping_sent >= self.last_sent:
            self.read_by = now

    def forget(self, left_live: bool = False) -> None:
        """No request of ours is live any more (a new connection, or the worker is done pulling).
        `left_live`: the worker gives up requests that may still be filled (its wind-down's
        deadline came first, F20): their credits stay in the table, for the parent to take the
        exit as a loss of what may be on the wire (supervisor/parent/crew.py reap_one)."""
        self.credits = 0
        if not left_live:
            self.owner.table.set_credits(0)
        self.owner.changed.set()         # a stopping worker waits for it (shutdown.py)

    def requests_end(self) -> float:
        """When every pull request we sent has ended by the clock (0 when none is outstanding):
        PULL_EXPIRES after the server read the last one, and it cannot have read it before we sent
        it. Only where the server ran all along: see expire_lost_pull."""
        if self.credits <= 0:
            return 0.0
        end = self.pull_deadline + PULL_MARGIN
        return end if self.read_by is None else max(end, self.read_by + PULL_EXPIRES + PULL_MARGIN)

    def expire_lost_pull(self, ping_sent: float) -> None:
        """A pull request the server forgot (restart, leader change) must not hold credits forever:
        given up on the quick answer to a PING sent `ping_sent` (only `answered` calls it), once that is past the requests'
        end, the server having surely read the last (F7), and past the last stall's end by a
        request's life. A request ends with its last message or a 408 with its unfilled count
        (filled or not, the server sends nothing for it after that), and both come before the
        answer to a PING the server reads after, give or take its internal queues (PULL_MARGIN).
        Not so across a stall (F7's second form): the server, stopped, sends a request's 408, or
        what it had filled into it, only once it runs again, and reads a request still in its
        queues only then (living PULL_EXPIRES from there); a link stalled holds them as long. Given
        up meanwhile, a request's 408 took its unfilled count again from the requests asked after
        it, and its messages came unasked: our credits said less than was on our wire, and a
        death left the rest to AckWait (supervisor/parent/safety/in_transit.py). So the credits
        stay (and no more is asked) while the server or the link does not answer quickly."""
        if self.credits > 0 and self.read_by is not None \
                and ping_sent > max(self.requests_end(), self.resumed + PULL_EXPIRES + PULL_MARGIN):
            self.forget()
            self.owner.wake_pull.set()

    def pull_size(self) -> int:
        now, table = time.monotonic(), self.owner.table
        table.share_spread(*self.sizer.shared(now))        # the fleet's spread, through the parent
        self.sizer.fleet_residual, self.sizer.fleet_seen = table.fleet_spread()
        outstanding = self.owner.outstanding() + self.credits
        # A worker due for recycling takes no job it will not run: what it may still start is the
        # limit less what it started or still may (received, not given back) and what is on its way.
        # Jobs parked for their key's turn count once they start: a worker whose budget they took
        # would stop pulling, and the job their key waits for may need a pull to come back.
        taken = self.received - self.given_back - self.owner.waiting()
        jobs_left = self.job_limit - taken - self.credits if self.job_limit else None
        limit_waiting, held = self.owner.limit_state()    # [limits]: parked for a full limit (pulls.py)
        if self.sizer.lookahead:
            n = self.sizer.ordered_size(now, self.owner.busy(), self.owner.waiting(), self.credits,
                                        table.free_entries(), jobs_left, limit_waiting, held)
        else:
            n = self.sizer.size(now, outstanding, self.credits, table.free_entries(), jobs_left, limit_waiting, held)
        if n == 0 and not self.credits and self.owner.waiting():
            # [ordering]: a handler idle beside parked jobs always has a request out, whatever the
            # look ahead holds: the job their key waits for may be one only a pull brings back (a
            # NAKed retry, a dead worker's job after AckWait). Parking stays bounded by the
            # consumer's max_ack_pending, which the table has room for.
            n = min(self.sizer.concurrency - self.owner.busy(), table.free_entries(),
                    self.sizer.ceiling if jobs_left is None else jobs_left)
        return max(n, 0)

    def not_started(self, n: int = 1) -> None:
        """A message received and settled without running: its handler was never called because a
        middleware hook decided first (a duplicate acked by the [idempotency] guard, a job it NAKed
        as busy or unguardable, any before_job's Retry / Reject / failure: Worker.finish), or a
        NAK because the table was full. It must not
        count towards max_jobs: the worker would stop pulling short of its limit, never start
        its last job, so never be recycled, and hold its slot doing nothing for good (R1)."""
        if n > 0:
            self.given_back += n
            self.owner.wake_pull.set()

    def arrived(self, pending: int, now: float) -> None:
        """A message came for a request at `now` (already held in the table: see
        Worker.on_message); `pending`: how many more the stream held for the consumer then."""
        self.received += 1
        if self.credits > 0:
            self.credits -= 1
            self.owner.table.set_credits(self.credits)
            if not self.credits:
                self.owner.changed.set()     # a stopping worker waits for it (shutdown.py)
        else:
            self.came_unasked()
        self.timed(pending, now)

    def came_unasked(self) -> None:
        """A message no credit accounts for: a request we gave up for lost was live after all (a
        round trip longer than PULL_MARGIN, a request replayed after a reconnect). The parent
        then under-counts what may be on the wire to us at a death. Said once a minute."""
        self.unasked += 1
        now = time.monotonic()
        if now - self.unasked_said > 60:
            self.unasked_said = now
            log.info("worker %d: a message came that none of its pull requests accounted for (%d so far)",
                     self.slot, self.unasked, extra={"event": "pull_unasked", "slot": self.slot, "count": self.unasked})

    def timed(self, pending: int, now: float) -> None:
        """Feed pull sizing: a message arrived (idleness); whether more are pending; the round
        trip of a request sent alone while they were."""
        self.sizer.message(now, pending)
        if self.pull_sent:
            self.sizer.round_trip(now - self.pull_sent)
            self.pull_sent = 0.0

    def on_status(self, headers: dict[str, str]) -> None:
        """A status message on our inbox (its headers): a request that ended unfilled, or refused."""
        status = headers.get("Status")
        if status in ("408", "409"):
            unfilled = int(headers.get("Nats-Pending-Messages", "0") or 0)
            self.credits = max(0, self.credits - unfilled)
            self.owner.table.set_credits(self.credits)
            if status == "409":
                self.refused(headers.get(Header.DESCRIPTION, "409"))
        self.owner.wake_pull.set()
        self.owner.changed.set()

    def refused(self, why: str) -> None:
        """409 (consumer deleted, leadership change, max waiting): say so once a minute, not per pull."""
        now = time.monotonic()
        if why != self.last_refusal[0] or now - self.last_refusal[1] > 60:
            log.warning("worker %d: pull request refused: %s", self.slot, why)
            self.last_refusal = (why, now)

