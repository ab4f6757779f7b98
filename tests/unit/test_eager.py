"""workers/middleware/eager.py: gather_eagerly returns what asyncio.gather would, runs a coroutine
that never waits without a task, lets those that wait overlap, and passes a cancellation on."""

from __future__ import annotations

import asyncio

import pytest

from workers.middleware.eager import gather_eagerly


async def at_once(value):
    return value


async def after(seconds, value, log):
    log.append(f"start {value}")
    await asyncio.sleep(seconds)
    log.append(f"end {value}")
    return value


def test_results_come_in_order_and_only_the_waiting_ones_become_tasks():
    async def run():
        log: list[str] = []
        tasks_before = len(asyncio.all_tasks())
        seen: list[int] = []

        async def count_tasks(value):
            seen.append(len(asyncio.all_tasks()))
            return value
        started = asyncio.get_running_loop().time()
        out = await gather_eagerly([at_once(1), after(0.2, 2, log), count_tasks(3), after(0.2, 4, log), at_once(5)])
        took = asyncio.get_running_loop().time() - started
        return out, log, took, seen, tasks_before
    out, log, took, seen, before = asyncio.run(run())
    assert out == [1, 2, 3, 4, 5]
    assert log[:2] == ["start 2", "start 4"] and sorted(log[2:]) == ["end 2", "end 4"]
    assert took < 0.39, "the two waits overlap"
    assert seen == [before + 1], "count_tasks ran at once, beside the one task made so far (for 2's wait)"


def test_a_coroutine_that_raises_before_it_waits_raises_once_the_waiting_ones_are_done():
    async def boom():
        raise KeyError("k")

    async def run():
        log: list[str] = []
        with pytest.raises(KeyError):
            await gather_eagerly([after(0.05, 1, log), boom()])
        return log
    assert asyncio.run(run()) == ["start 1", "end 1"]


def test_a_cancellation_reaches_the_coroutine_that_waits():
    async def run():
        log: list[str] = []

        async def waits():
            log.append("waiting")
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                log.append("cancelled inside")
                raise
        task = asyncio.ensure_future(gather_eagerly([waits(), at_once(2)]))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)
        return log
    assert asyncio.run(run()) == ["waiting", "cancelled inside"]
