"""Message schedules on the server: whether this stream can hold them, the named ones it holds,
putting and removing one, and making the config-made ones match `[schedules.NAME]` (`start`,
SIGHUP). The grammar and the plan are supervisor/config/schedules.py; this room only talks.

Two supervisors starting with the same config must not double a schedule: each schedule is one
subject (the server keeps only its latest message), and every write is a compare-and-set on that
subject's last sequence, so the second writer finds the first one's schedule and, when it is the
same, leaves it (a rewrite would restart an @every period)."""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from nats.js.errors import APIError, NotFoundError

from supervisor.config import Config
from supervisor.config import schedules as sched
from supervisor.config.subjects import default_subject, subject_matches
from supervisor.errors import ConfigError, NatsUnavailable

log = logging.getLogger("supervisor.schedules")

KEY = "stream.allow_schedules"
MIN_SERVER = (2, 12)             # the first nats-server with message schedules
API_TIMEOUT = 5.0
# JetStream API error codes a schedule publish can get back (nats-server jetstream_errors.json)
DISABLED, PATTERN_INVALID, TARGET_INVALID, WRONG_LAST_SEQ = 10188, 10189, 10190, 10071
CAS_TRIES = 3


@dataclass(frozen=True)
class StreamFacts:
    allowed: bool                 # allow_msg_schedules
    subjects: tuple[str, ...]
    clock_offset: float           # the server's clock minus ours, seconds (0 when it did not say)
    # The work consumer's filters as the server has them; None: no consumer yet (start makes it narrow).
    consumer_filters: tuple[str, ...] | None = None

    def server_now(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(time.time() + self.clock_offset, dt.UTC)


class Conflict(Exception):
    """Another writer changed the schedule's subject since we read it."""


async def stream_facts(nc: Any, cfg: Config) -> StreamFacts:
    """STREAM.INFO as the server sends it (nats-py drops `ts`, the server's clock)."""
    asked = time.time()
    try:
        reply = await nc.request(f"$JS.API.STREAM.INFO.{cfg.stream.name}", b"", timeout=API_TIMEOUT)
    except Exception as exc:
        why = str(exc) or type(exc).__name__
        raise NatsUnavailable(f"stream {cfg.stream.name}: no answer to STREAM.INFO ({why})") from None
    answered = time.time()
    info = json.loads(reply.data)
    if "error" in info:
        error = info["error"]
        raise NatsUnavailable(f"stream {cfg.stream.name}: {error.get('description', error)}")
    config = info.get("config", {})
    offset = 0.0
    if info.get("ts"):
        offset = dt.datetime.fromisoformat(info["ts"]).timestamp() - (asked + answered) / 2
    return StreamFacts(bool(config.get("allow_msg_schedules")), tuple(config.get("subjects") or ()), offset,
                       await consumer_filters(nc, cfg))


async def consumer_filters(nc: Any, cfg: Config) -> tuple[str, ...] | None:
    """The work consumer's filter subjects (() for none: every subject), None when it does not exist."""
    try:
        c = (await nc.jetstream().consumer_info(cfg.stream.name, cfg.consumer.name, timeout=API_TIMEOUT)).config
    except NotFoundError:
        return None
    return tuple(c.filter_subjects or ([c.filter_subject] if c.filter_subject else []))


def refusal(cfg: Config, facts: StreamFacts, server_version: Any) -> str | None:
    """Why schedules cannot be used on this stream, in words naming the fix; None when they can."""
    name = cfg.stream.name
    if not cfg.stream.allow_schedules:
        return "false in the config: delayed and recurring jobs are off"
    version = (getattr(server_version, "major", 0), getattr(server_version, "minor", 0))
    if not facts.allowed and version < MIN_SERVER:
        return (f"nats-server {'.'.join(map(str, version))} cannot hold message schedules (they need "
                f"{'.'.join(map(str, MIN_SERVER))} or later)")
    if not facts.allowed:
        return (f"stream {name} was created without message schedules (allow_msg_schedules), before this setting "
                f"or by hand; the server can turn them on for an existing stream (never off again): add "
                f"allow_msg_schedules and the subject {sched.space_filter(name)} to its config, or let `start` "
                "create the stream anew")
    if sched.space_filter(name) not in facts.subjects:
        return (f"stream {name} allows message schedules but does not capture {sched.space_filter(name)}, where the "
                "supervisor keeps them (out of the workers' way): add that subject to the stream")
    probe = f"{sched.space(name)}.{sched.AT}.probe"
    if facts.consumer_filters is not None and (not facts.consumer_filters or
                                               any(subject_matches(f, probe) for f in facts.consumer_filters)):
        return (f"consumer {cfg.consumer.name} delivers {sched.space_filter(name)} too (its filter: "
                f"{', '.join(facts.consumer_filters) or 'every subject'}), so a worker would take a schedule for a job: "
                "start the supervisor once (it narrows the filter to the job subjects), then use schedules")
    return None


async def usable(nc: Any, cfg: Config) -> StreamFacts:
    """The stream's facts, or a ConfigError naming stream.allow_schedules (exit 2)."""
    facts = await stream_facts(nc, cfg)
    why = refusal(cfg, facts, getattr(nc, "connected_server_version", None))
    if why:
        raise ConfigError(KEY, why)
    return facts


def put_failure(exc: BaseException, msg: sched.ScheduleMsg, key: str) -> Exception:
    """What a refused schedule publish means, naming the key that set it."""
    code = getattr(exc, "err_code", None)
    if code == WRONG_LAST_SEQ:
        return Conflict(str(exc))
    if code == DISABLED:
        return ConfigError(KEY, "the stream refuses message schedules (allow_msg_schedules is off)")
    if code == PATTERN_INVALID:
        return ConfigError(key, f"the server refuses the schedule {msg.pattern!r} (message schedules pattern is invalid)")
    if code == TARGET_INVALID:
        return ConfigError(key, f"the server refuses the target subject {msg.target!r} (not a subject of the stream)")
    return NatsUnavailable(f"storing schedule {msg.subject}: {getattr(exc, 'description', None) or exc}")


async def put(js: Any, msg: sched.ScheduleMsg, key: str, expect_last: int | None = None,
              msg_id: str | None = None) -> Any:
    """Store one schedule message (compare-and-set on its subject when expect_last is given; 0:
    none may exist yet). Its PubAck, or Conflict / ConfigError / NatsUnavailable."""
    headers = msg.publish_headers()
    if expect_last is not None:
        headers[sched.EXPECT_LAST] = str(expect_last)
    if msg_id:
        headers["Nats-Msg-Id"] = msg_id
    try:
        return await js.publish(msg.subject, msg.data, headers=headers, timeout=API_TIMEOUT)
    except APIError as exc:
        raise put_failure(exc, msg, key) from None


async def remove(js: Any, cfg: Config, subject: str) -> None:
    """Purging a schedule's subject removes the schedule (the server drops its timer with it)."""
    await js.purge_stream(cfg.stream.name, subject=subject)


async def stored(js: Any, cfg: Config, subject: str) -> tuple[sched.ScheduleMsg, int] | None:
    try:
        raw = await js.get_last_msg(cfg.stream.name, subject)
    except NotFoundError:
        return None
    return sched.ScheduleMsg.stored(subject, raw.headers, raw.data), raw.seq


async def named(js: Any, cfg: Config) -> dict[str, tuple[sched.ScheduleMsg, int]]:
    """subject -> (schedule, sequence) of every named schedule (config- and CLI-made) on the stream."""
    out = {}
    for kind in sched.NAMED_KINDS:
        info = await js.stream_info(cfg.stream.name, subjects_filter=f"{sched.space(cfg.stream.name)}.{kind}.>")
        for subject in sorted(info.state.subjects or {}):
            found = await stored(js, cfg, subject)
            if found:
                out[subject] = found
    return out


async def delayed_count(js: Any, cfg: Config) -> int:
    """Delayed jobs (`publish --delay/--at`) stored and not yet due."""
    info = await js.stream_info(cfg.stream.name, subjects_filter=f"{sched.space(cfg.stream.name)}.{sched.AT}.>")
    return sum((info.state.subjects or {}).values())


def wanted(cfg: Config) -> list[sched.ScheduleMsg]:
    return [sched.named(cfg.stream.name, sched.CONFIG, name, every=e.every, cron=e.cron,
                        target=e.subject or default_subject(cfg.stream.subjects), data=e.data, headers=e.headers)
            for name, e in cfg.schedules.items()]


async def put_checked(js: Any, cfg: Config, msg: sched.ScheduleMsg, key: str, seq: int) -> bool:
    """Write `msg` where the stored schedule has sequence `seq` (0: none). Another writer in
    between: read again; theirs is ours already -> done (False: nothing written), else retry on
    theirs. True when we wrote it."""
    for _ in range(CAS_TRIES):
        try:
            await put(js, msg, key, expect_last=seq)
            return True
        except Conflict:
            found = await stored(js, cfg, msg.subject)
            if found and found[0] == msg:
                return False
            seq = found[1] if found else 0
    raise NatsUnavailable(f"schedule {msg.subject}: other writers kept changing it ({CAS_TRIES} tries)")


async def reconcile(nc: Any, cfg: Config) -> dict[str, Any]:
    """Make the config-made schedules the config's: add, change, remove; leave CLI-made ones.
    What was done, by name. ConfigError when the stream cannot hold schedules and the config has
    some (with none, nothing needs doing: allowed false, the reason given)."""
    js = nc.jetstream()
    facts = await stream_facts(nc, cfg)
    why = refusal(cfg, facts, getattr(nc, "connected_server_version", None))
    if why:
        if cfg.schedules:
            raise ConfigError(KEY, why)
        return {"allowed": False, "reason": f"{KEY}: {why}"}
    have = await named(js, cfg)
    p = sched.plan(cfg.stream.name, wanted(cfg), have)
    done: dict[str, list[str]] = {"added": [], "changed": [], "removed": [], "kept": list(p.keep),
                                  "shadowed": list(p.shadowed)}
    for msg in p.add:
        name = msg.subject.rpartition(".")[2]
        if await put_checked(js, cfg, msg, f"schedules.{name}", 0):
            done["added"].append(name)
        else:
            done["kept"].append(name)
    for msg, seq in p.change:
        name = msg.subject.rpartition(".")[2]
        if await put_checked(js, cfg, msg, f"schedules.{name}", seq):
            done["changed"].append(name)
        else:
            done["kept"].append(name)
    for subject in p.remove:
        await remove(js, cfg, subject)
        done["removed"].append(subject.rpartition(".")[2])
    return {"allowed": True, **done}

