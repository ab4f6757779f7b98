"""Suspects run alone (issue 22, R7): poison evidence that names the job that killed.

A worker that dies while several jobs run says nothing about which of them killed it. The
parent's ledger then counts that death against none of them: each becomes a *suspect*, and the
parent lists the suspects on a board every worker reads (`SuspectBoard`, anonymous shared memory
made before the first fork, so every worker inherits it). A worker runs a suspect with nothing
beside it: it starts once the jobs running in that worker have finished, and no other job starts
until it returns (`Gate`). A death while a suspect runs alone is evidence against that job; a
suspect that returns is cleared. So only a job that kills a worker by itself is quarantined.

Delivery is untouched: a job waiting for its turn is HELD in the slot table like any pulled job
(kept alive with +WPI, NAKed at a death or a stop), so nothing is lost or run twice because of
the wait. The board is best effort: a worker reading it while the parent rewrites it may see a
suspect as ordinary (it runs beside others: another ambiguous death, no evidence) or the
reverse (it runs alone once for nothing). The cost is throughput: while a suspect runs, its
worker runs nothing else.
"""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import Callable, Iterable

CAPACITY = 256          # suspects on the board at most (more are left to the ambiguity they came from)


class SuspectBoard:
    """Word 0: how many seqs follow; words 1..n: stream sequences. The parent writes, workers read."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self.mm = mmap.mmap(-1, 8 * (capacity + 1))
        self.q = memoryview(self.mm).cast("q")
        self.shown: tuple[int, ...] = ()

    def show(self, seqs: Iterable[int]) -> None:
        """In the parent: put exactly these on the board (the lowest, if more than fit)."""
        wanted = tuple(sorted(seqs))[:self.capacity]
        if wanted == self.shown:
            return
        self.q[0] = 0                   # readers see an empty board while it is rewritten
        for k, seq in enumerate(wanted):
            self.q[1 + k] = seq
        self.q[0] = len(wanted)
        self.shown = wanted

    def suspect(self, seq: int) -> bool:
        """In a worker: is this job to run alone?"""
        n = min(self.q[0], self.capacity)
        return n > 0 and any(self.q[1 + k] == seq for k in range(n))


class Gate:
    """One worker's rule for starting jobs (call under the worker's own serialisation: the loop,
    or the handler threads' lock). A suspect claims the worker, waits for what runs to finish,
    then runs alone; nothing starts beside it."""

    def __init__(self, board: SuspectBoard | None):
        self.board = board
        self.active = 0                 # ordinary jobs started and not returned
        self.solo: int | None = None    # the suspect that claimed the worker ...
        self.solo_running = False       # ... and whether it runs yet

    def try_start(self, seq: int) -> bool:
        if self.solo is not None and self.solo != seq:
            return False
        if self.solo == seq or (self.board is not None and self.board.suspect(seq)):
            self.solo = seq
            if self.active:
                return False
            self.solo_running = True
            return True
        self.active += 1
        return True

    def finished(self, seq: int) -> bool:
        """A job returned from its handler. True when a claim ended (waiters may go on)."""
        if self.solo_running and self.solo == seq:
            self.solo, self.solo_running = None, False
            return True
        self.active -= 1
        return self.solo is not None and not self.active

    def release(self, seq: int) -> None:
        """A claimed suspect that will not start after all (a shutdown NAKs it)."""
        if self.solo == seq and not self.solo_running:
            self.solo = None


class AsyncGate(Gate):
    """The gate for async handlers: runners wait on the loop for their turn."""

    def __init__(self, board: SuspectBoard | None):
        super().__init__(board)
        self._turn = asyncio.Event()

    def wake(self) -> None:
        """Something changed (a job returned, the worker's mode): waiters look again."""
        turn, self._turn = self._turn, asyncio.Event()
        turn.set()

    async def start(self, seq: int, stopping: Callable[[], bool]) -> bool:
        """Wait until this job may start; False if the worker stops first (it is not started).
        The stop is looked at before the turn: a stop and the running jobs' end can come in one
        tick, and a job pulled before a stop must then be given back, not started after it."""
        while True:
            if stopping():
                self.release(seq)
                self.wake()
                return False
            if self.try_start(seq):
                return True
            await self._turn.wait()

    def done(self, seq: int) -> None:
        if self.finished(seq):
            self.wake()
