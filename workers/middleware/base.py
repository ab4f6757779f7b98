"""The middleware API: `workers.Middleware`, the context each instance gets once, and the
exception a hook raises to ack a job without running it.

    from workers import Middleware

    class Timing(Middleware):
        def setup(self, ctx):                        # once per worker, after fork, connected
            self.slot = ctx.slot
        def before_job(self, job): ...               # raise Retry/Reject/Duplicate to skip the handler
        def after_job(self, job, outcome, error): ...   # "ack" | "retry" | "reject" | "fail" | "duplicate"
        def around(self, job, call_next):            # for code that must wrap the call
            return call_next()

Every hook is optional; any of them but `around` may be `async def` (awaited on the worker's
loop, for a sync handler too). How the hooks run is workers/middleware/chain.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:                        # `import workers` stays light: no config tree
    from supervisor.config import Config
    from workers import Job

T = TypeVar("T")


class Duplicate(Exception):
    """Raised by a `before_job` hook: the job is already done; ack it without running it (counted
    as a duplicate, like the [idempotency] guard's)."""

    def __init__(self, reason: str = "already done"):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Context:
    """What a middleware gets once per worker (`setup(ctx)`), after fork and the worker's connect."""
    slot: int                            # the worker's slot, 0 .. workers.count-1
    pid: int
    nc: Any                              # the worker's nats-py connection (its jetstream() too)
    loop: asyncio.AbstractEventLoop      # the worker's event loop
    cfg: Config                          # the whole config tree as the worker was forked with it
    is_async: bool                       # the handler is `async def` (hooks run on the loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """From a sync handler's thread (or a hook running there): run `coro` on the worker's loop
        and wait for its result. Never call it on the loop itself (it would wait for itself)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


class Middleware:
    """Base class of `workers.middleware` entries: one instance per worker, made after fork with
    no arguments, shared by that worker's handler threads (sync) or runner tasks (async), so
    per-job state belongs in the job's own keys or a contextvar, not on `self`.

    Hooks, in list order (outermost first): `before_job`, then `around` wrapping everything
    inside it, then `after_job` in reverse order. A hook that raises Retry / Reject acts as if
    the handler had; Duplicate (before_job) acks the job unrun; anything else is logged and the
    job is retried (NAK with the retry delay), never acked unrun."""

    def setup(self, ctx: Context) -> None | Awaitable[None]:
        """Once per worker, before its first job. Raising fails the worker's start (exit as init)."""
        return None

    def before_job(self, job: Job) -> None | Awaitable[None]:
        """Before the handler (and before the `around` and hooks of middleware inside this one)."""
        return None

    def after_job(self, job: Job, outcome: str, error: BaseException | None) -> None | Awaitable[None]:
        """After the handler: called exactly when this middleware's before_job returned. `outcome`
        is what the job would be settled as now ("ack", "retry", "reject", "fail", "duplicate"),
        `error` the exception behind it (None for "ack")."""
        return None

    def around(self, job: Job, call_next: Callable[[], Any]) -> Any:
        """Wrap the rest of the chain: return (or `await`, for an async handler) `call_next()`.
        A plain function for a sync handler, `async def` for an async one (checked at start)."""
        return call_next()

    def close(self) -> None | Awaitable[None]:
        """Once when the worker exits, after its last settle (flush what you buffer)."""
        return None
