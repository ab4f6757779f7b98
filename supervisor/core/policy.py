"""Pure restart policy: per-slot backoff, crash storms, the boot-failure halt, recycling limits.
No clock is read here: every time comes in as an argument.

The restart rule tells a crash loop from sporadic deaths (issue 18). A worker that dies before
it did any work (never ready, or ready but never finished a job and not up for HEALTHY_AFTER)
is a crash loop: its slot backs off exponentially, and deaths before ready feed the boot halt.
A worker that did useful work and then died (a SIGKILL, the OOM killer, a rare native crash in
a handler, a hang the heartbeat caught) is restarted after `backoff_initial`, however often it
happens, like gunicorn and Celery do: throttling a busy pool for deaths that are not a loop
only turns it off. A high death rate raises an alert instead (`DeathRate`).
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field

HEALTHY_AFTER = 10.0        # seconds ready that count as useful work even with no job finished
STORM_WINDOW = 60.0         # deaths are counted over this many seconds ...
STORM_MIN_DEATHS = 5        # ... and this many (or one per worker, if more) make a storm


def ack_wait_for(ack_wait: float, backoff: tuple[float, ...], delivery: int) -> float:
    """The AckWait the server applies to a delivery: with consumer.backoff set, backoff[0] for the
    first delivery (it replaces AckWait), backoff[d-1] for delivery d, the last one thereafter."""
    if backoff:
        return backoff[min(delivery, len(backoff)) - 1]
    return ack_wait


def nak_is_safe(now: float, timer_started: float, ack_wait: float) -> bool:
    """A NAK (or TERM) sent for a delivery whose AckWait has (nearly) run out may hit the job's
    next delivery, held by someone else: NAKs match by stream sequence. Keep a margin."""
    return now < nak_safe_until(timer_started, ack_wait)


def nak_safe_until(timer_started: float, ack_wait: float) -> float:
    """The moment a NAK for this delivery stops being safe (nak_is_safe)."""
    return timer_started + ack_wait - min(1.0, 0.1 * ack_wait)


def did_useful_work(ready_for: float | None, jobs_finished: int) -> bool:
    """A worker that finished a job, or stayed ready a while, was not crash-looping."""
    return ready_for is not None and (jobs_finished > 0 or ready_for >= HEALTHY_AFTER)


@dataclass
class SlotBackoff:
    """Restart delay for one slot: `initial` after a death that followed useful work; initial,
    2x, 4x ... up to `maximum` for consecutive deaths that did none."""
    initial: float
    maximum: float
    failures: int = 0           # consecutive deaths without useful work

    def after_death(self, useful: bool) -> float:
        if useful:
            self.failures = 0
            return self.initial
        delay = min(self.maximum, self.initial * 2 ** min(self.failures, 64)) if self.initial > 0 else 0.0
        self.failures += 1
        return delay


@dataclass
class DeathRate:
    """Worker deaths over the last STORM_WINDOW seconds, with their causes; a storm is a rate an
    operator must hear about (the pool keeps restarting at full speed meanwhile)."""
    window: float = STORM_WINDOW
    deaths: deque = field(default_factory=deque)        # (time, cause)

    def died(self, t: float, cause: str) -> None:
        self.deaths.append((t, cause))
        self._trim(t)

    def _trim(self, now: float) -> None:
        while self.deaths and now - self.deaths[0][0] > self.window:
            self.deaths.popleft()

    def per_minute(self, now: float) -> float:
        self._trim(now)
        return len(self.deaths) * 60.0 / self.window

    def storm(self, now: float, workers: int) -> bool:
        self._trim(now)
        return len(self.deaths) >= max(STORM_MIN_DEATHS, workers)

    def describe(self, now: float) -> str:
        """'12 deaths in the last 60s: 9x signal SIGKILL, 3x exit code 70'"""
        self._trim(now)
        causes = Counter(_cause_kind(c) for _, c in self.deaths)
        top = ", ".join(f"{n}x {c}" for c, n in causes.most_common(3))
        return f"{len(self.deaths)} worker deaths in the last {self.window:g}s ({top})"


def _cause_kind(cause: str) -> str:
    """The part of a death cause that is the same across deaths ('signal SIGKILL', not its job)."""
    return cause.split(":")[0].split(" (")[0]


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


class RestartPolicy:
    """Every restart decision of the arbiter, in one pure place: per-slot backoff, the boot halt,
    the crash-storm alert. Recycled and drained workers exit cleanly and never come here."""

    def __init__(self, initial: float, maximum: float, boot_failures_to_halt: int):
        self.initial, self.maximum = initial, maximum
        self.boot = BootFailures(boot_failures_to_halt)
        self.slots: dict[int, SlotBackoff] = {}
        self.rate = DeathRate()

    def configure(self, initial: float, maximum: float, boot_failures_to_halt: int) -> None:
        """A reload: new bounds, every slot starts over."""
        self.initial, self.maximum, self.boot.limit = initial, maximum, boot_failures_to_halt
        self.slots.clear()

    def died(self, t: float, slot: int, cause: str, ready_for: float | None, jobs_finished: int,
             nats_down: bool = False) -> float:
        """A worker died (not a clean exit); returns how long its slot waits before a restart.
        `nats_down`: it could not reach NATS while the supervisor is reconnecting too. That is
        the outage, not the worker: it backs off but does not count towards the boot halt, or a
        worker dying during a long outage would stop the whole supervisor (exit 5)."""
        self.rate.died(t, cause)
        if ready_for is None and not nats_down:
            self.boot.died_before_ready(f"worker {slot}: {cause}")
        backoff = self.slots.setdefault(slot, SlotBackoff(self.initial, self.maximum))
        return backoff.after_death(did_useful_work(ready_for, jobs_finished))

    def ready(self) -> None:
        self.boot.worker_ready()

    @property
    def halted(self) -> bool:
        return self.boot.halted


def job_limit(max_jobs: int, jitter: int, rng: random.Random | None = None) -> int:
    """Jobs a new worker may start before it is recycled (0 = never); jitter spreads the
    recycling of workers started together so they do not all go at once."""
    if max_jobs <= 0:
        return 0
    return max_jobs + (rng or random).randint(0, jitter) if jitter > 0 else max_jobs
