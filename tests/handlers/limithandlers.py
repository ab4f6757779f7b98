"""Handlers for the limits and pause tests (tests/integration/test_limits.py): `record` from
testhandlers (its journal) inside `limit()` blocks, and one that raises workers.Pause."""

import asyncio
import time

from testhandlers import _act, _log

from workers import Job, Pause, limit


def partial(job: Job) -> None:
    """Holds [limits.db] only for the journalled part of the job (a sync handler)."""
    with limit("db"):
        _log("start", job)
        seconds = _act(job)
        time.sleep(seconds)
        _log("done", job)


async def partial_async(job: Job) -> None:
    async with limit("db"):
        _log("start", job)
        seconds = _act(job)
        await asyncio.sleep(seconds)
        _log("done", job)


def pauser(job: Job) -> None:
    """`pause:SECONDS` pauses the consumer the first time it runs; anything else is `record`."""
    text = job.data.decode()
    if text.startswith("pause:") and job.delivery == 1:
        raise Pause(float(text.split(":")[1]), "the database is down (test)")
    _log("start", job)
    time.sleep(_act(job) if not text.startswith("pause:") else 0.0)
    _log("done", job)
