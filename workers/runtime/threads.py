"""Sync handlers: `concurrency` handler threads of a worker's own, fed from its loop.

The threads take their next job from a locked queue themselves, run it through the worker's
middleware chain (workers/middleware/chain.py: its hooks run in the thread too) and hand outcomes back in
batches (one loop wake-up per batch): no trip through the event loop between two jobs, which is
what made CPU-bound jobs pay for GIL ping-pong. Acks are still published from the loop
(`finisher`, through the worker's `finish`).

The queue's lock is the worker's start_lock: the worker's switch to STOPPING takes it, so once a
shutdown has NAKed what runs, no handler thread can start another job behind its back.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any, Protocol

from workers import Job
from workers.middleware.chain import Chain, Ran
from workers.middleware.eager import gather_eagerly
from workers.protocol import slots
from workers.protocol.modes import SERVING, STOPPING
from workers.protocol.slots import SlotTable
from workers.runtime.settle import Settler
from workers.runtime.solo import Gate

CONFIRM_AFTER = 0.1         # after a job this long a thread also waits for its ack's fence (a few ms at most) ...
CONFIRM_WAIT = 1.0          # ... but never longer than this (a fence that fails leaves the ack for the next one)
CONFIRM_POLL = 0.002
OUTCOME_EVERY = 0.02        # a busy handler thread hands outcomes back at most this often: each wake-up of
                            # the loop takes the GIL from a CPU-bound handler (a handful of context switches)

Chunk = list[tuple[Any, int, Job]]         # (message, table entry, job) as the worker pulled them


class ThreadsHost(Protocol):
    """What the handler threads need of the worker that owns them (workers/runtime/worker.py Worker)."""
    mode: str                              # read under start_lock; the worker writes it under it too
    running: int                           # jobs taken from the worker's queue and not finished
    chain: Chain                           # the handler inside the worker's middleware
    settler: Settler
    table: SlotTable
    changed: asyncio.Event
    wake_pull: asyncio.Event

    @property
    def gate(self) -> Gate: ...            # suspects run alone (workers/runtime/solo.py); used under start_lock

    def count_start(self) -> None: ...
    async def finish(self, i: int, job: Job, exc: BaseException | None, elapsed: float, started: bool = True
                     ) -> None: ...
    def finished(self, job: Job, exc: BaseException | None, elapsed: float, started: bool) -> None: ...


class HandlerThreads:
    def __init__(self, owner: ThreadsHost, start_lock: threading.Lock, concurrency: int, job_limit: int,
                 batching: float = OUTCOME_EVERY):
        self.owner = owner
        # How long an outcome may wait for others (0: each goes back at once; [ordering]: a job's
        # ack is what the next job of its key waits for).
        self.batching = batching
        self.concurrency = concurrency
        self.job_limit = job_limit
        # Jobs handed to the threads (guarded by start_lock), outcomes coming back, and whether
        # the loop has been rung for them since it last took them.
        self.handed = threading.Condition(start_lock)
        # Threads waiting for the loop to settle what they handed back wait on a condition of their
        # own (same lock): a hand-over's notify must reach an idle thread, not one of these.
        self.settled = threading.Condition(start_lock)
        self.ready: deque[tuple[Any, int, Job]] = deque()
        self.outcomes: list[tuple[int, Job, Ran]] = []
        self.outcomes_since = 0.0        # when the oldest outcome the loop has not been rung for came
        self.rung = False
        self.handed_back = self.settled_back = 0   # outcomes handed to the loop, and settled by it
        self.threads_stop = False
        self.wake_finish = asyncio.Event()
        self.busy = 0                    # jobs a handler thread runs now (guarded by start_lock)

    # -- on the loop

    async def hand_over(self, chunk: Chunk) -> None:
        """Pulled jobs go to the threads once the chain's outer, loop-side hooks let them (all the
        chunk's at once: Chain.enter); a job they stop is settled here, unrun. A shutdown that
        came meanwhile NAKs the rest from the threads' queue (wind_down wakes for that)."""
        w = self.owner
        chain = w.chain
        if any(chain.enters(job) for _, _, job in chunk):       # a chunk of first deliveries: mostly none
            entered = await gather_eagerly(chain.enter(job) for _, _, job in chunk)
            runnable = []
            for (msg, i, job), (k, exc) in zip(chunk, entered):
                if exc is None:
                    runnable.append((msg, i, job))
                    continue
                await w.finish(i, job, await chain.leave(job, k, exc), 0.0, started=False)
                w.running -= 1
            chunk = runnable
            w.changed.set()
            w.wake_pull.set()
        self.run_sync(chunk)

    def run_sync(self, chunk: Chunk) -> None:
        """Hand pulled jobs (already in the slot table) to the handler threads."""
        with self.handed:
            self.ready.extend(chunk)
            self.handed.notify(len(chunk))

    def take_unstarted(self) -> Chunk:
        """What the threads have not taken yet (in STOPPING they take nothing more: start_lock)."""
        with self.handed:
            admitted = list(self.ready)
            self.ready.clear()
        return admitted

    def start_threads(self, loop: asyncio.AbstractEventLoop) -> None:
        for k in range(self.concurrency):
            threading.Thread(target=self.handler_thread, args=(loop,), name=f"handler_{k}", daemon=True).start()

    def stop_threads(self) -> None:
        with self.handed:
            self.threads_stop = True
            self.handed.notify_all()
            self.settled.notify_all()

    def collect(self) -> None:
        """Take outcomes kept back by a handler thread busy with a long job (see hand_back)."""
        if self.outcomes:
            self.wake_finish.set()

    async def finisher(self) -> None:
        """Ack, NAK or TERM the outcomes the handler threads handed back, a batch per wake-up."""
        w = self.owner
        while True:
            await self.wake_finish.wait()
            self.wake_finish.clear()
            with self.handed:
                batch, self.outcomes, self.rung = self.outcomes, [], False
            try:
                chain = w.chain
                if chain.outer_after:    # the outer hooks of the whole batch at once (its done-markers)
                    outcomes = await gather_eagerly(chain.leave(job, chain.outer, ran.exc) for _, job, ran in batch)
                else:
                    outcomes = [ran.exc for _, _, ran in batch]
                acks = []                # the batch's plain acks go out together (Settler.ack_all)
                for (i, job, ran), exc in zip(batch, outcomes):
                    if exc is None:
                        w.finished(job, exc, ran.elapsed, ran.started)
                        acks.append((i, job))
                    else:
                        await w.finish(i, job, exc, ran.elapsed, ran.started)
                if acks:
                    await w.settler.ack_all(acks)
                w.running -= len(batch)
            finally:
                w.changed.set()
                w.wake_pull.set()
                with self.settled:       # handler threads waiting in await_settled() go on
                    self.settled_back += len(batch)
                    self.settled.notify_all()

    # -- in a handler thread

    def handler_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run jobs back to back while there are any: no trip through the loop between two."""
        def count_start() -> None:       # the parent starts our replacement while this job runs
            loop.call_soon_threadsafe(self.owner.count_start)

        on_start = count_start if self.job_limit else _nothing
        while (taken := self.next_job()) is not None:
            i, job = taken
            ran = self.owner.chain.run_sync(job, on_start)
            with self.handed:
                self.busy -= 1
            if not self.hand_back(loop, i, job, ran):
                return
            if ran.exc is not None and not isinstance(ran.exc, Exception):
                return                   # SystemExit & co: finish() exits the process
            if ran.elapsed >= OUTCOME_EVERY:
                self.await_settled(i if ran.elapsed >= CONFIRM_AFTER else None)

    def next_job(self) -> tuple[int, Job] | None:
        """In a handler thread: the next job, marked running before its handler starts (its entry
        is this thread's alone until the loop gets the outcome back); None once the worker closes.
        Nothing starts in STOPPING: the loop NAKs what is left."""
        with self.handed:
            while not self.threads_stop:
                # First come first served; a suspect at the front waits for the rest to finish.
                if self.ready and self.owner.mode != STOPPING and self.owner.gate.try_start(self.ready[0][2].stream_seq):
                    _, i, job = self.ready.popleft()
                    self.owner.table.start(i)  # several handler threads share the table's counters
                    self.busy += 1
                    return i, job
                self.handed.wait()
        return None

    def hand_back(self, loop: asyncio.AbstractEventLoop, i: int, job: Job, ran: Ran) -> bool:
        """Queue an outcome for the loop, and wake it only if no wake-up is on its way already and
        either this thread is about to wait (nothing ready, a shutdown, a crash) or its oldest
        outcome would be OUTCOME_EVERY old by the end of another job like this one: short jobs
        go back in batches, one loop wake-up each; long ones one by one. An outcome kept back
        behind an unexpectedly long job is collected by the worker's liveness() (collect())."""
        now = time.monotonic()
        with self.handed:
            if self.owner.gate.finished(job.stream_seq):
                self.handed.notify_all()     # a suspect's turn, or the end of one
            if not self.outcomes:
                self.outcomes_since = now
            self.outcomes.append((i, job, ran))
            self.handed_back += 1
            if self.rung:
                return True
            busy = bool(self.ready) and self.owner.mode == SERVING and isinstance(ran.exc, (Exception, type(None)))
            if busy and now + ran.elapsed - self.outcomes_since < self.batching:
                return True
            self.rung = True
        try:
            loop.call_soon_threadsafe(self.wake_finish.set)
        except RuntimeError:             # the loop is closed: the worker is exiting
            return False
        return True

    def await_settled(self, confirm: int | None) -> None:
        """In a handler thread, after a job of OUTCOME_EVERY or more: wait until the loop has
        acked (NAKed, TERMed) what this thread handed back, before the next job starts, as when
        every job went through the loop. A crash in the next job then finds this one's ack sent
        and its fence on the way, not still queued here (a few ms a job; short jobs never wait).
        After a job of CONFIRM_AFTER or more (entry `confirm`), wait for the fence too: a crash
        in the next job then leaves no ack in doubt behind it (the parent would NAK that job as
        held at the death; a no-op for an ack that arrived, but a job the crash did not touch),
        at the cost of one round trip per job that long."""
        with self.settled:
            mine = self.handed_back
            while self.settled_back < mine and not self.threads_stop and self.owner.mode != STOPPING:
                self.settled.wait()
            if confirm is None:
                return
            deadline = time.monotonic() + CONFIRM_WAIT
            while self.owner.table.state_of(confirm) in (slots.ACKED, slots.SETTLED) and not self.threads_stop \
                    and self.owner.mode != STOPPING and time.monotonic() < deadline:
                self.settled.wait(CONFIRM_POLL)


def _nothing() -> None:
    pass
