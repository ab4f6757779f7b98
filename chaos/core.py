"""Scenarios, how one is run, and what a run yields.

A scenario is a function of a `Run` (chaos/rig.py) that starts what it needs, puts a load on
it and injects its faults; `run_scenario` then settles the queue, stops everything and checks
the run. Its expectations say which verdicts must be zero (chaos/checker.py VERDICTS) and
which are only reported.
"""

from __future__ import annotations

import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checker import VERDICTS, Finding
from .rig import Run


@dataclass(frozen=True)
class Scenario:
    name: str
    fn: Callable[[Run], None]
    doc: str
    expect: dict[str, Any]
    skip: Callable[[], str] | None = None    # returns why it cannot run here ("" = it can)


SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, *, expect: dict[str, Any] | None = None,
             skip: Callable[[], str] | None = None) -> Callable[[Callable[[Run], None]], Callable[[Run], None]]:
    def register(fn: Callable[[Run], None]) -> Callable[[Run], None]:
        SCENARIOS[name] = Scenario(name, fn, (fn.__doc__ or "").strip().split("\n\n")[0].replace("\n", " "),
                                   {**VERDICTS, **(expect or {})}, skip)
        return fn
    return register


@dataclass
class Result:
    name: str
    seed: int
    passed: bool = False
    skipped: str = ""
    error: str = ""
    counts: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    seconds: float = 0.0
    plan: str = ""                  # a randomized run's draw (chaos/randomized.py Plan.describe)

    def summary(self) -> str:
        """A few lines a person (or a failing test) can act on."""
        if self.skipped:
            return f"{self.name}: skipped ({self.skipped})"
        head = f"{self.name} (seed {self.seed}): {'PASS' if self.passed else 'FAIL'} in {self.seconds:.0f}s"
        lines = [head, *([f"  drew {self.plan}"] if self.plan and not self.passed else []),
                 "  " + " ".join(f"{k}={round(v, 2) if isinstance(v, float) else v}"
                                 for k, v in self.counts.items() if v is not None)]
        lines += [f"  FAIL {f}" for f in self.failures]
        if self.error:
            lines.append(f"  error: {self.error}")
        lines += [f"  note: {n}" for n in self.notes]
        # The findings behind a failed verdict first, then the rest (redeliveries, explained duplicates).
        failed = {f.split("=")[0] for f in self.failures}
        shown = sorted(self.findings, key=lambda f: f.verdict not in failed)[:12]
        lines += [f"  {f.verdict} seq={f.seq} {f.key}: {f.text}" for f in shown]
        lines += [f"  fault: {f}" for f in self.faults[:20]]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "seed": self.seed, "passed": self.passed, "skipped": self.skipped,
                "error": self.error, "counts": self.counts, "failures": self.failures, "notes": self.notes,
                "faults": self.faults, "seconds": round(self.seconds, 1), "plan": self.plan,
                "findings": [f.__dict__ for f in self.findings]}


def run_scenario(name: str, workdir: Path, quick: bool = True, seed: int | None = None,
                 logs_to: Path | None = None) -> Result:
    """Run one scenario in `workdir` and check it. With `logs_to`, a failed run's journal and
    supervisor logs are copied there."""
    sc = SCENARIOS[name]
    seed = random.randrange(1 << 30) if seed is None else seed
    reason = sc.skip() if sc.skip else ""
    if reason:
        return Result(name, seed, passed=True, skipped=reason)
    return run_with(name, seed, sc.fn, sc.expect, workdir, quick, logs_to)


def run_with(name: str, seed: int, fn: Callable[[Run], None], expect: dict[str, Any], workdir: Path,
             quick: bool = True, logs_to: Path | None = None, plan: str = "") -> Result:
    """Run `fn` (a scenario, or a randomized plan) in `workdir`, settle, check against `expect`."""
    result = Result(name, seed, plan=plan)
    started = time.monotonic()
    run = Run(name, workdir, quick)
    run.rng = random.Random(seed)
    try:
        try:
            fn(run)
        except Exception as exc:      # the scenario could not finish its schedule: still check what happened
            result.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            result.notes.append("".join(traceback.format_exception(exc)[-3:]).strip()[-600:])
        report = run.finish()
        result.counts, result.findings = report.counts, report.findings
        result.notes += run.notes + report.notes
        result.failures = report.failures(expect)
        result.passed = not result.failures and not result.error
    except Exception as exc:
        result.error = result.error or f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        result.notes.append("".join(traceback.format_exception(exc)[-3:]).strip()[-600:])
    finally:
        result.faults = [f.name(run.origin) for f in run.faults]
        if logs_to is not None and not result.passed:
            run.keep_logs(logs_to)
        run.close()
        result.seconds = time.monotonic() - started
    return result
