"""The baselines, each one worker process: `python -m bench.contenders plain|seed --server URL`.

Each contender's processes share one session (`--launch N` starts N loops as children of one),
as a supervisor's workers do: the kernel's autogroup scheduler shares a busy box's CPU between
sessions.

- plain: the practical ceiling for a Python client. nats-py + uvloop, `fetch(batch=256)` on the
  durable pull consumer, then for each message: the handler, then `msg.ack()` (ack each).
- seed: the seed post's loop, `Fetch(1, MaxWait(500ms))`, process, `m.Ack()`, written with
  nats-py (uvloop too, so the loop and not the event loop is what differs).

Both call bench.handlers.work() inline, as a hand-written loop would. SIGTERM: stop after the
current batch, flush the acks, exit 0.

- bare: no NATS at all, `--count` jobs of `--rounds` spin() back to back, then the seconds it took
  on stdout: what this machine gives for the CPU-bound work alone, the ceiling for scaling.
- publish-async: `--count` one-byte messages to the jobs subject the way nats-py's docs show it,
  `await js.publish_async(...)` in a loop (its own window of 4,000 PubAcks), then
  `await js.publish_async_completed()`: the yardstick for `supervisor publish`.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

import nats
import nats.errors
import uvloop

from .handlers import spin, work
from .natsenv import CONSUMER, STREAM, SUBJECT


async def run(mode: str, server: str, batch: int) -> int:
    nc = await nats.connect(server, name=f"bench {mode}")
    js = nc.jetstream()
    psub = await js.pull_subscribe_bind(CONSUMER, STREAM)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    size, timeout = (batch, 1.0) if mode == "plain" else (1, 0.5)
    while not stop.is_set():
        try:
            msgs = await psub.fetch(size, timeout=timeout)
        except nats.errors.TimeoutError:
            continue
        for msg in msgs:
            work(msg.data, msg.metadata.num_delivered, msg.metadata.sequence.stream)
            await msg.ack()
    await nc.flush()
    await nc.close()
    return 0


async def publish_async(server: str, count: int) -> int:
    nc = await nats.connect(server, name="bench publish-async")
    js = nc.jetstream()
    for _ in range(count):
        await js.publish_async(SUBJECT, b"x")
    await js.publish_async_completed()
    await nc.close()
    return 0


def bare(rounds: int, count: int) -> int:
    started = time.monotonic()
    for _ in range(count):
        spin(rounds)
    print(f"{time.monotonic() - started:.6f}", flush=True)
    return 0


# After a SIGTERM, the launcher SIGKILLs the loops still running this long after passing it on:
# a loop running a hold job (a blocking sleep on its event loop's thread) never gets to its
# SIGTERM handler, and at the bench's death (PDEATHSIG) nobody else would stop it.
LAUNCH_GRACE_S = 5.0


def launch(args: argparse.Namespace) -> int:
    """`--launch N`: N loop processes, children of this one and so in its session (bench/procs.py
    start_loops says why); SIGTERM is passed on to them, and this exits once they all have (those
    left after LAUNCH_GRACE_S are SIGKILLed)."""
    import subprocess
    import threading

    from .natsenv import dies_with_the_bench

    argv = [sys.executable, "-m", "bench.contenders", args.mode, "--server", args.server, "--batch", str(args.batch)]
    children = [subprocess.Popen(argv, preexec_fn=dies_with_the_bench()) for _ in range(args.launch)]

    def kill_left() -> None:
        for c in children:
            if c.poll() is None:
                c.kill()

    def stop(*_: object) -> None:
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        timer = threading.Timer(LAUNCH_GRACE_S, kill_left)
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, stop)
    codes = [c.wait() for c in children]
    return max(codes, default=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.contenders")
    p.add_argument("mode", choices=("plain", "seed", "bare", "publish-async"))
    p.add_argument("--server")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=0)
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--launch", type=int, default=0, metavar="N",
                   help="plain, seed: start N loop processes as children of this one, in its session")
    args = p.parse_args(argv)
    if args.launch:
        return launch(args)
    if args.mode == "bare":
        return bare(args.rounds, args.count)
    if not args.server:
        p.error("--server is required")
    if args.mode == "publish-async":
        return uvloop.run(publish_async(args.server, args.count))
    return uvloop.run(run(args.mode, args.server, args.batch))


if __name__ == "__main__":
    sys.exit(main())
