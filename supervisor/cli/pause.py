"""`supervisor pause [--for SECONDS] [--reason TEXT]` and `supervisor resume`: the consumer
paused for the whole fleet with the server's consumer pause (supervisor/nats/limits.py), as a
handler's `raise Pause(...)` does. Every supervisor sees it in ConsumerInfo, logs it, and shows
it on /status (`paused_until`, `pause_reason`); it resumes by itself at the end. With pools,
`--pool NAME` names whose consumer (a handler's Pause pauses its own pool's)."""

from __future__ import annotations

import argparse
import getpass
import socket

import nats.errors
import uvloop

from supervisor.cli.oneshot import connect_oneshot, one_line
from supervisor.config import Config, client_config, from_args
from supervisor.config.pools import pick
from supervisor.errors import EXIT_OK, ConfigError, NatsUnavailable
from supervisor.nats import limits


def cmd_pause(args: argparse.Namespace) -> int:
    cfg = pick(client_config(from_args(args)), args.pool)
    if args.seconds is not None and args.seconds <= 0:
        raise ConfigError("--for", f"must be more than 0 seconds, got {args.seconds:g}")
    return uvloop.run(pause(cfg, args.seconds, args.reason or "paused by hand"))


def cmd_resume(args: argparse.Namespace) -> int:
    return uvloop.run(resume(pick(client_config(from_args(args)), args.pool)))


async def pause(cfg: Config, seconds: float | None, reason: str) -> int:
    nc = await connect_oneshot(cfg, "pause")
    by = f"`supervisor pause` ({getpass.getuser()}@{socket.gethostname()})"
    try:
        until, moved = await limits.pause(nc, cfg, seconds, reason, by)
    except (TimeoutError, nats.errors.Error, RuntimeError) as exc:
        raise NatsUnavailable(one_line(f"cannot pause {cfg.stream.name}/{cfg.consumer.name}: "
                                       f"{type(exc).__name__}: {exc}")) from None
    finally:
        await nc.close()
    if not moved:
        print(f"consumer {cfg.consumer.name} is already paused until {until} (left as it is)")
    elif seconds is None:
        print(f"consumer {cfg.consumer.name} paused until `supervisor resume`: {reason}")
    else:
        print(f"consumer {cfg.consumer.name} paused until {until} ({seconds:g}s): {reason}")
    return EXIT_OK


async def resume(cfg: Config) -> int:
    nc = await connect_oneshot(cfg, "resume")
    try:
        was = await limits.resume(nc, cfg)
    except (TimeoutError, nats.errors.Error) as exc:
        raise NatsUnavailable(one_line(f"cannot resume {cfg.stream.name}/{cfg.consumer.name}: "
                                       f"{type(exc).__name__}: {exc}")) from None
    finally:
        await nc.close()
    print(f"consumer {cfg.consumer.name} resumed" if was else f"consumer {cfg.consumer.name} was not paused")
    return EXIT_OK
