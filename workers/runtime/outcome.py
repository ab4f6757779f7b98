"""A job's outcome (its handler's, or a middleware hook's: workers/middleware/chain.py), settled.

Return is an ack; Duplicate an ack of a job not run; Retry a NAK with its delay; Reject a TERM
with a dead-letter copy first. Any other exception is a failure, and [retry] decides what it
costs (workers/middleware/retries.py): a NAK with a delay, or a dead letter that names the
exception when a rule says reject or the attempts are spent. A middleware hook's failure gets
the default delay (rules are about what handlers raise). A SystemExit (or another
BaseException) from a handler is a crash, not an outcome: the worker exits without settling, and
the parent NAKs what it held.

Why here and not a middleware: after_job hooks see the handler's own outcome and exception
("fail", the ValueError), as tracing wants them; and what a decision needs (a TERM after a
dead-letter copy) is the settling side's anyway.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from supervisor.config import Config
from workers import Duplicate, Job, Pause, Reject, Retry
from workers.middleware.chain import HookFailed, user_traceback
from workers.middleware.retries import Decision, Policy, attempt_of, qualified
from workers.protocol.exits import EXIT_CRASHED
from workers.runtime.deadletter import DLQ_HEADER, dead_letter
from workers.runtime.later import Later, republish_later
from workers.runtime.settle import Settler, nak_payload

log = logging.getLogger("worker")


class Outcomes:
    def __init__(self, settler: Settler, slot: int, cfg: Config, nc: Callable[[], Any]):
        self.settler, self.slot, self.cfg = settler, slot, cfg
        self.nc = nc                      # the worker's connection, made once the worker runs
        self.policy = Policy.from_config(cfg)
        self.later = Later(cfg, slot)

    async def settle(self, i: int, job: Job, exc: BaseException | None) -> None:
        if exc is None:
            await self.settler.ack(i, job)
        elif isinstance(exc, Duplicate):
            await self.settler.ack(i, job, "duplicate")
        elif isinstance(exc, Retry):         # a Pause too: NAKed with its delay, never re-published for
            #                                  later (the consumer is paused as long, the NAK keeps its place)
            await self.retry(i, job, exc.delay, attempt_of(job.headers, job.delivery), str(exc),
                             later=not isinstance(exc, Pause))
        elif isinstance(exc, Reject):
            await self.reject(i, job, exc.reason)
        elif isinstance(exc, HookFailed):
            attempt = attempt_of(job.headers, job.delivery)
            decision = Decision(self.policy.delay(attempt), str(exc)[:200], attempt)
            log.error("worker %d: middleware %s on seq=%d delivery=%d; retrying the job in %.3gs", self.slot, exc,
                      job.stream_seq, job.delivery, decision.delay, exc_info=logged(exc.error),
                      extra={"event": "middleware_failed", "seq": job.stream_seq, "delivery": job.delivery,
                             "where": exc.where, "attempt": attempt, "delay": decision.delay})
            await self.failed(i, job, exc, decision)
        elif isinstance(exc, Exception):
            decision = self.policy.decide(exc, attempt_of(job.headers, job.delivery))
            then = "dead-lettering it" if decision.delay is None else f"retrying in {decision.delay:.3g}s"
            log.error("worker %d: handler failed on seq=%d delivery=%d (attempt %d); %s", self.slot, job.stream_seq,
                      job.delivery, decision.attempt, then, exc_info=logged(exc),
                      extra={"event": "handler_failed", "seq": job.stream_seq, "delivery": job.delivery,
                             "attempt": decision.attempt, "delay": decision.delay, "error": qualified(exc)})
            await self.failed(i, job, exc, decision)
        else:
            log.error("worker %d: handler raised %s on seq=%d; exiting without ack",
                      self.slot, type(exc).__name__, job.stream_seq)
            os._exit(EXIT_CRASHED)

    async def failed(self, i: int, job: Job, exc: Exception, decision: Decision) -> None:
        if decision.delay is not None:
            await self.retry(i, job, decision.delay, decision.attempt, decision.reason)
            return
        error = exc.error if isinstance(exc, HookFailed) else exc
        headers = {DLQ_HEADER + "Error": qualified(error), DLQ_HEADER + "Error-Message": " ".join(str(error).split())[:500],
                   DLQ_HEADER + "Attempts": str(decision.attempt)}
        await self.reject(i, job, decision.reason, headers, by="[retry]")

    async def retry(self, i: int, job: Job, delay: float, attempt: int, reason: str, later: bool = True) -> None:
        """A NAK with the delay; past retry.republish_after, a copy stored for later and an ack, so
        no ack-pending slot is held while it waits (workers/runtime/later.py)."""
        if later and self.later.wanted(delay) and await self.later.usable(self.nc()):
            try:
                await republish_later(self.nc(), self.cfg, job, delay, attempt, reason)
            except Exception as exc:
                log.warning("worker %d: cannot re-publish seq=%d for later (%s); NAKing it with its %.3gs delay",
                            self.slot, job.stream_seq, str(exc) or type(exc).__name__, delay)
            else:
                await self.settler.settle(i, job, b"+ACK", "later", f"re-published for {delay:.3g}s later: {reason}"[:200])
                return
        await self.settler.settle(i, job, nak_payload(delay), "nak", reason)

    async def reject(self, i: int, job: Job, reason: str, headers: dict[str, str] | None = None,
                     by: str = "the handler") -> None:
        try:
            await dead_letter(self.nc(), self.cfg, job, reason, headers)
        except Exception as exc:
            log.error("worker %d: cannot dead-letter seq=%d (%s); NAKing it instead", self.slot, job.stream_seq, exc)
            delay = self.policy.delay(attempt_of(job.headers, job.delivery))
            await self.settler.settle(i, job, nak_payload(delay), "nak", f"dead-letter failed: {exc}")
            return
        await self.settler.settle(i, job, b"+TERM " + reason.encode()[:200], "term", reason)
        log.warning("worker %d: job seq=%d subject=%s rejected by %s (TERM): %s", self.slot,
                    job.stream_seq, job.subject, by, reason,
                    extra={"event": "rejected", "seq": job.stream_seq, "subject": job.subject, "reason": reason,
                           "by": by})


def logged(exc: BaseException) -> tuple[type[BaseException], BaseException, Any]:
    """exc_info for a log line: the traceback from the handler (or hook) on, not the chain's frames."""
    return type(exc), exc, user_traceback(exc)
