"""`supervisor schedule list / add / rm`: the recurring jobs the server fires (NATS message
schedules, supervisor/config/schedules.py).

Two makers, kept apart by subject: `[schedules.NAME]` in the config is what `start` makes the
server hold (it adds, changes and removes its own), and `schedule add` makes one by hand that
`start` never touches. A name lives in one place: `add` refuses a name the config holds, and
`rm` of a config-made one says it comes back at the next start unless the config drops it."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import uvloop

from supervisor.cli.oneshot import connect_oneshot, default_subject, one_line
from supervisor.config import Config, client_config, from_args
from supervisor.config import schedules as sched
from supervisor.config.keys import NAME_CHARS
from supervisor.errors import EXIT_OK, ConfigError
from supervisor.nats import schedules

DATA_SHOWN = 30             # characters of the payload in the text table


def cmd_schedule(args: argparse.Namespace) -> int:
    cfg = client_config(from_args(args))
    if args.action == "list":
        return uvloop.run(list_schedules(cfg, args.json))
    check_name(args.name)
    if args.action == "add":
        msg = cli_schedule(cfg, args)
        return uvloop.run(add(cfg, args.name, msg))
    return uvloop.run(remove(cfg, args.name))


@contextlib.asynccontextmanager
async def stream_of(cfg: Config) -> AsyncIterator[Any]:
    """JetStream on a stream that can hold schedules (else exit 2 naming stream.allow_schedules)."""
    nc = await connect_oneshot(cfg, "schedule")
    try:
        await schedules.usable(nc, cfg)
        yield nc.jetstream()
    finally:
        await nc.drain()


def check_name(name: str) -> None:
    if not name or not set(name) <= NAME_CHARS:
        raise ConfigError("NAME", f"{name!r}: letters, digits, _ and - only")


def cli_schedule(cfg: Config, args: argparse.Namespace) -> sched.ScheduleMsg:
    """The schedule `add` asks for, each value checked as the config checks [schedules.NAME]."""
    every, cron = args.every or 0.0, args.cron or ""
    if args.every is not None and (problem := sched.every_problem(args.every)):
        raise ConfigError("--every", problem)          # 0 given, not left out
    headers = tuple(args.header or ())
    flags = {"every": "--every", "cron": "--cron", "subject": "--subject", "headers": "--header"}
    for name, problem in sched.entry_problems(every=every, cron=cron, subject=args.subject or "", headers=headers,
                                              stream_subjects=cfg.stream.subjects):
        raise ConfigError(flags[name], problem)
    return sched.named(cfg.stream.name, sched.CLI, args.name, every=every, cron=cron,
                       target=args.subject or default_subject(cfg), data=args.data, headers=headers)


async def add(cfg: Config, name: str, msg: sched.ScheduleMsg) -> int:
    if name in cfg.schedules:
        raise ConfigError("NAME", f"{name!r} is [schedules.{name}] in the config: change it there (`start` makes "
                                  "the server match the config)")
    async with stream_of(cfg) as js:
        if await schedules.stored(js, cfg, sched.named_subject(cfg.stream.name, sched.CONFIG, name)):
            raise ConfigError("NAME", f"{name!r} is a config-made schedule on the server (a [schedules.{name}] a "
                                      "supervisor started with): pick another name")
        have = await schedules.stored(js, cfg, msg.subject)
        await schedules.put_checked(js, cfg, msg, "NAME", have[1] if have else 0)
    verb = "replaced" if have else "added"
    print(f"schedule {name} {verb}: {msg.when()} -> {msg.target}")
    return EXIT_OK


async def remove(cfg: Config, name: str) -> int:
    async with stream_of(cfg) as js:
        found = [s for s in (sched.named_subject(cfg.stream.name, kind, name) for kind in sched.NAMED_KINDS)
                 if await schedules.stored(js, cfg, s)]
        if not found:
            raise ConfigError("NAME", f"no schedule named {name!r} (see `supervisor schedule list`)")
        for subject in found:
            await schedules.remove(js, cfg, subject)
    print(f"schedule {name} removed")
    if name in cfg.schedules:
        print(f"note: [schedules.{name}] is still in the config; the next `supervisor start` adds it again",
              file=sys.stderr)
    return EXIT_OK


async def list_schedules(cfg: Config, as_json: bool) -> int:
    async with stream_of(cfg) as js:
        rows = [row(cfg, subject, msg, seq) for subject, (msg, seq) in (await schedules.named(js, cfg)).items()]
        delayed = await schedules.delayed_count(js, cfg)
    if as_json:
        print(json.dumps({"schedules": rows, "delayed_jobs": delayed}, indent=2))
        return EXIT_OK
    if not rows:
        print("no schedules")
    else:
        print(f"{'NAME':<20} {'MADE BY':<8} {'WHEN':<26} {'SUBJECT':<24} DATA")
        for r in rows:
            made = r["made_by"] + ("" if r["in_config"] or r["made_by"] != "config" else "!")
            print(f"{r['name']:<20} {made:<8} {r['when']:<26} {r['subject']:<24} {one_line(r['data'], DATA_SHOWN)}")
        if any(r["made_by"] == "config" and not r["in_config"] for r in rows):
            print("config! : made by a start whose config had it; this config does not: the next start removes it")
    print(f"delayed jobs waiting: {delayed}")
    return EXIT_OK


def row(cfg: Config, subject: str, msg: sched.ScheduleMsg, seq: int) -> dict[str, Any]:
    kind, name = sched.parse_subject(cfg.stream.name, subject) or ("?", subject)
    return {"name": name, "made_by": kind, "in_config": kind == sched.CONFIG and name in cfg.schedules,
            "when": msg.when(), "pattern": msg.pattern, "subject": msg.target,
            "data": msg.data.decode(errors="replace"), "headers": dict(msg.headers), "stream_seq": seq}
