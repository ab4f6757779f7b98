"""Operator commands that talk to NATS or to a running supervisor: publish, lag, status, scale."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import uvloop

from . import provision
from .cli import load_config
from .config import Config
from .errors import EXIT_OK, ConfigError

PUBLISH_WINDOW = 256        # PubAcks awaited at once


def client_config(cfg: Config) -> Config:
    """With no servers configured, talk to the embedded server `supervisor start` runs."""
    if cfg.nats.servers:
        return cfg
    from .app import with_servers

    return with_servers(cfg, (f"nats://{cfg.embedded.host}:{cfg.embedded.port}",))


def default_subject(cfg: Config) -> str:
    first = cfg.stream.subjects[0]
    return ".".join("new" if t == ">" else "any" if t == "*" else t for t in first.split("."))


# ---------------------------------------------------------------- publish

def cmd_publish(args: argparse.Namespace) -> int:
    cfg = client_config(load_config(args))
    if args.count < 0:
        raise ConfigError("--count", f"must be 0 or more, got {args.count}")
    if args.rate is not None and args.rate <= 0:
        raise ConfigError("--rate", f"must be more than 0, got {args.rate:g}")
    subject = args.subject or default_subject(cfg)
    stored, dups = uvloop.run(publish(cfg, subject, args.count, args.data, args.msg_id, args.rate))
    print(f"published {args.count} to {subject}: {stored} stored, {dups} duplicates")
    return EXIT_OK


async def publish(cfg: Config, subject: str, count: int, data: str, msg_id: str | None,
                  rate: float | None) -> tuple[int, int]:
    nc = await provision.connect_until(cfg, name=f"{cfg.nats.name} publish")
    js = nc.jetstream()
    stored = dups = 0
    started = time.monotonic()
    try:
        pending: set[asyncio.Future] = set()
        for i in range(1, count + 1):
            if rate:
                delay = started + (i - 1) / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            headers = {"Nats-Msg-Id": f"{msg_id}-{i}"} if msg_id else None
            payload = data.replace("{i}", str(i)).encode()
            pending.add(asyncio.ensure_future(js.publish(subject, payload, headers=headers, timeout=10)))
            if len(pending) >= PUBLISH_WINDOW:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                s, d = _count(done)
                stored, dups = stored + s, dups + d
        if pending:
            done, _ = await asyncio.wait(pending)
            s, d = _count(done)
            stored, dups = stored + s, dups + d
    finally:
        await nc.drain()
    return stored, dups


def _count(done: set[asyncio.Future]) -> tuple[int, int]:
    stored = dups = 0
    for fut in done:
        ack = fut.result()          # a failed publish is an error the user must see
        if ack.duplicate:
            dups += 1
        else:
            stored += 1
    return stored, dups


# ---------------------------------------------------------------- lag

def cmd_lag(args: argparse.Namespace) -> int:
    cfg = client_config(load_config(args))
    if args.watch is not None and args.watch <= 0:
        raise ConfigError("--watch", f"must be more than 0 seconds, got {args.watch:g}")
    return uvloop.run(lag(cfg, args.stream or cfg.stream.name, args.consumer or cfg.consumer.name,
                          args.json, args.watch))


async def lag(cfg: Config, stream: str, consumer: str, as_json: bool, watch: float | None) -> int:
    nc = await provision.connect_until(cfg, name=f"{cfg.nats.name} lag")
    js = nc.jetstream()
    started = time.monotonic()
    try:
        while True:
            info = await consumer_info(js, stream, consumer)
            elapsed = time.monotonic() - started
            if as_json:
                print(json.dumps({"t": round(elapsed, 3), **info} if watch else info), flush=True)
            else:
                print((f"{elapsed:6.1f}s " if watch else "") + lag_line(info), flush=True)
            if watch is None:
                return EXIT_OK
            await asyncio.sleep(watch - (time.monotonic() - started) % watch)
    finally:
        await nc.close()


async def consumer_info(js: Any, stream: str, consumer: str) -> dict[str, Any]:
    from nats.js.errors import NotFoundError

    from .errors import NatsUnavailable

    try:
        info = await js.consumer_info(stream, consumer)
    except NotFoundError:
        raise NatsUnavailable(f"consumer {consumer} not found on stream {stream}") from None
    return consumer_dict(info)


def consumer_dict(info: Any) -> dict[str, Any]:
    return {"stream": info.stream_name, "name": info.name, "num_pending": info.num_pending or 0,
            "num_ack_pending": info.num_ack_pending or 0, "num_redelivered": info.num_redelivered or 0,
            "num_waiting": info.num_waiting or 0, "delivered_consumer_seq": info.delivered.consumer_seq,
            "delivered_stream_seq": info.delivered.stream_seq, "ack_floor_consumer_seq": info.ack_floor.consumer_seq,
            "ack_floor_stream_seq": info.ack_floor.stream_seq}


def lag_line(c: dict[str, Any]) -> str:
    """The seed post's ticker line, in consumer sequences."""
    return (f"pending={c['num_pending']:<4} ackPending={c['num_ack_pending']:<3} redelivered={c['num_redelivered']:<3} "
            f"delivered={c['delivered_consumer_seq']:<5} ackFloor={c['ack_floor_consumer_seq']}")


def cmd_status(args: argparse.Namespace) -> int:
    raise NotImplementedError


def cmd_scale(args: argparse.Namespace) -> int:
    raise NotImplementedError
