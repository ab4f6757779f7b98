"""How a worker runs each job through its middleware (the API: workers/middleware/base.py).

One Chain per worker: the `workers.middleware` entries in list order (outermost first), then
the built-ins (the [idempotency] guard, closest to the handler: its lease is taken last and its
done-marker written first). For two middleware A and B:

    A.before_job -> A.around( B.before_job -> B.around( handler ) -> B.after_job ) -> A.after_job

Where the hooks run:
  - sync handler: the chain runs in the job's handler thread. A hook that returns an awaitable
    (an `async def` before_job / after_job / setup / close) has it run on the worker's loop
    while the thread waits: that is how a hook talks to NATS from a thread. The outermost
    middleware whose hooks are all `async def` (and no around; the [idempotency] guard when it
    is the only one) run on the loop without a thread waiting: `enter` before the job goes to a
    thread, `leave` once it comes back, a whole chunk of jobs at once (their KV requests go out
    together). The order is the same onion; only where those hooks wait differs.
  - async handler: on the loop, in the job's runner task; async hooks are awaited, plain ones
    called there (so they must not block).
  - `around` matches the handler: a plain function around a sync handler (call_next() runs the
    rest and returns), `async def` around an async one (await call_next()). The parent checks
    this before it forks (exit 3).

The rules, whatever a middleware does:
  - before_job raising Retry / Reject / Duplicate skips the handler (and every hook inside it):
    the job is NAKed with that delay / dead-lettered / acked as a duplicate; any other exception
    is a `HookFailed` and the job is retried (NAK with the retry delay).
  - after_job runs for every middleware whose before_job returned, innermost first, even when
    an inner one raised; each sees the outcome as it stands after the hooks inside it. One that
    raises changes the outcome by the same rule (Retry/Reject as if the handler had, anything
    else: retried).
  - a job whose handler never ran is never acked: an around that returns without calling
    call_next() (or swallows what an inner hook raised) is a HookFailed too.
  - a SystemExit or other BaseException (and the cancellation of an async job) goes straight
    through, no after_job: the worker is exiting (or has abandoned the job) anyway.
Nothing here settles: the outcome (`Ran`) goes back to the worker, which acks, NAKs or TERMs.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import types
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from workers import Job, Reject, Retry, SoftTimeout
from workers.middleware.base import Context, Duplicate, Middleware

log = logging.getLogger("worker")

# What a hook may raise to decide the job's outcome (SoftTimeout: the soft limit's, which may
# surface in its around just after the handler returned: workers/middleware/timeouts.py).
ON_PURPOSE = (Retry, Reject, Duplicate, SoftTimeout)


class HookFailed(Exception):
    """A middleware hook raised something else: the job is retried (never acked unrun)."""

    def __init__(self, where: str, error: BaseException):
        super().__init__(f"{where} raised {type(error).__name__}: {error}")
        self.where, self.error = where, error


@dataclass(frozen=True)
class Ran:
    """One job through the chain: what to settle it by, whether its handler was called (a job
    that was not must not count towards max_jobs: R1), and how long the chain took."""
    exc: BaseException | None
    started: bool
    elapsed: float


def outcome_of(exc: BaseException | None) -> str:
    """The name after_job hooks are given for what the job would be settled as."""
    if exc is None:
        return "ack"
    if isinstance(exc, Duplicate):
        return "duplicate"
    if isinstance(exc, Retry):
        return "retry"
    if isinstance(exc, Reject):
        return "reject"
    return "fail"


def _wrapped(where: str, exc: Exception) -> Exception:
    """What a hook's exception becomes: itself when it decides the outcome, else a HookFailed
    (which keeps the original, traceback and all, in .error)."""
    return exc if isinstance(exc, ON_PURPOSE) else HookFailed(where, exc)


def own_hook(mw: Middleware, name: str) -> Any:
    """The bound hook when the middleware's class overrides it, else None (nothing to call)."""
    return getattr(mw, name) if getattr(type(mw), name) is not getattr(Middleware, name) else None


def around_mismatch(cls: type[Middleware], is_async: bool) -> str:
    """Why `cls.around` cannot wrap this kind of handler, or "" (see the module docstring)."""
    around = cls.around
    if around is Middleware.around or inspect.iscoroutinefunction(around) == is_async:
        return ""
    return ("around is `async def` but workers.handler is a plain function: write a plain around" if not is_async
            else "around is a plain function but workers.handler is `async def`: write `async def around` "
                 "and `return await call_next()`")


@dataclass(frozen=True)
class Layer:
    name: str                            # the workers.middleware entry, or the built-in's name
    mw: Middleware
    before: Any
    after: Any
    around: Any
    redeliveries_only: bool = False      # a built-in whose before_job has nothing to do for a first delivery

    def before_of(self, job: Job) -> Any:
        """The before_job hook to call for this job, if any: none for a first delivery when the
        middleware says it looks only at redeliveries ([retry]'s copies: a first delivery
        costs it no call, no coroutine, no wait on the loop)."""
        return self.before if job.delivery > 1 or not self.redeliveries_only else None


class NotCalled(Exception):
    """An around returned without calling call_next()."""


class Chain:
    def __init__(self, handler: Callable[[Job], Any]):
        self.handler = handler
        self.layers: list[Layer] = []                          # none until setup()
        self.outer = 0                   # sync handler: the outermost layers run on the loop (enter/leave) ...
        self.outer_after = False         # ... and whether one of them has an after_job hook (else leave is a no-op)
        self.loop: asyncio.AbstractEventLoop | None = None     # the worker's: setup() is given it

    # -- once per worker, on the loop

    async def setup(self, middleware: Sequence[tuple[str, Middleware]], ctx: Context) -> None:
        """Take the worker's middleware (made after fork) and run each one's setup, outermost
        first; an exception fails the worker's start."""
        self.loop = ctx.loop
        self.layers = [Layer(name, mw, own_hook(mw, "before_job"), own_hook(mw, "after_job"), own_hook(mw, "around"),
                             getattr(mw, "redeliveries_only", False) is True)
                       for name, mw in middleware]
        if not ctx.is_async:
            while self.outer < len(self.layers) and on_the_loop(self.layers[self.outer]):
                self.outer += 1
            self.outer_after = any(layer.after for layer in self.layers[:self.outer])
        for layer in self.layers:
            await _maybe(layer.mw.setup(ctx))

    async def close(self) -> None:
        """Each middleware's close, innermost first; a failure is logged, the rest still close."""
        for layer in reversed(self.layers):
            try:
                await _maybe(layer.mw.close())
            except Exception:
                log.exception("middleware %s: close() failed", layer.name)

    # -- a sync handler's job: the outer layers on the loop, the rest in its handler thread

    def enters(self, job: Job) -> bool:
        """Whether an outer layer has a before_job to run for this job (else enter() returns
        (outer, None) at once: no call needed)."""
        return any(self.layers[k].before_of(job) for k in range(self.outer))

    async def enter(self, job: Job) -> tuple[int, Exception | None]:
        """On the loop, before a thread takes the job: the outer layers' before_job hooks in order.
        (How many returned, the exception that stops the job here or None: on to a thread.)"""
        for k in range(self.outer):
            layer = self.layers[k]
            if before := layer.before_of(job):
                try:
                    await self.async_hook(layer.name, "before_job", before, job)
                except Exception as exc:
                    return k, exc
        return self.outer, None

    async def leave(self, job: Job, entered: int, exc: BaseException | None) -> BaseException | None:
        """On the loop, once the job is back from its thread (or stopped by `enter`, or given back
        by a shutdown): the after_job hooks of the `entered` outer layers, innermost first. The
        outcome to settle by."""
        if exc is not None and not isinstance(exc, Exception):
            return exc                           # SystemExit & co: the worker exits, no after_job
        for k in reversed(range(entered)):
            layer = self.layers[k]
            if layer.after:
                try:
                    await self.async_hook(layer.name, "after_job", layer.after, job, outcome_of(exc), exc)
                except Exception as error:
                    exc = error
        return exc

    def run_sync(self, job: Job, on_start: Callable[[], None]) -> Ran:
        """In the job's handler thread, once `enter` let it: the layers inside the outer ones."""
        started, called = time.monotonic(), []

        def handler() -> None:
            called.append(True)
            on_start()
            result = self.handler(job)
            if result is not None and inspect.isawaitable(result):   # a sync callable that returned a coroutine
                self.wait(result)

        try:
            self.sync_layer(self.outer, job, handler)
        except BaseException as exc:
            return Ran(exc, bool(called), time.monotonic() - started)
        return Ran(None if called else unrun(), bool(called), time.monotonic() - started)

    def sync_layer(self, k: int, job: Job, handler: Callable[[], None]) -> None:
        if k == len(self.layers):
            return handler()
        layer = self.layers[k]
        if before := layer.before_of(job):
            self.sync_hook(layer.name, "before_job", before, job)
        error: Exception | None = None
        try:
            if layer.around:
                self.sync_around(layer, k, job, handler)
            else:
                self.sync_layer(k + 1, job, handler)
        except Exception as exc:
            error = exc
        if layer.after:
            self.sync_hook(layer.name, "after_job", layer.after, job, outcome_of(error), error)
        if error is not None:
            raise error

    def sync_around(self, layer: Layer, k: int, job: Job, handler: Callable[[], None]) -> None:
        inner: list[BaseException | None] = []

        def call_next() -> None:
            inner.append(None)
            try:
                self.sync_layer(k + 1, job, handler)
            except BaseException as exc:
                inner[-1] = exc
                raise

        try:
            layer.around(job, call_next)
            if not inner:
                raise NotCalled("returned without calling call_next()")
        except Exception as exc:
            if inner and exc is inner[-1]:
                raise                            # the inside's own outcome, passed on
            raise _wrapped(f"{layer.name}.around", exc) from None

    def sync_hook(self, name: str, which: str, hook: Callable[..., Any], *args: Any) -> None:
        """Layer `name`'s hook `which` (before_job, after_job), in a handler thread."""
        try:
            result = hook(*args)
            if result is not None and inspect.isawaitable(result):
                self.wait(result)
        except Exception as exc:
            raise _wrapped(f"{name}.{which}", exc) from None

    def wait(self, awaitable: Awaitable[Any]) -> Any:
        """From a handler thread: run it on the worker's loop, wait for its result."""
        assert self.loop is not None, "setup() runs before the first job"
        return asyncio.run_coroutine_threadsafe(_awaited(awaitable), self.loop).result()

    # -- an async handler's job, on the loop

    async def run_async(self, job: Job, on_start: Callable[[], None]) -> Ran:
        started, called = time.monotonic(), []

        async def handler() -> None:
            called.append(True)
            on_start()
            await self.handler(job)

        try:
            await self.async_layer(0, job, handler)
        except asyncio.CancelledError:
            raise                                # graceful_timeout ran out: the shutdown NAKs it
        except BaseException as exc:
            return Ran(exc, bool(called), time.monotonic() - started)
        return Ran(None if called else unrun(), bool(called), time.monotonic() - started)

    async def async_layer(self, k: int, job: Job, handler: Callable[[], Awaitable[None]]) -> None:
        if k == len(self.layers):
            return await handler()
        layer = self.layers[k]
        if before := layer.before_of(job):
            await self.async_hook(layer.name, "before_job", before, job)
        error: Exception | None = None
        try:
            if layer.around:
                await self.async_around(layer, k, job, handler)
            else:
                await self.async_layer(k + 1, job, handler)
        except Exception as exc:
            error = exc
        if layer.after:
            await self.async_hook(layer.name, "after_job", layer.after, job, outcome_of(error), error)
        if error is not None:
            raise error

    async def async_around(self, layer: Layer, k: int, job: Job, handler: Callable[[], Awaitable[None]]) -> None:
        inner: list[BaseException | None] = []

        async def call_next() -> None:
            inner.append(None)
            try:
                await self.async_layer(k + 1, job, handler)
            except BaseException as exc:
                inner[-1] = exc
                raise

        try:
            await layer.around(job, call_next)
            if not inner:
                raise NotCalled("returned without calling call_next()")
        except Exception as exc:
            if inner and exc is inner[-1]:
                raise
            raise _wrapped(f"{layer.name}.around", exc) from None

    async def async_hook(self, name: str, which: str, hook: Callable[..., Any], *args: Any) -> None:
        """Layer `name`'s hook `which` (before_job, after_job), on the loop."""
        try:
            result = hook(*args)
            if result is not None and inspect.isawaitable(result):
                await result
        except Exception as exc:
            raise _wrapped(f"{name}.{which}", exc) from None


def on_the_loop(layer: Layer) -> bool:
    """A layer a sync handler's chain can run on the loop: no around, only `async def` hooks."""
    return layer.around is None and all(h is None or inspect.iscoroutinefunction(h) for h in (layer.before, layer.after))


def unrun() -> HookFailed:
    """The chain returned normally but the handler never ran: an around swallowed what stopped it."""
    return HookFailed("middleware", RuntimeError("the handler never ran, yet no hook raised (an around that "
                                                 "swallowed an inner Retry/Reject/Duplicate or error?)"))


def user_traceback(exc: BaseException) -> types.TracebackType | None:
    """The exception's traceback without this module's frames (each layer re-raises what came
    from inside it): what a log shows is the handler's and the hooks' own code."""
    kept = []
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != __file__:
            kept.append(tb)
        tb = tb.tb_next
    out = None
    for t in reversed(kept):
        out = types.TracebackType(out, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return out


async def _maybe(result: Any) -> Any:
    return await result if result is not None and inspect.isawaitable(result) else result


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable
