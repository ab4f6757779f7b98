"""Settling a worker's jobs: publish the ack, NAK or TERM, and keep each entry until a fence proves
the server has it.

nats-py's publish only queues bytes and flush() does not fence earlier publishes (docs/DESIGN.md), so
an acked entry stays ACKED in the slot table (the parent NAKs it if we die: a NAK after an ack is
a no-op) until `confirm` has fenced the connection it was sent on. Fences are coalesced: at most
one per SETTLE_MIN_INTERVAL, whatever the job rate.

A publish can also be refused: nats-py raises while it reconnects with its reconnect buffer full
(REFUSED). The job is done by then, so the entry is kept as if its ack had been sent on a dead
connection: `confirm` sends it after the reconnect, and if the worker exits first the parent NAKs
it. The parent is told either way (`unsent`), so if the job comes back its ledger explains the
rerun.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import nats.errors

from workers import Job
from workers.protocol import slots
from workers.protocol.events import Event, Settled, Unsent
from workers.protocol.slots import SlotTable

log = logging.getLogger("worker")

SETTLE_MIN_INTERVAL = 0.002  # coalesce ack-confirming flushes to at most one per this period
FENCE_RETRY = 1.0            # seconds after a failed fence before the next try
PINGS_WAIT = 2.0             # at most this long a NAK with a delay waits for the parent's +WPI round
PINGS_POLL = 0.005
# Slot-table counter per outcome; a duplicate is acked without running its handler ([idempotency]).
# "later": the ack of a job re-published for later (workers/runtime/later.py): an ack on the wire,
# a retry in the counters.
OUTCOME_COUNTERS = {"ack": slots.ACKED_N, "duplicate": slots.DUPLICATE_N, "nak": slots.NAKED_N,
                    "term": slots.TERMED_N, "later": slots.NAKED_N}
ACKS = ("ack", "duplicate", "later")
UNSENT = -1                  # the generation of a settle whose publish raised: no connection has it
# What nats-py raises for a publish it cannot take *now*: reconnecting with its reconnect buffer
# full. Anything else (a connection closed for good: credentials revoked, reconnects spent) ends
# the task and so the worker (Worker.essential): the parent NAKs its jobs and starts another.
REFUSED = (nats.errors.OutboundBufferLimitError,)


class SettleHost(Protocol):
    """What settling needs of the worker that owns it (workers/runtime/worker.py Worker)."""
    nc: Any                                # the worker's connection, made once the worker runs
    table: SlotTable
    wake_pull: asyncio.Event               # a released entry can take another message

    def emit(self, event: Event) -> None: ...
    async def before_nak(self, job: Job, reason: str, delay: float, held_at: float) -> bool: ...   # orphan.py


class Settler:
    def __init__(self, owner: SettleHost, slot: int, double_ack: bool, entries: int,
                 acked: Callable[[Sequence[tuple[int, str]]], None] = lambda sent: None):
        self.owner = owner
        self.acked = acked                         # (seq, reply) of the plain acks sent: reack.py
        # (entry, job, outcome) of every settle once it is on the wire ([ordering] says so to the
        # workers waiting for the job's key: workers/runtime/ordering.py)
        self.on_settled: Callable[[int, Job, str], None] = lambda i, job, outcome: None
        self.slot = slot
        self.double_ack = double_ack
        self.replies: list[str] = [""] * entries   # reply subject by entry index
        # ACKED/SETTLED entries awaiting a fence: (entry, connection generation, was an ack)
        self.unconfirmed: list[tuple[int, int, bool]] = []
        self.closing = False
        self.close_by = 0.0                        # set by close(): the shutdown's deadline
        self.retry: asyncio.TimerHandle | None = None   # the pending fence retry after a failure
        self.wake_settle = asyncio.Event()
        self.pings_stuck_until = 0.0               # a wait for the parent's +WPI round timed out: none till then

    async def ack(self, i: int, job: Job, outcome: str = "ack") -> None:
        w = self.owner
        if self.double_ack:
            try:
                await w.nc.request(self.replies[i], b"+ACK", timeout=5.0)
            except Exception as exc:
                log.warning("worker %d: double ack of seq=%d not confirmed: %s", self.slot, job.stream_seq, exc)
            else:
                w.table.count(OUTCOME_COUNTERS[outcome])
                self.report(job, outcome, "")
                w.table.release(i)
                self.on_settled(i, job, outcome)
                return
        await self.settle(i, job, b"+ACK", outcome, "")

    async def settle(self, i: int, job: Job, payload: bytes, outcome: str, reason: str) -> None:
        """Publish the ack/nak/term and keep the entry until a flush confirms it."""
        w = self.owner
        if outcome == "nak" and not await w.before_nak(job, reason, nak_delay(payload), w.table.held_at(i)):
            w.table.release(i)           # an orphan's job the fleet released: its next holder settles it
            return
        naking = outcome == "nak"
        try:
            if naking:                   # counted in NAKING from here to the finally (slots.PINGS_BEGUN)
                payload = await self.clear_of_pings(payload)
            sent, held_at = time.monotonic(), w.table.held_at(i)
            generation, refused = await self.publish(i, payload)
            # A NAK that went out says when, with what delay, and since when it was held (events.Settled).
            self.sent(i, job, outcome, reason, generation, refused,
                      *((sent, nak_delay(payload), held_at) if naking and not refused else ()))
        finally:
            if naking:
                w.table.naking(-1)       # after the entry is SETTLED: the parent's next round skips it anyway
        self.wake_settle.set()
        self.on_settled(i, job, outcome)

    async def clear_of_pings(self, payload: bytes) -> bytes:
        """The NAK to send, once no +WPI of the parent can land after it (a +WPI after a NAK with
        a delay makes the server wait a whole AckWait: slots.PINGS_BEGUN). Every NAK is counted in
        NAKING, so that the parent pings none of this worker's jobs meanwhile: a +WPI for this
        delivery landing after a plain NAK would act on the next delivery, perhaps another
        worker's NAK with a delay. Only a NAK with a delay waits: until the round the parent
        began before it saw this NAK coming is proved read, or the whole delay (then a plain NAK,
        which no +WPI can stretch), or PINGS_WAIT (the parent's link is in trouble: the NAK goes
        with what is left of its delay, and no NAK waits for PINGS_WAIT after that)."""
        table = self.owner.table
        round_ = table.naking(1)
        delay = nak_delay(payload)
        start = time.monotonic()
        if round_ is None or delay <= 0 or start < self.pings_stuck_until:
            return payload
        until = start + min(delay, PINGS_WAIT)
        while not table.pings_fenced(round_) and time.monotonic() < until:
            await asyncio.sleep(PINGS_POLL)
        now = time.monotonic()
        if not table.pings_fenced(round_):
            self.pings_stuck_until = now + PINGS_WAIT
            log.warning("worker %d: the parent's +WPI round was not proved read within %.1fs; NAKs with a delay "
                        "do not wait for it for %gs", self.slot, now - start, PINGS_WAIT,
                        extra={"event": "pings_unfenced"})
        return nak_payload(delay - (now - start))

    async def ack_all(self, done: Sequence[tuple[int, Job]]) -> None:
        """Plain acks of many jobs (a handler thread's batch of outcomes): one command for all of
        them in the client's write buffer (Client.publish_each, supervisor/nats/fix.py), then
        each entry as settle() leaves it: ACKED until a fence proves the server read them all."""
        if self.double_ack or len(done) == 1:
            for i, job in done:
                await self.ack(i, job)
            return
        w, replies = self.owner, self.replies
        try:
            await w.nc.publish_each([replies[i] for i, _ in done], b"+ACK")
        except REFUSED as exc:
            generation, refused = UNSENT, type(exc).__name__
        else:
            generation, refused = w.nc.stats["reconnects"], ""
        # What sent() does for each, in one pass: the acks into reack.py's window together, the
        # counter once.
        self.acked([(job.stream_seq, replies[i]) for i, job in done])
        mark = w.table.mark
        for i, job in done:
            mark(i, slots.ACKED)
            if job.delivery > 1:
                self.report(job, "ack", "")
            if refused:
                self.unsent(job, "ack", refused)
        w.table.count(slots.ACKED_N, len(done))
        self.unconfirmed.extend([(i, generation, True) for i, _ in done])
        self.wake_settle.set()
        for i, job in done:
            self.on_settled(i, job, "ack")

    async def publish(self, i: int, payload: bytes) -> tuple[int, str]:
        """Send a settle: (the connection generation it went out on, ""), or (UNSENT, the error)
        when nats-py refused it."""
        nc = self.owner.nc
        try:
            await nc.publish(self.replies[i], payload)
        except REFUSED as exc:
            return UNSENT, type(exc).__name__
        return nc.stats["reconnects"], ""

    def sent(self, i: int, job: Job, outcome: str, reason: str, generation: int, refused: str, *times: float) -> None:
        """A settle published (or refused: `refused` names why) on connection `generation`: the
        entry is ACKED or SETTLED until a fence confirms it (confirm)."""
        w = self.owner
        if outcome in ACKS:
            self.acked([(job.stream_seq, self.replies[i])])    # a leader change may lose it after the fence
        w.table.mark(i, slots.ACKED if outcome in ACKS else slots.SETTLED)
        w.table.count(OUTCOME_COUNTERS[outcome])
        self.report(job, outcome, reason, *times)
        if refused:
            self.unsent(job, outcome, refused)
        self.unconfirmed.append((i, generation, outcome in ACKS))

    def unsent(self, job: Job, outcome: str, error: str) -> None:
        """An ack is sent again once a fence works; a NAK or TERM is not (see confirm). Either way
        the job may come back, after AckWait: the parent is told, so its ledger explains that."""
        log.warning("worker %d: %s of seq=%d not sent (%s); %s", self.slot, outcome, job.stream_seq, error,
                    "sent again once NATS is back" if outcome in ACKS else "the job comes back after AckWait",
                    extra={"event": "settle_unsent", "seq": job.stream_seq, "outcome": outcome, "error": error})
        self.owner.emit(Unsent(job.stream_seq, job.delivery, outcome, error))

    def report(self, job: Job, outcome: str, reason: str, *times: float) -> None:
        # Only what explains a future redelivery (or follows one) goes to the parent: acks of
        # first deliveries, the hot path, stay in the table counters.
        if outcome != "ack" or job.delivery > 1:
            if outcome == "duplicate":   # the parent's ledger knows acks, naks and terms
                outcome, reason = "ack", "duplicate: already done"
            elif outcome == "later":
                outcome = "ack"
            self.owner.emit(Settled(job.stream_seq, job.delivery, outcome, reason, *times))

    async def run(self) -> None:
        while not self.closing:
            await self.wake_settle.wait()
            self.wake_settle.clear()
            await self.confirm()
            if not self.closing:
                await asyncio.sleep(SETTLE_MIN_INTERVAL)
        await self.fence_the_rest()

    def close(self, until: float) -> None:
        """run() fences what is left, waiting for NATS until `until` (the shutdown's deadline), and returns."""
        self.closing = True
        self.close_by = until
        self.wake_settle.set()

    def hurry(self, until: float) -> None:
        """Fence what is left by `until` at the latest (the supervisor is gone: workers/runtime/shutdown.py)."""
        if self.closing:
            self.close_by = min(self.close_by, until)
            self.wake_settle.set()

    async def fence_the_rest(self) -> None:
        """The way out. An entry left unconfirmed is NAKed by the parent when we exit, and if its
        ack never reached the server (the connection died, or nats-py refused it) the job runs
        again. So while NATS is away, wait for it (a reconnect wakes us; a failed fence retries
        after FENCE_RETRY) until the shutdown's deadline, the same graceful_timeout a running job
        gets: acks sent again after the reconnect are fenced by the next round."""
        waiting = False
        while self.unconfirmed:
            left = self.close_by - time.monotonic()
            if await self.confirm(timeout=min(5.0, max(0.5, left))):
                continue
            if left <= 0:
                break
            if not waiting:
                waiting = True
                log.warning("worker %d: stopping with %d settle(s) NATS has not confirmed; waiting up to %.1fs for it",
                            self.slot, len(self.unconfirmed), left,
                            extra={"event": "settle_waiting", "slot": self.slot, "unconfirmed": len(self.unconfirmed)})
            self.wake_settle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake_settle.wait(), max(0.0, self.close_by - time.monotonic()))

    def retry_now(self) -> None:
        self.retry = None
        self.wake_settle.set()

    async def confirm(self, timeout: float = 5.0) -> bool:
        """A fence (supervisor/nats/fix.py) proves the server has read every ack sent before it on
        the same connection. An ack sent on a connection that has died since is sent again (acking
        twice is harmless); a NAK or TERM is not, since by now it could hit another worker's
        delivery of the job: if it was lost, the job comes back after AckWait."""
        if not self.unconfirmed:
            return False
        w = self.owner
        batch, self.unconfirmed = self.unconfirmed, []
        try:
            await w.nc.fence(timeout=timeout)
        except Exception as exc:
            # While nats-py reconnects (nats_disconnected told that already) a fence fails every FENCE_RETRY.
            level = logging.DEBUG if isinstance(exc, nats.errors.ConnectionReconnectingError) else logging.WARNING
            log.log(level, "worker %d: fence failed (%s); acks stay unconfirmed", self.slot, str(exc) or type(exc).__name__)
            self.unconfirmed = batch + self.unconfirmed
            # A reconnect wakes us (Worker.reconnected); a fence that timed out on a live link must
            # not leave an idle worker's acks unconfirmed until its next job.
            if self.retry is None:       # one timer: each failure starting its own made retries multiply
                self.retry = asyncio.get_running_loop().call_later(FENCE_RETRY, self.retry_now)
            return False
        current = w.nc.stats["reconnects"]
        for i, generation, was_ack in batch:
            if generation != current and was_ack:
                self.unconfirmed.append((i, (await self.publish(i, b"+ACK"))[0], True))
            else:
                w.table.release(i)
        w.wake_pull.set()
        if self.unconfirmed:
            self.wake_settle.set()
        return True


def nak_payload(delay: float) -> bytes:
    if delay <= 0:
        return b"-NAK"
    return b'-NAK {"delay":%d}' % int(delay * 1e9)


def nak_delay(payload: bytes) -> float:
    """The delay nak_payload put in a NAK, in seconds."""
    _, _, body = payload.partition(b" ")
    return json.loads(body)["delay"] / 1e9 if body else 0.0

