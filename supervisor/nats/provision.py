"""Reach NATS within nats.startup_timeout, then ensure the stream, the durable pull consumer, the
dead-letter stream and (with [idempotency] on) the KV bucket of done-markers. An existing stream
is never changed behind the user's back: we log what differs and leave it. The consumer is ours,
so the settings the server lets us change are changed, each change logged; anything else that
differs is an error (exit 4)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from typing import Any

from nats import errors as nats_errors
from nats.js import api
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from supervisor.config import Config
from supervisor.config import schedules as sched
from supervisor.errors import ConfigError, NatsUnavailable
from supervisor.nats import connect as natsconn

FLEET_KEEP_S = 3600.0       # the fleet bucket's max_age: a lost supervisor stays in the view this long

log = logging.getLogger("supervisor.nats")

RETENTION = {"workqueue": api.RetentionPolicy.WORK_QUEUE, "limits": api.RetentionPolicy.LIMITS,
             "interest": api.RetentionPolicy.INTEREST}
STORAGE = {"file": api.StorageType.FILE, "memory": api.StorageType.MEMORY}
# Consumer settings a running server lets us update in place.
CONSUMER_UPDATABLE = ("ack_wait", "max_deliver", "max_ack_pending", "backoff", "filter_subject", "filter_subjects")
VALID_BUCKET = re.compile(r"[a-zA-Z0-9_-]+")
# The server refuses a consumer whose subjects another consumer of a work-queue stream takes too.
WQ_OVERLAP = (10099, 10100)


async def connect_until(cfg: Config, *, name: str, **options: Any) -> Any:
    """Connect, retrying until nats.startup_timeout; a refused secret fails at once (exit 4)."""
    deadline = time.monotonic() + cfg.nats.startup_timeout
    last_note = 0.0
    while True:
        try:
            return await natsconn.connect(cfg.nats, name=name, **options)
        except natsconn.NatsConnectError as exc:
            if exc.auth_failed:
                raise
            now = time.monotonic()
            if now >= deadline:
                raise NatsUnavailable(f"{exc} (gave up after nats.startup_timeout={cfg.nats.startup_timeout:g}s)") from None
            if now - last_note >= 5.0:
                log.warning("%s; retrying for up to %.0fs more", exc, deadline - now)
                last_note = now
            await asyncio.sleep(min(0.5, deadline - now))


def stream_config(cfg: Config) -> api.StreamConfig:
    """The stream we create. With stream.allow_schedules it also captures the schedule space
    (config/schedules.py) and allows message schedules, which need rollup headers (the server
    would turn them on itself)."""
    s = cfg.stream
    extra: dict[str, Any] = {}
    subjects = list(s.subjects)
    if s.allow_schedules:
        subjects.append(sched.space_filter(s.name))
        extra = {"allow_msg_schedules": True, "allow_rollup_hdrs": True}
    return api.StreamConfig(name=s.name, subjects=subjects, retention=RETENTION[s.retention],
                            storage=STORAGE[s.storage], num_replicas=s.replicas, duplicate_window=s.duplicate_window,
                            **extra)


def consumer_config(cfg: Config, stream_subjects: list[str] | None = None) -> api.ConsumerConfig:
    """The work consumer. On a stream holding schedules its filter names the job subjects, so a
    schedule message is never delivered as a job (and acked away); elsewhere "" is every subject."""
    c = cfg.consumer
    subjects = list(stream_config(cfg).subjects or ()) if stream_subjects is None else stream_subjects
    filters = sched.job_filters(c.filter_subject, subjects, sched.space_filter(cfg.stream.name) in subjects)
    return api.ConsumerConfig(durable_name=c.name, ack_policy=api.AckPolicy.EXPLICIT, ack_wait=c.ack_wait,
                              max_deliver=c.max_deliver, max_ack_pending=c.max_ack_pending,
                              backoff=list(c.backoff) or None, filter_subject=filters[0] if len(filters) == 1 else None,
                              filter_subjects=list(filters) if len(filters) > 1 else None,
                              deliver_policy=api.DeliverPolicy.ALL)


# NATS did not answer in time, or the link dropped under the request, or a leader is being
# elected: a start tries again within nats.startup_timeout (ensure_until).
TRANSIENT = (asyncio.TimeoutError, nats_errors.TimeoutError, nats_errors.NoRespondersError,
             nats_errors.ConnectionReconnectingError, nats_errors.StaleConnectionError,
             nats_errors.ConnectionClosedError, ServiceUnavailableError)


def transient(exc: Exception) -> bool:
    return isinstance(exc, TRANSIENT) or (isinstance(exc, APIError) and exc.code == 503)


async def ensure_until(nc: Any, cfg: Config, pools: list[Config], started: float) -> None:
    """ensure(), tried again while NATS does not answer, until nats.startup_timeout from
    `started` (the start's monotonic time): a link that drops just after the connect, or a
    stream leader being elected, is the unreachable server the timeout is for, not exit 4 at once
    (seed 700: a parent's link cut 1 s after its successor connected)."""
    deadline = started + cfg.nats.startup_timeout
    while True:
        try:
            return await ensure(nc, cfg, pools)
        except NatsUnavailable as exc:
            now = time.monotonic()
            if not exc.transient or now >= deadline:
                raise
            log.warning("%s; retrying for up to %.0fs more", exc, deadline - now)
            await asyncio.sleep(min(0.5, deadline - now))


async def ensure(nc: Any, cfg: Config, pools: list[Config] | None = None) -> None:
    """The stream, each pool's consumer (`pools`: their effective configs; None: the config's
    one consumer), the dead-letter stream and the buckets."""
    js = nc.jetstream()
    try:
        stream = await ensure_stream(js, stream_config(cfg), cfg.stream.create, "stream")
        warn_schedules(cfg, stream)
        for pool_cfg in pools or [cfg]:
            await ensure_queue(js, pool_cfg, stream)
        if cfg.restart.dead_letter_stream and cfg.restart.dead_letter_subject:
            dlq = api.StreamConfig(name=cfg.restart.dead_letter_stream, subjects=[cfg.restart.dead_letter_subject],
                                   retention=api.RetentionPolicy.LIMITS, storage=STORAGE[cfg.stream.storage],
                                   num_replicas=cfg.stream.replicas, duplicate_window=cfg.stream.duplicate_window)
            await ensure_stream(js, dlq, cfg.stream.create, "restart.dead_letter_stream")
        if cfg.idempotency.enabled:
            await ensure_idempotency(js, cfg)
    except (NatsUnavailable, ConfigError):
        raise
    except Exception as exc:
        raise NatsUnavailable(f"cannot ensure stream {cfg.stream.name} / consumer {cfg.consumer.name}: "
                              f"{_describe(exc)}", transient=transient(exc)) from None
    await ensure_fleet_bucket(js, cfg)
    await ensure_limits_bucket(js, cfg)


async def ensure_limits_bucket(js: Any, cfg: Config) -> None:
    """The KV bucket of [limits.NAME] slots and pause reasons (workers/protocol/limitkeys.py):
    history 1, per-message TTLs, as many replicas as the stream (a limit must hold through a KV
    leader's death). Needed when limits are configured (workers wait for it, never run without
    it); otherwise only pause reasons are kept there, and its absence is a warning."""
    bucket, needed = cfg.fleet.limits_bucket, bool(cfg.limits)
    if not VALID_BUCKET.fullmatch(bucket):
        raise ConfigError("fleet.limits_bucket", f"{bucket!r} is not a KV bucket name (letters, digits, _ and - only)")
    try:
        have = (await js.stream_info(f"KV_{bucket}")).config
    except NotFoundError:
        have = None
    except Exception as exc:
        if needed:
            raise NatsUnavailable(f"fleet.limits_bucket: KV bucket {bucket}: {_describe(exc)}",
                                  transient=transient(exc)) from None
        log.warning("limits bucket %s: %s; pause reasons are not kept", bucket, _describe(exc))
        return
    if have is not None:
        if not have.allow_msg_ttl and needed:
            raise NatsUnavailable(f"fleet.limits_bucket: KV bucket {bucket} does not allow per-message TTLs, which "
                                  "limit slots need (recreate it)")
        return
    if not cfg.stream.create:
        if needed:
            raise NatsUnavailable(f"fleet.limits_bucket: KV bucket {bucket} does not exist and stream.create is false")
        return
    try:
        await js.create_key_value(bucket=bucket, history=1, replicas=cfg.stream.replicas,
                                  storage=STORAGE[cfg.stream.storage],
                                  description="jetstream-supervisor limit slots and pause reasons")
    except Exception as exc:
        if needed:
            raise NatsUnavailable(f"fleet.limits_bucket: cannot create KV bucket {bucket}: {_describe(exc)}") from None
        log.warning("cannot create KV bucket %s: %s; pause reasons are not kept", bucket, _describe(exc))
        return
    log.info("created KV bucket %s (limit slots and pause reasons, %d replica(s))", bucket, cfg.stream.replicas)


async def ensure_fleet_bucket(js: Any, cfg: Config) -> None:
    """The KV bucket of fleet heartbeats (supervisor/parent/tasks/fleet.py): one value per key, kept for
    FLEET_KEEP_S after its last write (so a lost supervisor stays visible a while), as many
    replicas as the stream. Not fatal: without it the work goes on, only the fleet view is off."""
    from nats.js.errors import BucketNotFoundError

    bucket = cfg.fleet.bucket
    try:
        await js.key_value(bucket)
        return
    except BucketNotFoundError:
        pass
    except Exception as exc:
        log.warning("fleet bucket %s: %s; the fleet view is off until it answers", bucket, _describe(exc))
        return
    if not cfg.stream.create:
        log.warning("KV bucket %s does not exist and stream.create is false: the fleet view is off", bucket)
        return
    try:
        await js.create_key_value(bucket=bucket, history=1, ttl=FLEET_KEEP_S, replicas=cfg.stream.replicas,
                                  storage=STORAGE[cfg.stream.storage],
                                  description="jetstream-supervisor fleet heartbeats")
        log.info("created KV bucket %s (fleet heartbeats, %d replica(s))", bucket, cfg.stream.replicas)
    except Exception as exc:
        log.warning("cannot create KV bucket %s: %s; the fleet view is off", bucket, _describe(exc))


async def ensure_stream(js: Any, want: api.StreamConfig, create: bool, key: str) -> api.StreamConfig:
    """The stream as the server has it (created from `want` when missing and `create`)."""
    try:
        have = (await js.stream_info(want.name)).config
    except NotFoundError:
        if not create:
            raise NatsUnavailable(f"{key}: stream {want.name} does not exist and stream.create is false") from None
        made = (await js.add_stream(want)).config
        log.info("created stream %s (subjects %s, %s, %s storage%s)", want.name, ", ".join(want.subjects or ()),
                 getattr(want.retention, "value", "?"), getattr(want.storage, "value", "?"),
                 ", message schedules" if made.allow_msg_schedules else "",
                 extra={"event": "stream_created", "stream": want.name})
        return made
    # The schedule space is compared on its own (warn_schedules): an older stream lacks it by design.
    space = sched.space_filter(want.name or "")
    plain = dataclasses.replace(want, subjects=[s for s in want.subjects or () if s != space])
    seen = dataclasses.replace(have, subjects=[s for s in have.subjects or () if s != space])
    for name, had, wanted in _differences(seen, plain, ("subjects", "retention", "storage", "num_replicas",
                                                        "duplicate_window")):
        log.warning("stream %s exists with %s=%s (config: %s); left as it is", want.name, name, had, wanted,
                    extra={"event": "stream_differs", "stream": want.name, "setting": name, "have": had,
                           "want": wanted})
    return have


def warn_schedules(cfg: Config, have: api.StreamConfig) -> None:
    """Once at start: an existing stream that cannot hold schedules (publish --delay and
    [schedules] are refused when used, naming stream.allow_schedules)."""
    if cfg.stream.allow_schedules and not (have.allow_msg_schedules and
                                           sched.space_filter(cfg.stream.name) in (have.subjects or ())):
        log.warning("stream %s cannot hold message schedules (created before stream.allow_schedules, or by hand): "
                    "publish --delay/--at and [schedules] are refused until it can (README: Later and every)",
                    cfg.stream.name, extra={"event": "stream_without_schedules", "stream": cfg.stream.name})


async def ensure_consumer(js: Any, cfg: Config, stream_subjects: list[str] | None = None) -> None:
    if stream_subjects is None:
        stream_subjects = list((await js.stream_info(cfg.stream.name)).config.subjects or ())
    want = consumer_config(cfg, stream_subjects)
    try:
        have = (await js.consumer_info(cfg.stream.name, cfg.consumer.name)).config
    except NotFoundError:
        if not cfg.stream.create:
            raise NatsUnavailable(f"consumer {cfg.consumer.name} does not exist on stream {cfg.stream.name} "
                                  "and stream.create is false") from None
        try:
            await js.add_consumer(cfg.stream.name, want)
        except APIError as exc:
            if exc.err_code in WQ_OVERLAP:
                raise NatsUnavailable(f"consumer {cfg.consumer.name}: {_describe(exc)}: another consumer on work-queue "
                                      f"stream {cfg.stream.name} takes these subjects too (one left by an earlier run, "
                                      "e.g. the single pool's before [pools.*]; `supervisor lag --consumer NAME` shows "
                                      "whether it is drained): delete it, or name it as this pool's `consumer`") from None
            raise
        log.info("created durable pull consumer %s on %s (AckWait %gs, max_ack_pending %d)", want.durable_name,
                 cfg.stream.name, cfg.consumer.ack_wait, cfg.consumer.max_ack_pending,
                 extra={"event": "consumer_created", "consumer": want.durable_name})
        return
    if have.deliver_subject or have.ack_policy != api.AckPolicy.EXPLICIT:
        raise NatsUnavailable(f"consumer {cfg.consumer.name} on {cfg.stream.name} exists but is not a pull consumer "
                              "with explicit acks; workers cannot share it")
    changes = _differences(have, want, CONSUMER_UPDATABLE)
    if changes and cfg.stream.create:
        await js.add_consumer(cfg.stream.name, dataclasses.replace(have, **{n: getattr(want, n) for n, _, _ in changes}))
        for name, had, wanted in changes:
            log.warning("consumer %s: updated %s from %s to %s (config)", cfg.consumer.name, name, had, wanted,
                        extra={"event": "consumer_updated", "consumer": cfg.consumer.name, "setting": name,
                               "have": had, "want": wanted})
    for name, had, wanted in changes if not cfg.stream.create else ():
        log.warning("consumer %s has %s=%s (config: %s); stream.create is false, so left as it is",
                    cfg.consumer.name, name, had, wanted,
                    extra={"event": "consumer_differs", "consumer": cfg.consumer.name, "setting": name,
                           "have": had, "want": wanted})


async def ensure_queue(js: Any, pool_cfg: Config, stream: api.StreamConfig | None = None) -> None:
    """One pool's consumer (its effective config), and what its [ordering] needs of it and of the
    stream: at start for every pool, on a reload for a pool added or whose consumer or ordering
    changed. `stream`: the stream's config when the caller has it."""
    await ensure_consumer(js, pool_cfg, list(stream.subjects or ()) if stream else None)
    if pool_cfg.ordering.key:
        await check_ordering(js, pool_cfg, stream or (await js.stream_info(pool_cfg.stream.name)).config)


async def check_ordering(js: Any, cfg: Config, stream: api.StreamConfig) -> None:
    """[ordering] knows a job is done when the stream no longer stores it: a work queue, whose
    consumer delivers exactly the subjects the workers ask the stream about (job_subjects), on a
    stream that removes no job by itself and lets the parent delete one (removes_jobs_itself).
    With pools, each ordered pool's consumer is checked on its own filter."""
    if stream.retention != api.RetentionPolicy.WORK_QUEUE:
        kind = getattr(stream.retention, "value", stream.retention)
        raise ConfigError("ordering.key", f"stream {cfg.stream.name} is not a work queue (retention {kind}): a job of "
                                          f"consumer {cfg.consumer.name} would stay stored once done, and its key would "
                                          "wait for it for good")
    have = (await js.consumer_info(cfg.stream.name, cfg.consumer.name)).config
    removes = removes_jobs_itself(cfg, stream, have.max_deliver)
    if removes:
        raise ConfigError("ordering.key", removes)
    delivers = have.filter_subjects or ([have.filter_subject] if have.filter_subject else
                                        [s for s in stream.subjects or () if not sched.in_space(s)])
    ours = sched.job_subjects(cfg)
    if sorted(delivers) != sorted(ours):
        raise ConfigError("ordering.key", f"consumer {cfg.consumer.name} delivers {', '.join(delivers)} but the config "
                                          f"names {', '.join(ours)} (consumer.filter_subject, else stream.subjects): "
                                          "workers would ask the stream about other jobs than theirs")


def removes_jobs_itself(cfg: Config, stream: api.StreamConfig, max_deliver: int | None) -> str:
    """[ordering] also needs the stream to keep a job until it is acked or TERMed, and to let the
    parent delete one the consumer gave up on. Two settings a stream made by hand can have break
    that; "" when neither. A per-subject limit that refuses new jobs (discard_new_per_subject) keeps
    what is stored, so it passes; without it the server drops the oldest job of the subject, with
    discard "new" too (nats-server stores the new message and then enforces the limit). Deletes
    matter only to a consumer that gives up (`max_deliver`, the server's: -1 never does)."""
    per_subject = stream.max_msgs_per_subject or 0
    if per_subject > 0 and not stream.discard_new_per_subject:
        return (f"stream {cfg.stream.name} keeps {per_subject} job(s) per subject and drops the oldest for a newer "
                "one (max_msgs_per_subject without discard_new_per_subject): a running job of consumer "
                f"{cfg.consumer.name} would leave the stream when a later job of its subject is published, and the "
                "next job of its key would start beside it")
    if stream.deny_delete and (max_deliver or -1) > 0:
        return (f"stream {cfg.stream.name} denies deletes (deny_delete): a job consumer {cfg.consumer.name} gives up "
                f"on after {max_deliver} deliveries (consumer.max_deliver; -1 never gives up) could not be deleted "
                "from it, and its key would wait for it for good")
    return ""


async def ensure_idempotency(js: Any, cfg: Config) -> None:
    """The KV bucket of done-markers (workers/middleware/guard.py): max_age = idempotency.ttl, per-message
    TTL allowed (the job leases expire by it). Warns about settings that weaken the guard."""
    bucket = cfg.idempotency.bucket
    if not VALID_BUCKET.fullmatch(bucket):
        raise ConfigError("idempotency.bucket", f"{bucket!r} is not a KV bucket name (letters, digits, _ and - only)")
    try:
        have = (await js.stream_info(f"KV_{bucket}")).config
    except NotFoundError:
        if not cfg.stream.create:
            raise NatsUnavailable(f"idempotency.bucket: KV bucket {bucket} does not exist and "
                                  "stream.create is false") from None
        await js.create_key_value(bucket=bucket, ttl=cfg.idempotency.ttl, history=1,
                                  storage=STORAGE[cfg.stream.storage], replicas=cfg.stream.replicas,
                                  description="jetstream-supervisor done-markers and job leases")
        log.info("created KV bucket %s (done-markers kept %gs)", bucket, cfg.idempotency.ttl)
    else:
        await _check_bucket(js, cfg, have)
    warn_idempotency(cfg, (await js.stream_info(cfg.stream.name)).config.duplicate_window or 0.0)


async def _check_bucket(js: Any, cfg: Config, have: api.StreamConfig) -> None:
    bucket = cfg.idempotency.bucket
    if not have.allow_msg_ttl:
        if not cfg.stream.create:
            raise NatsUnavailable(f"idempotency.bucket: KV bucket {bucket} does not allow per-message TTLs, which the "
                                  "job leases need, and stream.create is false (recreate it, or let us update it)")
        await js.update_stream(dataclasses.replace(have, allow_msg_ttl=True))
        log.warning("KV bucket %s: allowed per-message TTLs (the job leases expire by them)", bucket)
    if _norm(have.max_age) != _norm(cfg.idempotency.ttl):
        log.warning("KV bucket %s exists with max_age=%ss (idempotency.ttl: %gs); left as it is: done-markers live "
                    "max_age", bucket, _norm(have.max_age), cfg.idempotency.ttl)


def warn_idempotency(cfg: Config, duplicate_window: float) -> None:
    """Two settings that leave holes in the exactly-once story (README "Exactly once")."""
    if cfg.idempotency.ttl < duplicate_window:
        log.warning("idempotency.ttl (%gs) is shorter than stream %s's duplicate window (%gs): done-markers should "
                    "outlive the time publishers may retry", cfg.idempotency.ttl, cfg.stream.name, duplicate_window,
                    extra={"event": "idempotency_ttl_short"})
    if not cfg.workers.double_ack:
        log.warning("[idempotency] is on but workers.double_ack is off: acks are not confirmed, so a lost ack "
                    "redelivers a finished job (the done-marker then skips it)",
                    extra={"event": "idempotency_no_double_ack"})


def _differences(have: Any, want: Any, names: tuple[str, ...]) -> list[tuple[str, Any, Any]]:
    out = []
    for name in names:
        had, wanted = _norm(getattr(have, name)), _norm(getattr(want, name))
        if had != wanted:
            out.append((name, had, wanted))
    return out


def _norm(value: Any) -> Any:
    if hasattr(value, "value"):
        return value.value
    if isinstance(value, list):
        return [_norm(v) for v in value] or None
    if isinstance(value, float):
        return round(value, 6)
    return None if value == "" else value


def _describe(exc: Exception) -> str:
    desc = getattr(exc, "description", None)
    return desc or str(exc) or type(exc).__name__
