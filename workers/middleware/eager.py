"""Awaiting many coroutines at once without a task for those that never wait.

`asyncio.gather` makes a task of every coroutine it is given: for a chunk of a sync handler's
jobs entering the chain's outer, loop-side hooks (workers/middleware/chain.py `enter`, `leave`)
that is a task, a done-callback and a loop round per job, even when the hook returns at once
(the usual case: [retry]'s copies look nothing up for a first delivery). `gather_eagerly` runs
each coroutine at once, up to its first real wait (Python 3.12's eager tasks do the same), and
makes a task only of the rest of those that did wait; their waits still overlap (the guard's KV
requests of a chunk go out together).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


async def gather_eagerly(coros: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """What `asyncio.gather(*coros)` returns, in order. A coroutine that raises before it first
    waits raises here once the others (those that wait, as tasks) are done."""
    results: list[Any] = []
    waiting: dict[int, asyncio.Future[Any]] = {}
    failed: BaseException | None = None
    for k, coro in enumerate(coros):
        results.append(None)
        try:
            step = coro.send(None)
        except StopIteration as done:
            results[k] = done.value
        except BaseException as exc:
            failed = failed or exc
        else:
            waiting[k] = asyncio.ensure_future(_Rest(coro, step).run())
    if waiting:
        for k, value in zip(waiting, await asyncio.gather(*waiting.values())):
            results[k] = value
    if failed is not None:
        raise failed
    return results


class _Rest:
    """The rest of a coroutine that already ran up to `step` (what it yielded to its runner): a
    task runs it as if it had run the coroutine from the start (`yield from` from the middle)."""

    def __init__(self, coro: Coroutine[Any, Any, Any], step: Any):
        self.coro, self.step = coro, step

    async def run(self) -> Any:
        return await self

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, step = self.coro, self.step
        while True:
            try:
                value = yield step
            except BaseException as exc:      # a cancellation (or a close) goes on into the coroutine
                try:
                    step = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    step = coro.send(value)
                except StopIteration as done:
                    return done.value
