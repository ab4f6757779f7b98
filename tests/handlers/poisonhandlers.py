"""Handlers for the poison-evidence tests (issue 22, R7): a job whose payload is `kill-after:S`
SIGKILLs its own worker S seconds into its run (a native crash, an OOM kill of that job); any
other payload is tests/testhandlers.py's, logged the same way."""

import asyncio
import os
import signal
import time

from testhandlers import _log, record, record_async

from workers import Job


def _kill_after(job: Job) -> float | None:
    text = job.data.decode(errors="replace")
    return float(text.split(":")[1]) if text.startswith("kill-after:") else None


async def killer_async(job: Job) -> None:
    seconds = _kill_after(job)
    if seconds is None:
        return await record_async(job)
    _log("start", job)
    await asyncio.sleep(seconds)
    os.kill(os.getpid(), signal.SIGKILL)


def killer(job: Job) -> None:
    seconds = _kill_after(job)
    if seconds is None:
        return record(job)
    _log("start", job)
    time.sleep(seconds)
    os.kill(os.getpid(), signal.SIGKILL)
