"""Fault hook for the parent's loop (issue 22), in the tests only: nothing in the product reads it.

The supervisor imports its handler module in the parent (to fail with exit 3 before forking
anything), so a handler module can reach into the parent. This one wraps, at import time, the
function behind each step of `Arbiter.tick`: while the file $STEP_TRAPS/<step> exists, that
function raises. The exception comes from inside the real call chain, so the loop's isolation is
tested as a real NATS error would meet it. Workers inherit the patches by fork and never call
these functions. `record` is tests/testhandlers.py's, so the job log works as usual.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from pathlib import Path

from testhandlers import record  # noqa: F401  (the handler the test's config names)

TRAPS = Path(os.environ.get("STEP_TRAPS", "/nonexistent"))

# step -> (module, class, method) whose failure is that step's failure
TARGETS = {
    "restore_count": ("supervisor.parent.pool", "Pool", "restore_count"),
    "sleep": ("supervisor.parent.arbiter", "Arbiter", "sleep_timeout"),
    "signals": ("supervisor.parent.arbiter", "Arbiter", "dispatch_signals"),
    "posted": ("supervisor.parent.arbiter", "Arbiter", "apply_posted"),
    "reap": ("supervisor.parent.safety.deaths", "Deaths", "settle"),               # the NATS side of a death
    "held_back_naks": ("supervisor.parent.safety.deaths", "Deaths", "send_held_back"),
    "nats_back": ("supervisor.parent.pool", "Pool", "nats_back"),
    "inspect": ("supervisor.parent.safety.watch", "Watch", "inspect"),
    "watchdog": ("supervisor.parent.systemd", "Notifier", "watchdog"),
    "recycle": ("supervisor.parent.pool", "Pool", "recycle"),
    "autoscale": ("supervisor.parent.scaler", "Scaler", "tick"),
    "boot_halt": ("supervisor.parent.arbiter", "Arbiter", "check_boot_failures"),
    "audit": ("supervisor.parent.safety.deaths", "Deaths", "renak_unseen"),
}


class Injected(RuntimeError):
    pass


def _check(step: str) -> None:
    if (TRAPS / step).exists():
        raise Injected(f"failure injected into step {step}")


def _trap(step: str, module: str, cls: str, name: str) -> None:
    owner = getattr(importlib.import_module(module), cls)
    original = getattr(owner, name, None)
    if original is None:
        return                          # not in this version of the code: that step cannot be trapped
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def wrapper(*args, **kwargs):
            _check(step)
            return await original(*args, **kwargs)
    else:
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            _check(step)
            return original(*args, **kwargs)
    setattr(owner, name, wrapper)


if TRAPS.is_dir():
    for _step, _where in TARGETS.items():
        _trap(_step, *_where)
