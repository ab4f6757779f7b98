"""A worker's middleware, made after fork: the `workers.middleware` entries (classes the parent
imported and checked before forking) in list order, outermost first, then the built-ins the
config turns on, innermost (closest to the handler): [limits] (workers/middleware/limits.py),
then the [idempotency] guard, so a job holds its limits before the guard takes its lease."""

from __future__ import annotations

from collections.abc import Sequence

from supervisor.config import Config
from workers.middleware.base import Middleware
from workers.middleware.guard import IdempotencyGuard
from workers.middleware.limits import Limits
from workers.middleware.retries import retry_delay


def instances(entries: Sequence[tuple[str, type[Middleware]]], cfg: Config) -> list[tuple[str, Middleware]]:
    """(name, instance) for each middleware of one worker, outermost first."""
    chain: list[tuple[str, Middleware]] = [(name, cls()) for name, cls in entries]
    if cfg.limits:                                 # issue 26: fleet-wide limits, outside the guard
        chain.append(("[limits]", Limits(cfg)))
    if cfg.idempotency.enabled:                    # issue 10: done-markers and leases
        backoff = cfg.workers.retry_backoff
        chain.append(("[idempotency]", IdempotencyGuard(cfg.idempotency.bucket,
                                                        lambda delivery: retry_delay(backoff, delivery))))
    return chain
