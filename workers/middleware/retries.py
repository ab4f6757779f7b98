"""How long a failed job waits before its next delivery (pure: no clock, no I/O)."""

from __future__ import annotations


def retry_delay(backoff: tuple[float, ...], delivery: int) -> float:
    """workers.retry_backoff by delivery count: the n-th delivery's failure waits backoff[n-1],
    the last delay repeating; no list, no wait."""
    if not backoff:
        return 0.0
    return backoff[min(delivery, len(backoff)) - 1]
