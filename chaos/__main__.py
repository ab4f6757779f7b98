"""`python -m chaos [--quick] [--only NAME ...] [--repeat N] [--seed S] [--out DIR] [--keep]`
`python -m chaos --random [--seed N | --seeds A-B] [--minutes M] [--out DIR] [--keep]`

Runs the fault matrix (chaos/scenarios.py) against real nats-servers on loopback, checks each
run with the one checker (chaos/checker.py), prints a verdict table and writes
OUT/results.json, OUT/table.md and, for each failed run, its journal and supervisor logs.
With --random, each seed draws a configuration and a fault schedule instead
(chaos/randomized.py): `--seed N` replays that draw. Exits 0 when every run passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import (
    REPO,
    scenarios,  # noqa: F401  (registers the scenarios)
)
from .core import SCENARIOS, Result, run_scenario
from .randomized import draw, parse_seeds, run_random
from .report import render


def code_state() -> dict[str, object]:
    """The commit measured, and any uncommitted change to the product."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": git("rev-parse", "--short", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "uncommitted": git("status", "--porcelain", "--", "supervisor", "workers").splitlines()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chaos", description=__doc__.split("\n\n")[1])
    p.add_argument("--quick", action="store_true", help="smaller loads and fewer faults")
    p.add_argument("--only", nargs="+", metavar="NAME", help=f"run only these: {', '.join(SCENARIOS)}")
    p.add_argument("--repeat", type=int, default=1, metavar="N", help="run each scenario N times")
    p.add_argument("--seed", type=int, help="seed for every run's random choices (default: random, printed)")
    p.add_argument("--random", action="store_true", help="draw a configuration and fault schedule from each seed")
    p.add_argument("--seeds", metavar="A-B", help="with --random: run these seeds one after the other (e.g. 1-20 or 3,7)")
    p.add_argument("--minutes", type=float, default=1.0, help="with --random: length of each run (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("chaos/results"), help="where to write results (default %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep each run's work directory")
    args = p.parse_args(argv)
    unknown = [n for n in args.only or () if n not in SCENARIOS]
    if unknown or args.repeat < 1:
        p.error(f"unknown scenario {unknown[0]!r}; choose from {', '.join(SCENARIOS)}" if unknown
                else "--repeat must be at least 1")
    if (args.seeds or args.minutes != 1.0) and not args.random:
        p.error("--seeds and --minutes go with --random")
    if args.random and (args.only or args.quick or args.repeat != 1 or (args.seed is not None and args.seeds)):
        p.error("--random takes --seed N or --seeds A-B, not --only, --quick, --repeat")
    if args.minutes <= 0:
        p.error("--minutes must be positive")
    try:
        seeds = parse_seeds(args.seeds) if args.seeds else []
    except ValueError:
        p.error(f"--seeds {args.seeds!r}: expected N, A-B or a comma-separated list of them")

    state = code_state()
    args.out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="jschaos-"))
    started = time.monotonic()
    results = []
    try:
        if args.random:
            results = run_seeds(seeds or [args.seed if args.seed is not None else int.from_bytes(os.urandom(3))],
                                args.minutes, root, args.out)
        else:
            for name in args.only or list(SCENARIOS):
                for i in range(args.repeat):
                    tag = f"{name}-{i}" if args.repeat > 1 else name
                    print(f"== {tag}", flush=True)
                    r = run_scenario(name, root / tag, quick=args.quick, seed=args.seed, logs_to=args.out / tag)
                    print(r.summary(), flush=True)
                    results.append(r)
    finally:
        if args.keep:
            print(f"work directories kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    meta = {"command": "python -m chaos " + " ".join(argv if argv is not None else sys.argv[1:]),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "seconds": round(time.monotonic() - started), "quick": args.quick, **state}
    table = render(results, meta)
    print("\n" + table)
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "runs": [r.as_dict() for r in results]},
                                                      indent=1, default=str) + "\n")
    (args.out / "table.md").write_text(table)
    return 0 if all(r.passed for r in results) else 1


def run_seeds(seeds: list[int], minutes: float, root: Path, out: Path) -> list[Result]:
    """One randomized run per seed, one at a time; each prints its draw first."""
    results = []
    for seed in seeds:
        tag = f"random-{seed}"
        print(f"== {tag}: {draw(seed, minutes).describe()}", flush=True)
        r = run_random(seed, minutes, root / tag, logs_to=out / tag)
        print(r.summary() + (f"\n  replay: python -m chaos --random --seed {seed} --minutes {minutes:g}"
                             if not r.passed else ""), flush=True)
        results.append(r)
    return results


if __name__ == "__main__":
    sys.exit(main())
