"""Jobs pulled that wait for their whole-job limits ([limits.NAME] with `subjects`): which of them
try for their limits, and when. The limits themselves are taken in workers/middleware/limits.py;
the worker parks a job and admits it once it has them (workers/runtime/worker.py).

A job that needs limits it cannot have at once is parked: it stays in the slot table (HELD, kept
alive by the parent's +WPI) and takes no handler. Its limits are taken only for a job a handler
can start: the first `room` parked jobs try for them, where

    room = concurrency + look-ahead - jobs running or queued here

and the look-ahead is the jobs the handlers finish within one take's round trip to the bucket
(concurrency x that round trip / the job time; 0 before a job time is known, and about 0 for
slow jobs), so a take sent then has its slot as a handler frees for it. Before, a worker took a
slot (and a rate's start) for every job it had pulled: with a deep buffer hundreds of slots,
renewed every 2 s, and with a tight cap slots held for jobs queued behind its own handlers while
workers elsewhere, free, waited for them.

A parked job is
  - in line: not tried yet. It counts as a job the worker will run (pull sizing: `occupying`),
    and while one is not at its turn the worker asks for nothing more (`pull_state`: a refill
    would go before it, every time);
  - trying: a take under way that has not found the limit full; counted the same (most get
    their limits at once, and would find their handler given away);
  - waiting: a take found the limit full. It takes no handler (workers/runtime/pulls.py bounds
    how many a worker holds), so jobs that need no limit go on past it. Its take stays under way
    only while the room has place for it after the jobs in line, i.e. while a handler is free for
    it when the limit frees; otherwise it withdraws (checked before every take the gate sends:
    Gate.serve), and tries again once a handler frees (a take that finds the limit still full
    sends nothing: the gate knows it is full until a word says a slot was freed).
Jobs in line go before jobs that wait (they have not had their try), each kind in the order it
came. A job that comes while its limit is known full waits at once, without a try.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from workers import Job
from workers.protocol import slots

log = logging.getLogger("worker")


class GateView(Protocol):
    index: int

    def known_full(self) -> bool: ...


class ParkingHost(Protocol):
    """What parking needs of the limits middleware (workers/middleware/limits.py Limits)."""
    table: slots.SlotTable | None
    line: Callable[[], tuple[int, float | None]]    # the worker's: (jobs running or queued, job time)
    wake_pull: Callable[[], None]                   # the worker's: pull sizing changed

    def first_gate(self, job: Job) -> GateView: ...
    def take_now(self, job: Job) -> bool: ...          # its limits from this worker's spares, at once
    def hold(self, job: Job, on_wait: Callable[[GateView], None]) -> Awaitable[None]: ...
    def take_rtt(self) -> float: ...


@dataclass(eq=False)
class Parked:
    item: Any                              # the worker's queue entry for the job
    job: Job
    admitted: Callable[[Any], None]        # the worker's: the job has its limits
    task: asyncio.Task | None = None       # its take, while it tries
    waits: int | None = None               # the limit it is counted waiting for (its index), if any


def delivery_key(job: Job) -> int:
    """One delivery's key: its Job, made once per message received (see Limits.granted)."""
    return id(job)


class Parking:
    def __init__(self, host: ParkingHost, concurrency: int):
        self.host = host
        self.concurrency = concurrency
        self.inline: dict[int, Parked] = {}    # not refused yet, as they came; the first `trying` have a take
        self.trying = 0
        self.waiting: dict[int, Parked] = {}   # a take found their limit full, as they were refused
        self.nudged = False
        self.balancing = False

    def __len__(self) -> int:
        return len(self.inline) + len(self.waiting)

    # -- what the worker asks

    def occupying(self) -> int:
        """Parked jobs that count as jobs it will run (pull sizing): those not refused yet."""
        return len(self.inline)

    def pull_state(self) -> tuple[int, bool]:
        """(jobs waiting for a full limit, whether a job in line is not at its turn yet)."""
        return len(self.waiting), len(self.inline) > self.trying

    def may_take_now(self) -> bool:
        """A job that comes now may take its limits at once: none in line before it, and a handler
        free for it (a job that waits and holds a take is a gate waiter before it anyway)."""
        return not self.inline and self.room() > 0

    def room(self) -> int:
        running, job_time = self.host.line()
        ahead = int(self.concurrency * self.host.take_rtt() / job_time) if job_time else 0
        return self.concurrency + ahead - running

    # -- parking and admitting

    def park(self, item: Any, job: Job, admitted: Callable[[Any], None]) -> None:
        p = Parked(item, job, admitted)
        key = delivery_key(job)
        gate = self.host.first_gate(job)
        if gate.known_full():
            self.waiting[key] = p
            self.count(p, gate.index)
        else:
            self.inline[key] = p
        self.rebalance()

    def nudge(self) -> None:
        """The worker's room changed (its wake_pull was set): look again soon, outside whatever
        set it (a gate's loop over its waiters, say)."""
        if (self.inline or self.waiting) and not self.nudged:
            self.nudged = True
            asyncio.get_running_loop().call_soon(self.nudged_now)

    def nudged_now(self) -> None:
        self.nudged = False
        self.rebalance()

    def rebalance(self) -> None:
        """Give takes to the first `room` parked jobs (in line first, then waiting), withdraw those
        of waiting jobs past it. Jobs in line that try keep their takes."""
        if self.balancing or not (self.inline or self.waiting):
            return
        self.balancing = True
        try:
            room = self.room()
            for p in list(itertools.islice(self.inline.values(), self.trying, max(room, self.trying))):
                self.try_for(p)
            left = self.room() - len(self.inline)    # (a job admitted at once above is running now)
            for k, p in enumerate(list(self.waiting.values())):
                if k < left:
                    if p.task is None:
                        self.try_for(p)
                elif p.task is not None and not p.task.done():
                    p.task.cancel()              # Gate.take gives back a grant made as it was cancelled
                    p.task = None
        finally:
            self.balancing = False

    def try_for(self, p: Parked) -> None:
        if self.host.take_now(p.job):            # this worker's spare slots: no task, no request
            self.leave(p)
            p.admitted(p.item)
            return
        p.task = asyncio.ensure_future(self.host.hold(p.job, lambda gate: self.refused(p, gate)))
        if delivery_key(p.job) in self.inline:
            self.trying += 1
        p.task.add_done_callback(lambda t: self.tried(p, t))

    def refused(self, p: Parked, gate: GateView) -> None:
        """A take of `p` found its limit full: it waits, and takes no handler."""
        key = delivery_key(p.job)
        if self.inline.get(key) is p:
            del self.inline[key]
            self.trying -= 1
            self.waiting[key] = p
        elif self.waiting.get(key) is not p:
            return                               # taken back by a drain
        self.count(p, gate.index)
        self.host.wake_pull()

    def tried(self, p: Parked, task: asyncio.Task) -> None:
        key = delivery_key(p.job)
        if task.cancelled() or (self.inline.get(key) is not p and self.waiting.get(key) is not p):
            return                               # withdrawn, or taken back by a drain (it NAKs the job)
        self.leave(p)
        p.task = None
        if task.exception() is not None:        # before_job tries again, in the chain
            log.error("worker: taking the limits of seq=%d failed", p.job.stream_seq, exc_info=task.exception())
        p.admitted(p.item)

    def leave(self, p: Parked) -> None:
        key = delivery_key(p.job)
        if self.inline.pop(key, None) is not None and p.task is not None:
            self.trying -= 1
        self.waiting.pop(key, None)
        self.count(p, None)

    def count(self, p: Parked, index: int | None) -> None:
        """`p` waits for limit `index` now (None: no longer waits): the table's waiting words."""
        table = self.host.table
        if p.waits == index:
            return
        if table is not None and p.waits is not None:
            table.limit_add(p.waits, slots.LIMIT_WAITING, -1)
        if table is not None and index is not None:
            table.limit_add(index, slots.LIMIT_WAITING)
        p.waits = index

    # -- a drain, the end

    def take_back(self) -> list[Any]:
        """A drain: every parked job back (its take cancelled, nothing held for it)."""
        items = []
        for p in [*self.inline.values(), *self.waiting.values()]:
            if p.task is not None:
                p.task.cancel()
            self.count(p, None)
            items.append(p.item)
        self.inline.clear()
        self.waiting.clear()
        self.trying = 0
        return items

    def close(self) -> None:
        for p in [*self.inline.values(), *self.waiting.values()]:
            if p.task is not None:
                p.task.cancel()
