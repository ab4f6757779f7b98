"""Fault hook for the re-publish of a long retry delay (workers/runtime/later.py), in the tests
only: nothing in the product reads it.

The supervisor imports its handler module in the parent before it forks, so the workers inherit
what this module patches at import. While the file $LATER_TRAP exists, the worker that has just
stored a copy for later (its PubAck is in) removes the file and dies before it acks the original:
the one interleaving that can re-publish a job twice, or run it beside its copy. With
$LATER_TRAP_AFTER_COPY set too, it dies only once the copy has fired and run on another worker.
`gated` and `fails_first` are the jobs that meet it.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from pathlib import Path

from testhandlers import _log

import workers.runtime.outcome as outcome
from workers import Job

TRAP = Path(os.environ.get("LATER_TRAP", ""))
ATTEMPTS = "Supervisor-Attempts"           # only a re-published copy has it


def _trapped(original):
    @functools.wraps(original)
    async def republish_later(nc, cfg, job, *args, **kwargs):
        await original(nc, cfg, job, *args, **kwargs)
        try:
            TRAP.unlink()
        except FileNotFoundError:
            return
        if os.environ.get("LATER_TRAP_AFTER_COPY"):   # die only once the copy has fired and run elsewhere
            copy_done = Path(job.data.decode()) / "copy-done"
            deadline = time.monotonic() + 60
            while not copy_done.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        os._exit(13)                   # between the copy's PubAck and the original's ack
    return republish_later


if os.environ.get("LATER_TRAP"):
    outcome.republish_later = _trapped(outcome.republish_later)   # outcome.py calls it by this name


def gated(job: Job) -> None:
    """Data: a directory. The original fails on every delivery, its second one only after the copy
    ran (the file `copy-done` there): so the second re-publish of the original comes after the first
    copy already fired and was purged, and only the Nats-Msg-Id can keep the job to one copy. A copy
    runs and writes `copy-done`."""
    _log("start", job)
    gate = Path(job.data.decode()) / "copy-done"
    if ATTEMPTS in job.headers:
        _log("done", job)
        gate.touch()
        return
    deadline = time.monotonic() + 60
    while job.delivery > 1 and not gate.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    raise RuntimeError(f"failing the original on purpose (delivery {job.delivery})")


def fails_first(job: Job) -> None:
    """Fails its first delivery (a fault that goes away) and runs through on any other, the copy
    for later included: the original's rerun would succeed."""
    _log("start", job)
    if ATTEMPTS not in job.headers and job.delivery == 1:
        raise RuntimeError("failing the first delivery on purpose")
    _log("done", job)
