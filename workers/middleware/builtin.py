"""A worker's middleware, made after fork: [tracing] outermost when the config turns it on, then
the `workers.middleware` entries (classes the parent imported and checked before forking) in
list order, then the built-ins the config turns on: [retry]'s copies (a redelivery whose copy
for later is stored runs only as that copy), [limits] (workers/middleware/limits.py), then
the [idempotency] guard (so a job holds its limits before the guard takes its lease), [log
context] (always), and innermost the soft time limit, which wraps the handler alone."""

from __future__ import annotations

from collections.abc import Sequence

from supervisor.config import Config
from workers.middleware.base import Middleware
from workers.middleware.copies import CopyWaiting, NotOurs
from workers.middleware.guard import IdempotencyGuard, scope_of
from workers.middleware.joblog import JobLog
from workers.middleware.limits import Limits
from workers.middleware.retries import Policy
from workers.middleware.timeouts import soft_timeout
from workers.protocol.crashes import CrashBoard


def instances(entries: Sequence[tuple[str, type[Middleware]]], cfg: Config, is_async: bool,
              crashes: CrashBoard | None = None) -> list[tuple[str, Middleware]]:
    """(name, instance) for each middleware of one worker, outermost first."""
    tracing = None
    if cfg.tracing.enabled:                        # issue 29: a span per delivery; loads the SDK, so only then
        from workers.middleware.tracing import Tracing
        tracing = Tracing(crashes)
    chain: list[tuple[str, Middleware]] = [("[tracing]", tracing)] if tracing is not None else []
    chain += [(name, cls()) for name, cls in entries]
    if cfg.stream.retention != "workqueue":        # a fan-out: another pool's copies and replays reach us
        chain.append(("[pools] not ours", NotOurs(cfg)))
    if cfg.retry.republish_after and cfg.stream.allow_schedules:   # a redelivery whose copy for later waits
        chain.append(("[retry] copies", CopyWaiting(cfg)))
    if cfg.limits:                                 # issue 26: fleet-wide limits, outside the guard
        chain.append(("[limits]", Limits(cfg)))
    if cfg.idempotency.enabled:                    # issue 10: done-markers and leases
        chain.append(("[idempotency]", IdempotencyGuard(cfg.idempotency.bucket, Policy.from_config(cfg).delay,
                                                            scope_of(cfg))))
    chain.append(("[log context]", JobLog(tracing)))   # issue 29: every record logged in a job names it
    if cfg.workers.soft_timeout:
        chain.append(("workers.soft_timeout", soft_timeout(cfg.workers.soft_timeout, is_async)))
    return chain
