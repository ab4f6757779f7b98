"""[retry]: what a failed job costs, by the exception it raised. Pure: no clock, no I/O (the
random draw is passed in), so tests give it a seeded generator.

    attempt n (this delivery, counting the copies a long delay re-published before it)
    the first [[retry.rules]] entry whose `on` matches the exception by MRO, else the defaults
      action = "reject"                  -> dead-letter now
      n >= max_attempts (0: max_deliver) -> dead-letter now, the exception in its headers
      otherwise                          -> retry after delay(n)

    delay(n) = min(max, base * 2**(n-1)) * (1 - jitter * u),  u uniform in [0, 1)
             = workers.retry_backoff[min(n, len) - 1]          when that old list is set (exactly,
                                                                as before: no doubling, no jitter)

A rule's own base/max/jitter (any of them) give it a doubling backoff of its own, the unset ones
taken from [retry]. workers.retry_backoff and [retry]'s base/max/jitter are not set together
(supervisor/config/keys.py says so at start).
"""

from __future__ import annotations

import builtins
import random
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ATTEMPTS_HEADER = "Supervisor-Attempts"    # on a re-published copy: the attempts spent before it


def retry_delay(backoff: tuple[float, ...], delivery: int) -> float:
    """workers.retry_backoff by attempt: the n-th attempt's failure waits backoff[n-1], the last
    delay repeating; no list, no wait."""
    if not backoff:
        return 0.0
    return backoff[min(delivery, len(backoff)) - 1]


def attempt_of(headers: Mapping[str, str], delivery: int) -> int:
    """This delivery's attempt: the delivery count plus what earlier copies spent (a long delay
    re-publishes the job as a new message, whose deliveries count from 1 again)."""
    try:
        before = max(0, int(headers.get(ATTEMPTS_HEADER, "0")))
    except ValueError:
        before = 0
    return before + delivery


@dataclass(frozen=True)
class Backoff:
    base: float
    max: float
    jitter: float

    def delay(self, attempt: int, u: float) -> float:
        return min(self.max, self.base * 2.0 ** min(attempt - 1, 64)) * (1.0 - self.jitter * u)


@dataclass(frozen=True)
class ByAttempt:
    """workers.retry_backoff: the old list of delays, exactly."""
    delays: tuple[float, ...]

    def delay(self, attempt: int, u: float) -> float:
        return retry_delay(self.delays, attempt)


@dataclass(frozen=True)
class Rule:
    index: int                               # its place in [[retry.rules]] (the name logs use)
    on: tuple[type[BaseException], ...]
    reject: bool
    max_attempts: int                        # 0: the policy's limit (consumer.max_deliver)
    backoff: Backoff | ByAttempt


@dataclass(frozen=True)
class Decision:
    delay: float | None                      # None: dead-letter
    reason: str                              # for the log, the ledger, the dead letter's Reason
    attempt: int


class Policy:
    def __init__(self, rules: Sequence[Rule], backoff: Backoff | ByAttempt, max_deliver: int,
                 draw: Callable[[], float] = random.random):
        self.rules, self.backoff, self.draw = tuple(rules), backoff, draw
        self.limit = max_deliver if max_deliver > 0 else 0

    @staticmethod
    def from_config(cfg: Any, draw: Callable[[], float] = random.random) -> Policy:
        """The policy of a config whose rule names resolve (the parent checked: check_names)."""
        r = cfg.retry
        default: Backoff | ByAttempt = (ByAttempt(cfg.workers.retry_backoff) if cfg.workers.retry_backoff
                                        else Backoff(r.base, r.max, r.jitter))
        rules = []
        for k, rule in enumerate(r.rules):
            own = any(v is not None for v in (rule.base, rule.max, rule.jitter))
            backoff = Backoff(*(r_v if v is None else v for v, r_v in ((rule.base, r.base), (rule.max, r.max),
                                                                        (rule.jitter, r.jitter)))) if own else default
            rules.append(Rule(k, tuple(resolve(name) for name in rule.on), rule.action == "reject", rule.max_attempts,
                              backoff))
        return Policy(rules, default, cfg.consumer.max_deliver, draw)

    def rule_for(self, exc: BaseException) -> Rule | None:
        return next((rule for rule in self.rules if isinstance(exc, rule.on)), None)

    def decide(self, exc: BaseException, attempt: int) -> Decision:
        """A handler's failure on this attempt: retry after a delay, or dead-letter."""
        rule = self.rule_for(exc)
        what = describe(exc)
        if rule and rule.reject:
            return Decision(None, f"{what} (retry.rules[{rule.index}]: reject)", attempt)
        limit = rule.max_attempts if rule and rule.max_attempts else self.limit
        if limit and attempt >= limit:
            return Decision(None, f"{what} (attempt {attempt} of {limit})", attempt)
        return Decision((rule.backoff if rule else self.backoff).delay(attempt, self.draw()), what, attempt)

    def delay(self, attempt: int) -> float:
        """The default delay for this attempt: a failure no rule is about (a middleware hook's)."""
        return self.backoff.delay(attempt, self.draw())


def describe(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def qualified(exc: BaseException) -> str:
    """`ValueError`, `json.decoder.JSONDecodeError`: the exception's type as the dead letter names it."""
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def split_name(name: str) -> tuple[str, str]:
    """("pkg.mod", "Error") for "pkg.mod:Error" or "pkg.mod.Error"; ("", "ValueError") for a bare name."""
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    return module_name, attr


def resolve(name: str) -> type[BaseException]:
    """An exception class by name: "ValueError" (a builtin, or workers' own: "SoftTimeout"),
    "pkg.mod:Error" or "pkg.mod.Error", its module imported already (the parent imports it before
    forking: supervisor/parent/supervisor.py). LookupError saying why when there is none."""
    module_name, attr = split_name(name)
    if module_name:
        obj: Any = sys.modules.get(module_name)
        if obj is None:
            raise LookupError(f"module {module_name!r} is not imported")
    else:
        import workers
        obj = builtins if hasattr(builtins, attr) else workers
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise LookupError(f"no exception named {name!r}" + ("" if module_name else " among the builtins"))
    if not (isinstance(obj, type) and issubclass(obj, BaseException)):
        raise LookupError(f"{name!r} is a {type(obj).__name__}, not an exception class")
    return obj


def check_names(rules: Sequence[Any]) -> tuple[str, str] | None:
    """(key, problem) for the first rule name that does not resolve, else None (the parent at start)."""
    for k, rule in enumerate(rules):
        for name in rule.on:
            try:
                resolve(name)
            except LookupError as exc:
                return f"retry.rules[{k}].on", str(exc)
    return None
