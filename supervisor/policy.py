"""Pure restart policy: backoff per slot and the boot-failure halt. No clocks read here."""

from __future__ import annotations

import random
from dataclasses import dataclass

HEALTHY_AFTER = 10.0        # seconds ready before a slot's backoff starts over


@dataclass
class SlotBackoff:
    """Exponential restart delay for one slot: initial, 2x, 4x ... up to maximum."""
    initial: float
    maximum: float
    failures: int = 0

    def next_delay(self) -> float:
        delay = min(self.maximum, self.initial * 2 ** min(self.failures, 64)) if self.initial > 0 else 0.0
        self.failures += 1
        return delay

    def worker_exited(self, ready_for: float | None) -> None:
        """A worker that had been healthy for a while earns its slot a fresh start."""
        if ready_for is not None and ready_for >= HEALTHY_AFTER:
            self.failures = 0


@dataclass
class BootFailures:
    """Consecutive workers that died before becoming ready; too many and we halt (exit 5)."""
    limit: int
    count: int = 0
    last_reason: str = ""

    def died_before_ready(self, reason: str) -> None:
        self.count += 1
        self.last_reason = reason

    def worker_ready(self) -> None:
        self.count = 0

    @property
    def halted(self) -> bool:
        return self.count >= self.limit


def job_limit(max_jobs: int, jitter: int, rng: random.Random | None = None) -> int:
    """Jobs a new worker may start before it is recycled (0 = never); jitter spreads the
    recycling of workers started together so they do not all go at once."""
    if max_jobs <= 0:
        return 0
    return max_jobs + (rng or random).randint(0, jitter) if jitter > 0 else max_jobs
