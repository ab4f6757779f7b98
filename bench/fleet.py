"""`python -m bench.fleet costs|loss`: measurements of the fleet on a real 3-node cluster.

- `costs`: cluster CPU (all three nodes, from /proc) per operation the fleet makes: a
  ConsumerInfo request, a KV put on an R3 bucket, a KV watch delivery, a core NATS delivery.
  bench/fleet_sim.py turns its loads into CPU with these.
- `loss`: a whole supervisor SIGKILLed (parent and workers) while its workers run jobs: how long
  until the other supervisor runs those jobs again, with `fleet.release_lost` on (the lost
  host's jobs are NAKed once it is declared lost) and off (AckWait), for short and long jobs.

The cluster and the supervisors are the test suite's (tests/support/natscluster.py, tests/support/harness.py):
the same processes the cluster tests run, measured instead of asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests" / "support"), str(REPO / "tests" / "handlers")]

from harness import SupervisorProc, base_config, wait_until  # noqa: E402
from natscluster import NatsCluster, SteadyPublisher  # noqa: E402


def cluster_cpu(cluster: NatsCluster) -> float:
    return sum(sum(psutil.Process(n.proc.pid).cpu_times()[:2]) for n in cluster.nodes)


# ---------------------------------------------------------------- costs

async def measure_costs(cluster: NatsCluster, n: int) -> dict[str, float]:
    import nats
    from nats.js import api

    nc = await nats.connect(servers=cluster.urls)
    js = nc.jetstream()
    await js.add_stream(api.StreamConfig(name="JOBS", subjects=["jobs.>"], num_replicas=3,
                                         retention=api.RetentionPolicy.WORK_QUEUE))
    await js.add_consumer("JOBS", api.ConsumerConfig(durable_name="workers", ack_policy=api.AckPolicy.EXPLICIT))
    for _ in range(1000):
        await js.publish("jobs.x", b"x")
    kv = await js.create_key_value(bucket="FLEET", history=1, ttl=3600, replicas=3)
    beat = json.dumps({"held": [[i, 1, 1.0, f"$JS.ACK.JOBS.workers.1.{i}.{i}.1796000000000000000.0", "running"]
                                for i in range(16)], "name": "host-01"}).encode()       # a 16-worker host's beat
    out = {}

    async def per_op(name: str, op, count: int = n) -> None:
        """One at a time: hosts ask independently, so nothing is batched for them either."""
        before = cluster_cpu(cluster)
        for i in range(count):
            await op(i)
        out[name] = (cluster_cpu(cluster) - before) / count * 1e6

    await per_op("consumer_info", lambda i: js.consumer_info("JOBS", "workers"))
    await per_op("kv_put", lambda i: kv.put(f"sup.h{i % 100}", beat))
    watchers = [await watcher(cluster.urls) for _ in range(20)]
    before = cluster_cpu(cluster)
    for i in range(n):              # paced like heartbeats, so no watcher falls behind and resets
        await kv.put(f"sup.h{i % 100}", beat)
    wait_s = time.monotonic() + 60
    while sum(w[2]["n"] - w[2]["initial"] for w in watchers) < 20 * n and time.monotonic() < wait_s:
        await asyncio.sleep(0.05)
    delivered = sum(w[2]["n"] for w in watchers) - sum(w[2]["initial"] for w in watchers)
    out["kv_delivery"] = max(0.0, (cluster_cpu(cluster) - before) * 1e6 - n * out["kv_put"]) / max(1, delivered)
    subs = [await nats.connect(servers=cluster.urls) for _ in range(20)]
    got = {"n": 0}

    async def count(msg: Any) -> None:
        got["n"] += 1
    for s in subs:
        await s.subscribe("supervisor.fleet.JOBS.workers", cb=count)
        await s.flush()
    await nc.flush()
    before = cluster_cpu(cluster)
    for _ in range(n):
        await nc.publish("supervisor.fleet.JOBS.workers", beat[:400])
    await nc.flush()
    while got["n"] < 20 * n and time.monotonic() < wait_s + 60:
        await asyncio.sleep(0.05)
    out["core_delivery"] = (cluster_cpu(cluster) - before) / (20 * n) * 1e6
    for wnc, task, _ in watchers:
        task.cancel()
        await wnc.close()
    for s in subs:
        await s.close()
    await nc.close()
    return out


async def watcher(urls: list[str]) -> tuple[Any, asyncio.Task, dict]:
    import nats

    nc = await nats.connect(servers=urls)
    kv = await nc.jetstream().key_value("FLEET")
    w = await kv.watch("sup.>")
    count = {"n": 0, "initial": 0}

    async def drain() -> None:
        async for entry in w:
            if entry is None:
                count["initial"] = count["n"]       # the values already there, before we measure
            else:
                count["n"] += 1
    task = asyncio.ensure_future(drain())
    while not w._init_done:
        await asyncio.sleep(0.01)
    return nc, task, count


def cmd_costs(args: argparse.Namespace) -> dict:
    runs = []
    for _rep in range(args.reps):
        with NatsCluster(Path(tempfile.mkdtemp(prefix="fleet-costs-")) / "c").start() as cluster:
            runs.append(asyncio.run(measure_costs(cluster, args.n)))
    return {k: round(statistics.median(r[k] for r in runs), 1) for k in runs[0]}


# ---------------------------------------------------------------- loss

def supervisor(root: Path, cluster: NatsCluster, name: str, ack_wait: float, release: bool,
               workers: int) -> SupervisorProc:
    sub = root / name
    sub.mkdir()
    cfg = base_config(None, sub, nats={"servers": cluster.urls, "startup_timeout": 30.0},
                      stream={"replicas": 3}, consumer={"ack_wait": ack_wait},
                      fleet={"name": name, "heartbeat": 2.0, "release_lost": release},
                      workers={"count": workers}, monitor={"interval": 1.0})   # http: base_config's port 0
    return SupervisorProc(sub, cfg).start()


def lose_a_host(job_s: float, release: bool, ack_wait: float, kill_poller: bool, seed: int) -> dict:
    """Each host has 4 workers and the load keeps 3 busy, so the survivor alone still has room
    for the lost host's jobs the moment they come back: the delay is the fleet's, not a queue's.
    The kill comes at a random moment once the load is steady."""
    import random

    root = Path(tempfile.mkdtemp(prefix="fleet-loss-"))
    with NatsCluster(root / "cluster").start() as cluster:
        sups = []
        try:
            sups.append(supervisor(root, cluster, "alpha", ack_wait, release, 4))
            sups[0].wait_ready()
            sups.append(supervisor(root, cluster, "beta", ack_wait, release, 4))
            sups[1].wait_ready()
            count = int(3 * (ack_wait + 30 + 3 * job_s) / job_s)   # load until well past AckWait
            pub = SteadyPublisher(cluster.urls, count=count, rate=3 / job_s, data=str(job_s)).start()
            poller = wait_until(lambda: next((s for s in sups if (s.try_status() or {}).get("fleet", {}).get(
                "is_poller")), None), 30, "a poller")
            victim = poller if kill_poller else next(s for s in sups if s is not poller)
            survivor = next(s for s in sups if s is not victim)
            time.sleep(2 * job_s + random.Random(seed).uniform(0, job_s))    # a random moment, not a sync
            wait_until(lambda: victim.jobs.running(), 60, "the victim running a job")
            killed_at = time.time()
            os.killpg(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait()
            running = {r.seq for r in victim.jobs.running()}

            def back() -> dict[int, float] | None:
                again = {r.seq: r.t for r in survivor.jobs.started() if r.seq in running and r.delivery > 1}
                return again if set(again) == running else None
            again = wait_until(back, ack_wait + 60, "the victim's jobs run again")
            pub.stop()
            log = survivor.log()
        finally:
            for s in sups:
                s.cleanup()
    lost_at = next((logged_at(line) for line in log.splitlines() if " is lost: " in line), None)
    jobs = [{"seq": seq, "back_after_s": round(t - killed_at, 2),
             "listed": bool(re.search(rf"job seq={seq} redelivered .*held by lost supervisor", log))}
            for seq, t in sorted(again.items())]
    return {"job_s": job_s, "release_lost": release, "ack_wait": ack_wait,
            "victim": "poller" if kill_poller else "member", "jobs": jobs,
            "declared_lost_after_s": round(lost_at - killed_at, 2) if lost_at else None}


def logged_at(line: str) -> float:
    """The epoch time of a text log line ("2026-11-30 22:09:58.999 [pid] ...")."""
    stamp, _, millis = line[:23].partition(".")
    return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000


def cmd_loss(args: argparse.Namespace) -> list[dict]:
    out = []
    for job_s in args.jobs:
        for release in (True, False):
            for rep in range(args.reps):
                out.append(lose_a_host(job_s, release, args.ack_wait, kill_poller=False, seed=rep))
                print(json.dumps(out[-1]), flush=True)
    for rep in range(args.reps):
        out.append(lose_a_host(max(args.jobs), True, args.ack_wait, kill_poller=True, seed=rep))
        print(json.dumps(out[-1]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("costs", help="cluster CPU per fleet operation")
    c.add_argument("--n", type=int, default=3000)
    c.add_argument("--reps", type=int, default=3)
    loss = sub.add_parser("loss", help="a host SIGKILLed: how long until its jobs run again")
    loss.add_argument("--jobs", type=float, nargs="+", default=[0.2, 5.0], help="job durations (s)")
    loss.add_argument("--ack-wait", type=float, default=30.0)
    loss.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    result = cmd_costs(args) if args.what == "costs" else cmd_loss(args)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
