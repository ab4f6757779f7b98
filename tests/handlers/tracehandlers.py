"""Handlers for the tracing and log-context tests: each logs a line through `logging` while it
runs (as a user's handler would), opens a span of its own when OpenTelemetry is there (it must
be the job's span's child), then does what testhandlers.record does with the payload (journal,
sleep, crash-once, fail-once, ...)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from testhandlers import _act, _log

from workers import Job

log = logging.getLogger("tracehandlers")


def _own_span():
    try:
        from opentelemetry import trace
    except ImportError:
        return contextlib.nullcontext()
    return trace.get_tracer("tracehandlers").start_as_current_span("handler work")


def logs(job: Job) -> None:
    log.info("handling %s", job.data.decode(errors="replace"))
    _log("start", job)
    with _own_span():
        time.sleep(_act(job))
    _log("done", job)


async def logs_async(job: Job) -> None:
    log.info("handling %s", job.data.decode(errors="replace"))
    _log("start", job)
    with _own_span():
        await asyncio.sleep(_act(job))
    _log("done", job)
