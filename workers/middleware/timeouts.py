"""workers.soft_timeout: SoftTimeout raised inside a job that runs too long, the worker living on.
A built-in middleware, the innermost of all (its around wraps the handler alone), one class per
kind of handler:

  - async: the handler runs under asyncio.timeout(); at the deadline its task is cancelled (the
    handler sees CancelledError at its await and its finally blocks run) and the outcome is
    SoftTimeout. A TimeoutError of the handler's own stays what it is.
  - sync: a watchdog thread raises SoftTimeout in the handler's thread (PyThreadState_SetAsyncExc),
    which sees it at its next Python bytecode: a runaway loop stops, a thread blocked inside C (a
    sleep, a socket read) gets it only when that call returns. The hard workers.job_timeout (the
    parent kills the worker) is what ends those.

The watchdog arms a deadline per job and wakes only for the earliest one (no wake-up per job).
The deadline and the disarm share the watchdog's lock: a deadline that passes just as the handler
returned either finds the job disarmed, or fires while the thread waits in disarm, and then
SoftTimeout surfaces there, inside this middleware's around: a job that finished at its very
deadline may be reported as SoftTimeout and retried (a rerun, at least once; never a loss), but
the exception never escapes into the thread's next work (disarm also clears one still pending).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from workers import Job, SoftTimeout
from workers.middleware.base import Context, Middleware
from workers.middleware.limits import give_back_stranded

log = logging.getLogger("worker")


def raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Make thread `thread_id` raise `exc` at its next bytecode; None (a NULL) clears one it has
    not raised yet."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None if exc is None else ctypes.py_object(exc))


class Watchdog:
    """Deadlines of running sync jobs, by token; a daemon thread raises SoftTimeout in the
    thread of each one that passes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.cond = threading.Condition()
        self.armed: dict[int, tuple[float, int, int]] = {}   # token -> (deadline, thread id, seq)
        # The handshake that keeps a SoftTimeout out of every lock a handler thread takes to
        # disarm (see disarm): tokens whose handler is done, each written by its own thread,
        # and the token the watchdog is raising for right now (0: none). Plain reads and
        # writes under the GIL, no lock.
        self.done: set[int] = set()
        self.firing = 0
        self.tokens = 0
        self.stopped = False
        self.fired = 0

    def start(self) -> Watchdog:
        threading.Thread(target=self.run, name="soft_timeout", daemon=True).start()
        return self

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()

    def arm(self, seconds: float, seq: int = 0) -> int:
        """In the handler's thread, just before the handler (of the job at stream seq `seq`)."""
        with self.cond:
            self.tokens += 1
            deadline = self.clock() + seconds
            if deadline < min((d for d, _, _ in self.armed.values()), default=math.inf):
                self.cond.notify()                         # earlier than what the watchdog waits for
            self.armed[self.tokens] = (deadline, threading.get_ident(), seq)
            return self.tokens

    def disarm(self, token: int) -> None:
        """In the handler's thread, once the handler is done (returned or raised). No lock is
        taken while a SoftTimeout may be pending or on its way: raised just after a lock's acquire
        returned, before the `with` body, it would leave that lock held for good (every other
        handler thread then stuck in arm, the watchdog and the worker's exit with them). So: say
        the handler is done, wait out a raise already under way (it may land here: the job's
        outcome is then SoftTimeout, as a job at its very deadline may be), clear what was raised
        and not yet seen, and only then take the lock."""
        self.done.add(token)             # written before firing is read; run() writes firing before reading done
        try:
            while self.firing == token:
                time.sleep(0)
            if token not in self.armed:  # run() took it: it raised, or saw it done
                raise_in(threading.get_ident(), None)
        finally:                         # raised or not, nothing is pending any more: the lock is safe
            with self.cond:
                self.armed.pop(token, None)
                self.done.discard(token)

    def run(self) -> None:
        with self.cond:
            while not self.stopped:
                now = self.clock()
                for token in [t for t, (d, _, _) in self.armed.items() if d <= now]:
                    _, thread_id, seq = self.armed.pop(token)
                    self.firing = token
                    if token not in self.done:   # else its handler returned: it is disarming
                        self.fired += 1
                        raise_in(thread_id, SoftTimeout)
                        # Raised at the thread's next bytecode: a thread blocked in C (a sleep, a
                        # lock) sees it only when that call returns (`with limit()` waits in 0.25 s steps).
                        log.info("worker: seq=%d past workers.soft_timeout: SoftTimeout raised in its thread", seq,
                                 extra={"event": "soft_timeout", "seq": seq})
                    self.firing = 0
                earliest = min((d for d, _, _ in self.armed.values()), default=None)
                self.cond.wait(None if earliest is None else max(0.0, earliest - now))


class SoftTimeoutSync(Middleware):
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.watchdog = Watchdog()

    def setup(self, ctx: Context) -> None:
        self.watchdog.start()

    def around(self, job: Job, call_next: Callable[[], Any]) -> Any:
        token = self.watchdog.arm(self.seconds, job.stream_seq)
        try:
            return call_next()
        finally:
            self.watchdog.disarm(token)
            # Nothing can be raised in this thread any more: a `with limit()` block that SoftTimeout
            # interrupted before it could give its limit back has it given back now.
            give_back_stranded()

    def close(self) -> None:
        self.watchdog.stop()


class SoftTimeoutAsync(Middleware):
    def __init__(self, seconds: float):
        self.seconds = seconds

    async def around(self, job: Job, call_next: Callable[[], Awaitable[Any]]) -> Any:
        limit = asyncio.timeout(self.seconds)
        try:
            async with limit:
                return await call_next()
        except TimeoutError:
            if limit.expired():
                raise SoftTimeout(f"ran past workers.soft_timeout ({self.seconds:g}s); cancelled") from None
            raise


def soft_timeout(seconds: float, is_async: bool) -> Middleware:
    return SoftTimeoutAsync(seconds) if is_async else SoftTimeoutSync(seconds)
