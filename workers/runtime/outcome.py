"""A job's outcome (its handler's, or a middleware hook's: workers/middleware/chain.py), settled:
return is an ack, Duplicate an ack of a job not run, Retry a NAK with its delay, Reject a TERM
with a dead-letter copy first, any other exception (a hook's too) a NAK with workers.retry_backoff's
delay for this delivery. A SystemExit (or another BaseException) from a handler is a crash, not an
outcome: the worker exits without settling, and the parent NAKs what it held."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from supervisor.config import Config
from workers import Duplicate, Job, Reject, Retry
from workers.middleware.chain import HookFailed
from workers.middleware.retries import retry_delay
from workers.protocol.exits import EXIT_CRASHED
from workers.runtime.deadletter import dead_letter
from workers.runtime.settle import Settler, nak_payload

log = logging.getLogger("worker")


class Outcomes:
    def __init__(self, settler: Settler, slot: int, cfg: Config, nc: Callable[[], Any]):
        self.settler, self.slot, self.cfg = settler, slot, cfg
        self.nc = nc                      # the worker's connection, made once the worker runs

    async def settle(self, i: int, job: Job, exc: BaseException | None) -> None:
        if exc is None:
            await self.settler.ack(i, job)
        elif isinstance(exc, Duplicate):
            await self.settler.ack(i, job, "duplicate")
        elif isinstance(exc, Retry):
            await self.settler.settle(i, job, nak_payload(exc.delay), "nak", str(exc))
        elif isinstance(exc, Reject):
            await self.reject(i, job, exc.reason)
        elif isinstance(exc, HookFailed):
            log.error("worker %d: middleware %s on seq=%d delivery=%d; retrying the job", self.slot, exc,
                      job.stream_seq, job.delivery, exc_info=exc.error,
                      extra={"event": "middleware_failed", "seq": job.stream_seq, "delivery": job.delivery,
                             "where": exc.where})
            await self.settler.settle(i, job, nak_payload(self.retry_delay(job)), "nak", str(exc)[:200])
        elif isinstance(exc, Exception):
            log.error("worker %d: handler failed on seq=%d delivery=%d", self.slot, job.stream_seq,
                      job.delivery, exc_info=exc,
                      extra={"event": "handler_failed", "seq": job.stream_seq, "delivery": job.delivery})
            await self.settler.settle(i, job, nak_payload(self.retry_delay(job)), "nak",
                                      f"{type(exc).__name__}: {exc}"[:200])
        else:
            log.error("worker %d: handler raised %s on seq=%d; exiting without ack",
                      self.slot, type(exc).__name__, job.stream_seq)
            os._exit(EXIT_CRASHED)

    def retry_delay(self, job: Job) -> float:
        return retry_delay(self.cfg.workers.retry_backoff, job.delivery)

    async def reject(self, i: int, job: Job, reason: str) -> None:
        try:
            await dead_letter(self.nc(), self.cfg, job, reason)
        except Exception as exc:
            log.error("worker %d: cannot dead-letter seq=%d (%s); NAKing it instead", self.slot, job.stream_seq, exc)
            await self.settler.settle(i, job, nak_payload(self.retry_delay(job)), "nak", f"dead-letter failed: {exc}")
            return
        await self.settler.settle(i, job, b"+TERM " + reason.encode()[:200], "term", reason)
        log.warning("worker %d: job seq=%d subject=%s rejected by the handler (TERM): %s", self.slot,
                    job.stream_seq, job.subject, reason,
                    extra={"event": "rejected", "seq": job.stream_seq, "subject": job.subject, "reason": reason})
