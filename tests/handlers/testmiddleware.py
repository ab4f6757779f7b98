"""Middleware the tests' workers run (workers.middleware entries). Every hook call is journaled to
$JOBS_LOG like testhandlers' jobs (`mw:<who>.<hook>[:<outcome>] pid seq delivery time data`, the
data tagged with the thread the hook ran in), so a test reads the order and the place of every
call from the same file as the handler's start/done lines.

What a hook does is asked by the job's payload, on the first delivery only:
  hook-before-fails   Inner.before_job (async) raises RuntimeError
  hook-after-fails    Inner.after_job (async) raises RuntimeError (the handler has run)
  hook-around-fails   Outer.around raises RuntimeError before call_next()
  hook-skips          Outer.around returns without calling call_next()
  hook-before-rejects Inner.before_job raises Reject
  hook-before-retries Inner.before_job raises Retry(0.2)
  hook-after-retries  Inner.after_job raises Retry(0.2)
"""

from __future__ import annotations

import threading

from testhandlers import _log

from workers import Context, Job, Middleware, Reject, Retry

NOBODY = Job(data=b"", subject="")


def asks(job: Job, what: str) -> bool:
    return job.delivery == 1 and job.data == what.encode()


def note(event: str, job: Job) -> None:
    _log(f"mw:{event}", job, f"{threading.current_thread().name}:")


class Outer(Middleware):
    """The outer middleware around a sync handler: plain hooks, a plain around."""

    def before_job(self, job: Job) -> None:
        note("A.before", job)

    def around(self, job, call_next):
        note("A.around-in", job)
        if asks(job, "hook-around-fails"):
            raise RuntimeError("Outer.around failing on purpose")
        if asks(job, "hook-skips"):
            return None
        result = call_next()
        note("A.around-out", job)
        return result

    def after_job(self, job: Job, outcome: str, error: BaseException | None) -> None:
        note(f"A.after:{outcome}", job)


class OuterAsync(Outer):
    """The same around an async handler: its around is `async def`."""

    async def around(self, job, call_next):
        note("A.around-in", job)
        if asks(job, "hook-around-fails"):
            raise RuntimeError("OuterAsync.around failing on purpose")
        if asks(job, "hook-skips"):
            return None
        result = await call_next()
        note("A.around-out", job)
        return result


class Inner(Middleware):
    """Async before/after hooks that talk to NATS through the context (a round trip on the
    worker's connection each): for a sync handler they run on the loop while its thread waits."""

    def __init__(self) -> None:
        self.ctx: Context | None = None

    async def setup(self, ctx: Context) -> None:
        self.ctx = ctx
        note(f"B.setup:slot{ctx.slot}", NOBODY)

    async def before_job(self, job: Job) -> None:
        assert self.ctx is not None
        await self.ctx.nc.flush(timeout=5)
        note("B.before", job)
        if asks(job, "hook-before-fails"):
            raise RuntimeError("Inner.before_job failing on purpose")
        if asks(job, "hook-before-rejects"):
            raise Reject("Inner.before_job rejecting on purpose")
        if asks(job, "hook-before-retries"):
            raise Retry(0.2)

    async def after_job(self, job: Job, outcome: str, error: BaseException | None) -> None:
        assert self.ctx is not None
        await self.ctx.nc.flush(timeout=5)
        note(f"B.after:{outcome}", job)
        if asks(job, "hook-after-fails"):
            raise RuntimeError("Inner.after_job failing on purpose")
        if asks(job, "hook-after-retries"):
            raise Retry(0.2)

    async def close(self) -> None:
        note("B.close", NOBODY)


class SetupFails(Middleware):
    def setup(self, ctx: Context) -> None:
        raise RuntimeError("middleware setup failing on purpose")


class NeedsArgs(Middleware):
    def __init__(self, required: int):
        self.required = required
