"""`supervisor lag`: ConsumerInfo straight from NATS, once or as a ticker."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import nats.errors
import uvloop

from supervisor.cli.oneshot import connect_oneshot
from supervisor.config import Config, client_config, from_args
from supervisor.config.pools import pick
from supervisor.errors import EXIT_OK, ConfigError, NatsUnavailable
from supervisor.nats.consumer import consumer_info, lag_line


def cmd_lag(args: argparse.Namespace) -> int:
    cfg = client_config(from_args(args))
    if not args.consumer:
        cfg = pick(cfg, args.pool)
    if args.watch is not None and args.watch <= 0:
        raise ConfigError("--watch", f"must be more than 0 seconds, got {args.watch:g}")
    return uvloop.run(lag(cfg, args.stream or cfg.stream.name, args.consumer or cfg.consumer.name,
                          args.json, args.watch))


async def lag(cfg: Config, stream: str, consumer: str, as_json: bool, watch: float | None) -> int:
    nc = await connect_oneshot(cfg, "lag")
    js = nc.jetstream()
    started = time.monotonic()
    try:
        while True:
            try:
                info: dict[str, Any] = await consumer_info(js, stream, consumer)
            except (TimeoutError, nats.errors.Error) as exc:
                # In a cluster a consumer leader move leaves ConsumerInfo unanswered for seconds:
                # a ticker says so and goes on; a single reading fails in one line (exit 4).
                why = f"no ConsumerInfo for {stream}/{consumer} ({type(exc).__name__}: {exc})"
                if watch is None:
                    raise NatsUnavailable(why) from None
                info = {"error": why}
            elapsed = time.monotonic() - started
            if as_json:
                print(json.dumps({"t": round(elapsed, 3), **info} if watch else info), flush=True)
            else:
                print((f"{elapsed:6.1f}s " if watch else "") + (info.get("error") or lag_line(info)), flush=True)
            if watch is None:
                return EXIT_OK
            await asyncio.sleep(watch - (time.monotonic() - started) % watch)
    finally:
        await nc.close()
