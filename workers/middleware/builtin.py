"""A worker's middleware, made after fork: the `workers.middleware` entries (classes the parent
imported and checked before forking) in list order, outermost first, then the built-ins the
config turns on, innermost (closest to the handler): the [idempotency] guard, then the soft time
limit, which wraps the handler alone."""

from __future__ import annotations

from collections.abc import Sequence

from supervisor.config import Config
from workers.middleware.base import Middleware
from workers.middleware.guard import IdempotencyGuard
from workers.middleware.retries import Policy
from workers.middleware.timeouts import soft_timeout


def instances(entries: Sequence[tuple[str, type[Middleware]]], cfg: Config, is_async: bool
              ) -> list[tuple[str, Middleware]]:
    """(name, instance) for each middleware of one worker, outermost first."""
    chain = [(name, cls()) for name, cls in entries]
    if cfg.idempotency.enabled:                    # issue 10: done-markers and leases
        chain.append(("[idempotency]", IdempotencyGuard(cfg.idempotency.bucket, Policy.from_config(cfg).delay)))
    if cfg.workers.soft_timeout:
        chain.append(("workers.soft_timeout", soft_timeout(cfg.workers.soft_timeout, is_async)))
    return chain
