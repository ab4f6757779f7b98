"""The parent's loop must outlive any one of its steps (issue 22, R2/R9).

Every step of `Arbiter.run` (restore the count, signals, posted work, reap, held-back NAKs,
inspect, spread, recycle, autoscale, boot halt, audit) runs inside `guard(step)`: an exception there is
logged with its traceback, counted (/status "loop", /metrics
jetstream_supervisor_loop_step_failures_total{step}), raised as an alert, and the loop goes on.
A supervisor that exits because one NATS request timed out leaves its workers to the parent-death
signal and their jobs to AckWait: far worse than one step skipped for one tick.

A step that fails on every tick must neither flood the log nor spin the loop: its traceback is
logged when the failure is new (another exception type or place) and otherwise at most once per
LOG_EVERY with the count in between; and after a tick with a failure the loop sleeps at least
PAUSE (a failing step can leave the loop's reason to wake at once in place: a restart due now, a
dead worker not yet reaped). Signals and worker exits still wake it at once.

With several pools a step runs once per pool (parent/crew.py), each run guarded on its own: one
pool's failure neither skips the step for another pool nor the steps after it. Failures are
counted per step (the pool is in the log line and the alert).

Mechanism only: what each step does is the arbiter's and its rooms' business.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from types import TracebackType

log = logging.getLogger("supervisor")

LOG_EVERY = 60.0        # a step failing the same way again is logged (with its traceback) this often
PAUSE = 0.5             # the shortest sleep after a tick in which a step failed

# The loop's steps, in order (the names /status and /metrics use).
STEPS = ("restore_count", "sleep", "signals", "posted", "reap", "held_back_naks", "nats_back", "inspect",
         "watchdog", "spread", "recycle", "autoscale", "boot_halt", "audit")


def signature(exc: BaseException) -> str:
    """What makes two failures "the same": the exception type and where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
    return f"{type(exc).__name__}@{where}"


class LoopSteps:
    def __init__(self, alert: Callable[[str, str], None], clock: Callable[[], float] = time.monotonic):
        self.alert, self.clock = alert, clock
        self.failures: dict[str, int] = dict.fromkeys(STEPS, 0)
        self.last: dict[str, tuple[float, str]] = {}        # step -> (when, "Type: message") of its last failure
        self._logged: dict[str, tuple[float, str, int]] = {}   # step -> (when, signature, failures then)
        self.failed_this_tick = False

    def guard(self, step: str, pool: str = "") -> _Guard:
        """`with steps.guard("reap"): ...`: an Exception inside is recorded, not raised. `pool`:
        whose step it is (several pools: each pool's run of a step is guarded on its own)."""
        return _Guard(self, step, pool)

    def new_tick(self) -> bool:
        """Start a tick; True if a step failed in the one before (the loop then sleeps PAUSE)."""
        failed, self.failed_this_tick = self.failed_this_tick, False
        return failed

    def failed(self, step: str, exc: BaseException, pool: str = "") -> None:
        now = self.clock()
        whose = f" (pool {pool})" if pool else ""
        self.failures[step] = self.failures.get(step, 0) + 1
        self.failed_this_tick = True
        said = f"{type(exc).__name__}: {exc}"[:300]
        self.last[step] = (now, said)
        sig = signature(exc)
        logged = self._logged.get(step + whose)
        if logged is not None and logged[1] == sig and now - logged[0] < LOG_EVERY:
            return                              # the same failure again: counted, said at the next LOG_EVERY
        since = f"; {self.failures[step] - logged[2] - 1} more failure(s) of this step since it was last logged" \
            if logged is not None and self.failures[step] - logged[2] > 1 else ""
        self._logged[step + whose] = (now, sig, self.failures[step])
        log.error("parent loop: step %s%s failed (%s); the loop goes on%s", step, whose, said, since, exc_info=exc,
                  extra={"event": "loop_step_failed", "step": step, "failures": self.failures[step], "error": said,
                         **({"pool": pool} if pool else {})})
        self.alert("loop_step_failed", f"the supervisor's loop step {step!r}{whose} failed {self.failures[step]} "
                                       f"time(s); last: {said}")

    def status(self) -> dict:
        now = self.clock()
        return {"step_failures": dict(self.failures),
                "last_failure": {step: {"error": said, "age_s": round(now - t, 3)}
                                 for step, (t, said) in self.last.items()}}


class _Guard:
    def __init__(self, steps: LoopSteps, step: str, pool: str = ""):
        self.steps, self.step, self.pool = steps, step, pool

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False                        # CancelledError, KeyboardInterrupt, SystemExit: not ours to stop
        self.steps.failed(self.step, exc, self.pool)
        return True
