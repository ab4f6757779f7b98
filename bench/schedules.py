"""`python -m bench.schedules`: how NATS message schedules keep time (README "Later and every").

On the pinned nats-server, with a plain pull consumer reading each fired job's stored time (the
server's clock, so no worker's latency is in the numbers):
- `@at` lateness: 40 one-shot schedules due over one second, stored time minus due time;
- `@every 1s` and a 6-field cron: how far past the whole second they fire, and their intervals;
- a server down for 6 s (file store, SIGTERM, same store back): what fires when it returns, and
  an `@at` that fell due while it was down;
- a 3-node cluster (R3 stream): three stream-leader step-downs and one leader SIGKILL while
  `@every 1s` runs: seconds with no tick, seconds with two.

The servers are the test suite's (tests/support/harness.py, tests/support/natscluster.py). One
run's numbers, on whatever load the machine has: not a bound.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests" / "support"), str(REPO)]

import nats  # noqa: E402
from harness import NatsServer  # noqa: E402
from nats.js import api  # noqa: E402
from natscluster import NatsCluster  # noqa: E402

from supervisor.config import schedules as sched  # noqa: E402

DOWN_S = 6.0
Fired = tuple[float, str, dict[str, str]]       # (stored at, subject, headers)


async def queue(js: Any, replicas: int = 1) -> Any:
    """The stream as the supervisor makes it, and a consumer on the job subjects only."""
    await js.add_stream(api.StreamConfig(name="JOBS", subjects=["jobs.>", sched.space_filter("JOBS")],
                                         retention=api.RetentionPolicy.WORK_QUEUE, allow_msg_schedules=True,
                                         allow_rollup_hdrs=True, num_replicas=replicas))
    await js.add_consumer("JOBS", api.ConsumerConfig(durable_name="m", ack_policy=api.AckPolicy.EXPLICIT,
                                                     filter_subject="jobs.>", num_replicas=replicas))
    return await js.pull_subscribe_bind("m", stream="JOBS")


async def read(sub: Any, seconds: float) -> list[Fired]:
    """Every job stored over the next `seconds`, with the server's time of storing it."""
    out: list[Fired] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            msgs = await sub.fetch(50, timeout=min(1.0, max(0.05, end - time.monotonic())))
        except Exception:     # a timeout, or the cluster electing: read on
            continue
        for m in msgs:
            out.append((m.metadata.timestamp.timestamp(), m.subject, dict(m.headers or {})))
            await m.ack()
    return out


def spread(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"n={len(xs)} min={xs[0] * 1000:.0f}ms median={statistics.median(xs) * 1000:.0f}ms max={xs[-1] * 1000:.0f}ms"


async def schedule(js: Any, subject: str, pattern: str, target: str) -> None:
    await js.publish(subject, b"", headers={sched.PATTERN: pattern, sched.TARGET: target})


async def on_one_server(url: str) -> float:
    """The single-server measurements; the due time of an @at left to fall due while the server is down."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    sub = await queue(js)
    due: dict[str, float] = {}
    start = time.time() + 2
    for i in range(40):
        when = dt.datetime.fromtimestamp(start + i * 0.025, dt.UTC)
        subject = sched.delayed_subject("JOBS", f"m{i}")
        due[subject] = when.timestamp()
        await schedule(js, subject, sched.at_pattern(when), "jobs.at")
    late = [t - due[h[sched.SCHEDULER]] for t, _, h in await read(sub, 5)]
    print(f"@at, stored minus due: {spread(late)}; early: {sum(x < 0 for x in late)}")
    await schedule(js, sched.named_subject("JOBS", sched.CONFIG, "tick"), "@every 1s", "jobs.tick")
    ticks = [t for t, _, _ in await read(sub, 8)]
    print(f"@every 1s: {len(ticks)} in 8 s; past the whole second: {spread([t % 1 for t in ticks])}; "
          f"intervals: {spread([b - a for a, b in zip(ticks, ticks[1:])])}")
    await schedule(js, sched.named_subject("JOBS", sched.CONFIG, "cron"), "*/2 * * * * *", "jobs.cron")
    crons = [t for t, s, _ in await read(sub, 7) if s == "jobs.cron"]
    print(f"cron */2 s: past the even second: {spread([t % 2 for t in crons])}")
    await js.purge_stream("JOBS", subject=sched.named_subject("JOBS", sched.CONFIG, "cron"))
    when = dt.datetime.fromtimestamp(time.time() + 2, dt.UTC)
    await schedule(js, sched.delayed_subject("JOBS", "down"), sched.at_pattern(when), "jobs.down")
    await read(sub, 1.5)
    await nc.close()
    return when.timestamp()


async def after_restart(url: str, down_due: float, up_at: float) -> None:
    nc = await nats.connect(url)
    fired = await read(await nc.jetstream().pull_subscribe_bind("m", stream="JOBS"), 5)
    await nc.close()
    ticks = [t for t, s, _ in fired if s == "jobs.tick"]
    down = [t for t, s, _ in fired if s == "jobs.down"]
    first = f"the first {ticks[0] - up_at:.2f} s after it was back ({(ticks[0] % 1) * 1000:.0f} ms past a second)" \
        if ticks else "none"
    print(f"server down {DOWN_S:g} s: @every 1s ticks in the 5 s back: {len(ticks)}, {first}; "
          f"the @at due while down fired {len(down)}x" + (f", {down[0] - down_due:.2f} s after due" if down else ""))


async def quiet(exc: Exception) -> None:
    """nats-py's default logs a traceback for each failed reconnect to the killed node."""


async def in_a_cluster(cluster: NatsCluster) -> None:
    nc = await nats.connect(cluster.urls, error_cb=quiet)
    js = nc.jetstream()
    sub = await queue(js, replicas=3)
    await schedule(js, sched.named_subject("JOBS", sched.CONFIG, "tick"), "@every 1s", "jobs.tick")
    reading = asyncio.ensure_future(read(sub, 24))
    moves = []
    for _ in range(3):
        await asyncio.sleep(5)           # the fault schedule, not a synchronisation
        moves.append(time.time())
        await nc.request("$JS.API.STREAM.LEADER.STEPDOWN.JOBS", b"", timeout=5)
    await asyncio.sleep(3)
    leader = await asyncio.to_thread(cluster.stream_leader, "JOBS")
    moves.append(time.time())
    leader.kill()
    ticks = sorted(t for t, s, _ in await reading if s == "jobs.tick")
    await nc.close()
    leader.restart()
    per: dict[int, int] = {}
    for t in ticks:
        per[int(t)] = per.get(int(t), 0) + 1
    first, last = min(per), max(per)
    print(f"cluster R3, 3 stream-leader step-downs then the leader SIGKILLed (at {[round(m - first) for m in moves]} s)"
          f" over {last - first + 1} s: {len(ticks)} ticks; seconds with none: "
          f"{[s - first for s in range(first, last + 1) if s not in per]}; seconds with two: "
          f"{[s - first for s, n in per.items() if n > 1]}")


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="jsbench-schedules-"))
    server = NatsServer(root / "store").start()
    try:
        down_due = asyncio.run(on_one_server(server.url))
        server.stop()
        time.sleep(DOWN_S)               # the outage being measured
        server.start()
        asyncio.run(after_restart(server.url, down_due, time.time()))
    finally:
        server.stop()
    with NatsCluster(root / "cluster").start() as cluster:
        asyncio.run(in_a_cluster(cluster))


if __name__ == "__main__":
    main()
