"""`supervisor publish`: jobs into the stream, each PubAck awaited."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import math
import time
from collections import deque
from dataclasses import dataclass

import nats.errors
import nats.js.errors
import uvloop

from supervisor.cli.oneshot import connect_oneshot, default_subject
from supervisor.config import Config, client_config, from_args, subject_matches
from supervisor.config import schedules as sched
from supervisor.errors import EXIT_OK, ConfigError, NatsUnavailable
from supervisor.nats import provision, schedules

PUBLISH_WINDOW = 4000       # PubAcks outstanding at once (nats-py's own publish_async default)
PUBACK_TIMEOUT = 10.0       # seconds a PubAck may take (a stalled window, the last ones)



@dataclass(frozen=True)
class Later:
    """When delayed jobs are due: `delay` seconds after each is stored, or all `at` a time."""
    delay: float | None = None
    at: dt.datetime | None = None

    def due(self, facts: schedules.StreamFacts) -> dt.datetime:
        return self.at or facts.server_now() + dt.timedelta(seconds=self.delay or 0.0)

    def said(self) -> str:
        if self.at:
            return f"due at {sched.at_pattern(self.at)[4:]}"
        return f"due {self.delay:g}s after each was stored (the server's clock)"


def later_of(args: argparse.Namespace) -> Later | None:
    """--delay / --at, checked (exit 2 naming the flag)."""
    if args.delay is not None:
        if not math.isfinite(args.delay) or args.delay < 0:
            raise ConfigError("--delay", f"must be 0 or more seconds, got {args.delay:g}")
        return Later(delay=args.delay)
    if args.at is not None:
        try:
            return Later(at=sched.parse_at(args.at))
        except ValueError as exc:
            raise ConfigError("--at", str(exc)) from None
    return None


def cmd_publish(args: argparse.Namespace) -> int:
    cfg = client_config(from_args(args))
    if args.count < 0:
        raise ConfigError("--count", f"must be 0 or more, got {args.count}")
    if args.rate is not None and args.rate <= 0:
        raise ConfigError("--rate", f"must be more than 0, got {args.rate:g}")
    later = later_of(args)
    subject = args.subject or default_subject(cfg)
    if sched.in_space(subject):
        raise ConfigError("--subject", f"{subject!r}: {sched.ROOT}.> is where message schedules are kept, not jobs")
    if later and not any(subject_matches(p, subject) for p in cfg.stream.subjects):
        raise ConfigError("--subject", f"{subject!r} is not a job subject of the stream "
                                       f"(stream.subjects: {', '.join(cfg.stream.subjects)})")
    stored, dups = uvloop.run(publish(cfg, subject, args.count, args.data, args.msg_id, args.rate, later))
    when = f", {later.said()}" if later else ""
    print(f"published {args.count} to {subject}{when}: {stored} stored, {dups} duplicates")
    return EXIT_OK


async def publish(cfg: Config, subject: str, count: int, data: str, msg_id: str | None,
                  rate: float | None, later: Later | None = None) -> tuple[int, int]:
    """Publish with up to PUBLISH_WINDOW PubAcks outstanding; (stored, duplicates). The stream is
    ensured first (as `start` would), so jobs published before the supervisor starts wait for it.

    nats-py's publish_async, as a hand-written loop would use it: each message goes out without
    waiting and its PubAck resolves a future, counted when it leaves the window. The window is
    ours (we wait for half of it at a time, with a timeout), so publish_async's own semaphore
    never blocks.
    (Awaiting js.publish in a window of tasks ran at 0.55x a plain publish_async loop: a task per
    message and asyncio.wait over the whole window each time one PubAck came back.)

    With `later`, each job is stored as a one-shot message schedule (`@at`, the server's clock)
    targeting `subject`: the server publishes the job when it is due and drops the schedule. A
    Nats-Msg-Id dedupes the schedule, so the job too."""
    nc = await connect_oneshot(cfg, "publish")
    js = nc.jetstream(publish_async_max_pending=PUBLISH_WINDOW + 1)
    tally = PubAckTally(subject)
    window: deque[asyncio.Future] = deque()
    numbered, payload = "{i}" in data, data.encode()
    started = time.monotonic()
    try:
        await provision.ensure_stream(js, provision.stream_config(cfg), cfg.stream.create, "stream")
        facts = await schedules.usable(nc, cfg) if later else None
        for i in range(1, count + 1):
            if rate:
                delay = started + (i - 1) / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            if len(window) >= PUBLISH_WINDOW:
                await acks_until(window, PUBLISH_WINDOW // 2, tally)
            body = data.replace("{i}", str(i)).encode() if numbered else payload
            headers = {"Nats-Msg-Id": f"{msg_id}-{i}"} if msg_id else None
            to = subject
            if later and facts:
                job = sched.ScheduleMsg(sched.delayed_subject(cfg.stream.name, f"{msg_id}-{i}" if msg_id else None),
                                        sched.at_pattern(later.due(facts)), subject, body)
                to, headers = job.subject, {**job.publish_headers(), **(headers or {})}
            window.append(await js.publish_async(to, body, headers=headers))
        await acks_until(window, 0, tally)
    finally:
        await nc.drain()
    return tally.stored, tally.duplicates


async def acks_until(window: deque[asyncio.Future], left: int, tally: PubAckTally) -> None:
    """Wait until at most `left` PubAcks are outstanding (each within PUBACK_TIMEOUT); raise the
    first failure. PubAcks come back in order, nearly always: one wait for the newest that must
    be in, then whatever is done leaves the window (a straggler is waited for on its own)."""
    while len(window) > left:
        newest = window[len(window) - left - 1]
        target = window[0] if newest.done() else newest
        try:
            await asyncio.wait_for(asyncio.shield(target), PUBACK_TIMEOUT)
        except TimeoutError:
            tally.failed(TimeoutError(f"no PubAck within {PUBACK_TIMEOUT:g}s"))
        except Exception as exc:
            tally.failed(exc)
        while window and window[0].done():
            tally.count(window.popleft())
        tally.check()


class PubAckTally:
    """Counts PubAcks as their futures resolve; the first failure ends the publish (check())."""

    def __init__(self, subject: str):
        self.subject, self.stored, self.duplicates = subject, 0, 0
        self.failure: BaseException | None = None

    def count(self, future: asyncio.Future) -> None:
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            self.failed(exc)
        elif future.result().duplicate:
            self.duplicates += 1
        else:
            self.stored += 1

    def failed(self, exc: BaseException) -> None:
        self.failure = self.failure or exc

    def check(self) -> None:
        if self.failure is not None:
            raise NatsUnavailable(f"publishing to {self.subject} failed ({publish_failure(self.failure)}) after "
                                  f"{self.stored} stored, {self.duplicates} duplicates")


def publish_failure(exc: BaseException) -> str:
    """Why a JetStream publish got no PubAck, in words."""
    if isinstance(exc, (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError)):
        return "no stream captures that subject"
    if isinstance(exc, nats.js.errors.APIError) and exc.description:
        return exc.description
    return f"{type(exc).__name__}: {exc}"
