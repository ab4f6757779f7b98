"""[idempotency]: done-markers and leases in a JetStream KV bucket, consulted around each job:
the first built-in middleware (`IdempotencyGuard`, the innermost of a worker's chain).

One KV entry per job key (workers.Job.key, escaped into a valid KV key) moves through:

    (none) --claim--> lease --handler returned--> done        (kept for idempotency.ttl: max_age)
                        |
                        +--handler failed--> deleted          (the next delivery may claim it)

Before the handler (`before`), a worker claims the key: it writes a lease with "expected last
subject sequence 0" and a per-message TTL (Nats-TTL, nats-server 2.11+; the bucket allows it).
  - written            -> RUN: we hold the lease; it is renewed every LEASE_TTL/3 while the job runs
  - the key has a done-marker             -> DUPLICATE: acked without running
  - a lease whose holder is alive, or on another machine -> RETRY: NAKed with a delay; the holder
    is running this very job (a redelivery after AckWait ran out elsewhere)
  - a lease of a process that is gone (same boot, pid namespace and user; pid dead or reused), or a
    deleted entry -> taken over with "expected last sequence = its revision" -> RUN
  - the bucket does not answer (deleted, server down, timeout) -> RETRY with backoff: a job never
    runs unguarded
The verdict is the middleware's before_job: RUN returns, DUPLICATE raises Duplicate (acked
unrun), RETRY raises Retry with its delay and reason (NAKed unrun); a job not run is not one of
the worker's max_jobs (Puller.not_started).
After the handler returned (`after(job, True)`): the lease is replaced by the done-marker (same
revision check), then the runtime acks. After a failure (`after(job, False)`): the lease is
deleted, so the redelivery need not wait for its TTL.

A lease outlives a dead holder on another machine by at most LEASE_TTL (the server removes the
message). What the guard cannot do: make the done-marker and the handler's side effect atomic. A
worker that dies after the side effect and before the marker runs the job again; only a side
effect that commits its own marker (workers.once) is exactly once. See README "Exactly once".
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.js.errors import NotFoundError

from workers import Job, Retry
from workers.middleware.base import Context, Duplicate, Middleware

log = logging.getLogger("worker")

LEASE_TTL = 15               # seconds (Nats-TTL takes whole seconds); renewed every LEASE_TTL / 3
KV_TIMEOUT = 5.0             # one KV write or read
MIN_RETRY = 1.0              # never NAK a guarded job for immediate redelivery: no hot loop
WARN_EVERY = 10.0            # an unreachable bucket is logged at most this often per worker
WRONG_LAST_SEQUENCE = 10071  # JetStream: "expected last subject sequence" did not match
KV_OPERATION = "KV-Operation"

RUN, DUPLICATE, RETRY = "run", "duplicate", "retry"


@dataclass(frozen=True)
class Verdict:
    action: str              # run | duplicate | retry
    delay: float = 0.0       # retry: NAK with this delay
    reason: str = ""


class Conflict(Exception):
    """The entry's last revision is not the one the write expected."""


class BucketError(Exception):
    """The bucket's stream refused a write for another reason."""


# ---------------------------------------------------------------- pure pieces

_KEEP = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-/")


def kv_key(key: str) -> str:
    """A job key as a KV key: [A-Za-z0-9_-/] kept, every other byte (dots, colons, '=', UTF-8)
    written =XX. Readable for common ids ("order-17", "JOBS=3A42"), and never ambiguous."""
    return "".join(c if c in _KEEP else "".join(f"={b:02X}" for b in c.encode()) for c in key)


def scope_of(cfg: Any) -> str:
    """What goes before a pool's keys: with [pools.*], its consumer's name, so each pool's jobs
    are done in its own right. Two pools whose filters overlap off a work queue (a fan-out: each
    consumer gets every message) hold one key per message, and one pool's done-marker would make
    the other ack its delivery unrun. Without [pools.*] keys are as they always were."""
    return f"{kv_key(cfg.consumer.name)}." if cfg.pools else ""


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, precisely enough to tell on this machine whether it is still alive."""
    host: str
    boot: str                # /proc/sys/kernel/random/boot_id: a reboot makes every old pid dead
    pidns: int               # pid namespace inode: pids of another container mean nothing here
    uid: int                 # /proc may hide other users' processes (hidepid): only judge our own
    pid: int
    start: int               # the process's start time in clock ticks since boot: pid reuse

    def lease_value(self, nonce: str, job: Any) -> bytes:
        return (f"lease host={self.host} boot={self.boot} pidns={self.pidns} uid={self.uid} pid={self.pid} "
                f"start={self.start} nonce={nonce} seq={job.stream_seq} delivery={job.delivery}").encode()

    @staticmethod
    def parse(value: bytes) -> Holder | None:
        fields = dict(f.split("=", 1) for f in value.decode(errors="replace").split()[1:] if "=" in f)
        try:
            return Holder(fields["host"], fields["boot"], int(fields["pidns"]), int(fields["uid"]), int(fields["pid"]),
                          int(fields["start"]))
        except (KeyError, ValueError):
            return None

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"


def this_process() -> Holder:
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:                      # not Linux: leases of others are only ever left to expire
        boot, pidns = "", 0
    return Holder(socket.gethostname(), boot, pidns, os.getuid(), os.getpid(), process_start(os.getpid()) or 0)


def process_start(pid: int) -> int | None:
    """Start time of `pid` (field 22 of /proc/pid/stat), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[19])


def judge(value: bytes, headers: dict[str, str] | None, me: Holder,
          start_of: Callable[[int], int | None] = process_start) -> tuple[str, str]:
    """What the current entry of a key means for a worker that wants to run it:
    ("done" | "free" | "dead" | "busy", who). Any value that is neither a lease nor a deletion
    counts as done, so an operator can mark a key done by hand (`nats kv put BUCKET KEY x`)."""
    if (headers or {}).get(KV_OPERATION) in ("DEL", "PURGE"):
        return "free", ""
    if not value.startswith(b"lease "):
        return "done", value.decode(errors="replace")[:80]
    holder = Holder.parse(value)
    if holder is None:
        return "busy", "an unreadable lease"
    same_place = holder.boot and (holder.boot, holder.pidns, holder.uid) == (me.boot, me.pidns, me.uid)
    if same_place and start_of(holder.pid) != holder.start:
        return "dead", holder.describe()
    return "busy", holder.describe()


def retry_after(delay: float, lease_ttl: float) -> float:
    """A guarded job comes back after `delay` (workers.retry_backoff by delivery), at least
    MIN_RETRY and at most one lease lifetime: a dead holder's lease is gone by then."""
    return min(max(delay, MIN_RETRY), float(lease_ttl))


# ---------------------------------------------------------------- the guard

class Guard:
    def __init__(self, nc: Any, bucket: str, name: str, delay_for: Callable[[int], float],
                 lease_ttl: int = LEASE_TTL, scope: str = ""):
        self.nc, self.js = nc, nc.jetstream()
        self.bucket, self.name = bucket, name
        self.scope = scope                               # before every key: a pool's own done-markers (scope_of)
        self.stream, self.prefix = f"KV_{bucket}", f"$KV.{bucket}."
        self.delay_for = delay_for
        self.lease_ttl = lease_ttl
        self.me = this_process()
        self.held: dict[str, tuple[int, bytes]] = {}     # job key -> (revision, value) of our lease
        self.lost: dict[str, tuple[int, bytes]] = {}     # leases that expired or were taken over mid-job
        self.last_warning = 0.0
        self.renewer: asyncio.Task | None = None

    def kv_key(self, job_key: str) -> str:
        return self.scope + kv_key(job_key)

    def start(self) -> Guard:
        self.renewer = asyncio.ensure_future(self.renew_forever())
        return self

    async def close(self) -> None:
        """Stop renewing; release the leases of jobs we will not finish (we are exiting)."""
        if self.renewer:
            self.renewer.cancel()
        await asyncio.gather(*(self.release(k) for k in list(self.held)))

    # -- before the handler

    async def before(self, job: Any) -> Verdict:
        try:
            verdict = await self.claim(job)
        except Exception as exc:
            return self.unavailable(job, exc)
        if verdict.action == DUPLICATE:
            log.debug("%s: job seq=%d key=%s is already done (%s); acked without running it", self.name,
                      job.stream_seq, job.key, verdict.reason, extra={"event": "duplicate"})
        return verdict

    async def claim(self, job: Any) -> Verdict:
        key, value = self.kv_key(job.key), self.me.lease_value(secrets.token_hex(4), job)
        try:
            revision = await self.write(key, value, last=0, ttl=self.lease_ttl)
        except Conflict:
            return await self.contend(job, key, value)
        self.held[job.key] = (revision, value)
        return Verdict(RUN)

    async def contend(self, job: Any, key: str, value: bytes) -> Verdict:
        """The key has an entry: done, someone's lease, or a deletion."""
        current = await self.read(key)
        last = 0
        if current is not None:
            state, who = judge(current.data or b"", current.headers, self.me)
            if state == "done":
                return Verdict(DUPLICATE, reason=who)
            if state == "busy":
                return self.busy(job, f"key {job.key} is leased by {who}, who is running it")
            if state == "dead":
                log.info("%s: job seq=%d key=%s: taking over the lease of %s, which is gone", self.name,
                         job.stream_seq, job.key, who, extra={"event": "lease_taken_over"})
            last = current.seq
        try:
            revision = await self.write(key, value, last=last, ttl=self.lease_ttl)
        except Conflict:
            return self.busy(job, f"another worker claimed key {job.key} first")
        self.held[job.key] = (revision, value)
        return Verdict(RUN)

    def busy(self, job: Any, reason: str) -> Verdict:
        return Verdict(RETRY, retry_after(self.delay_for(job.delivery), self.lease_ttl), reason)

    def unavailable(self, job: Any, exc: Exception) -> Verdict:
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        now = time.monotonic()
        if now - self.last_warning >= WARN_EVERY:
            self.last_warning = now
            log.warning("%s: idempotency bucket %s unavailable (%s); NAKing jobs with backoff, none runs unguarded",
                        self.name, self.bucket, why, extra={"event": "idempotency_unavailable"})
        return Verdict(RETRY, max(self.delay_for(job.delivery), MIN_RETRY), f"idempotency bucket unavailable: {why}"[:200])

    # -- after the handler

    async def after(self, job: Any, succeeded: bool) -> None:
        """Succeeded: the done-marker replaces our lease (the runtime acks next). Failed: the lease
        is deleted so that the redelivery can run at once."""
        if not succeeded:
            await self.release(job.key)
            return
        held = self.held.pop(job.key, None) or self.lost.pop(job.key, None)
        if held is None:
            return
        key = self.kv_key(job.key)
        done = (f"done seq={job.stream_seq} delivery={job.delivery} pid={self.me.pid} host={self.me.host} "
                f"at={time.time():.3f}").encode()
        try:
            if await self.replace(key, held, done) is None:
                await self.write(key, done, last=None)        # the job is done, whoever holds the lease now
        except Exception as exc:
            # The job is done; NAKing it now would run it again for certain. Ack it without a
            # marker: only a later duplicate of it (redelivery, re-publish) could run again.
            log.error("%s: job seq=%d key=%s done but its done-marker was not written (%s); acking it anyway",
                      self.name, job.stream_seq, job.key, f"{type(exc).__name__}: {exc}",
                      extra={"event": "done_marker_failed"})

    async def release(self, job_key: str) -> None:
        held = self.held.pop(job_key, None) or self.lost.pop(job_key, None)
        if held is None:
            return
        try:
            await self.replace(self.kv_key(job_key), held, b"", op="DEL")
        except Exception as exc:         # it expires by its TTL anyway
            log.debug("%s: releasing the lease on key %s: %s", self.name, job_key, exc)

    async def replace(self, key: str, held: tuple[int, bytes], value: bytes, *, ttl: int | None = None,
                      op: str | None = None) -> int | None:
        """Write over our lease; None when it is not ours any more (expired, or taken over). A
        renewal racing us may have moved its revision: if the entry is still our lease, use that."""
        revision, ours = held
        try:
            return await self.write(key, value, last=revision, ttl=ttl, op=op)
        except Conflict:
            current = await self.read(key)
            if current is None or current.data != ours:
                return None
            return await self.write(key, value, last=current.seq, ttl=ttl, op=op)

    # -- renewing leases of running jobs

    async def renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ttl / 3)
            await asyncio.gather(*(self.renew(k, held) for k, held in list(self.held.items())))

    async def renew(self, job_key: str, held: tuple[int, bytes]) -> None:
        try:
            revision = await self.replace(self.kv_key(job_key), held, held[1], ttl=self.lease_ttl)
        except Exception as exc:         # the next round tries again; the TTL leaves room for two misses
            log.debug("%s: renewing the lease on key %s: %s", self.name, job_key, exc)
            return
        if self.held.get(job_key) != held:
            return                       # the job finished meanwhile
        if revision is None:
            log.warning("%s: the lease on key %s expired or was taken over while its job runs here", self.name,
                        job_key, extra={"event": "lease_lost"})
            self.lost[job_key] = self.held.pop(job_key)
        else:
            self.held[job_key] = (revision, held[1])

    # -- the bucket, by subject (nats-py's KeyValue has no TTL on update)

    async def write(self, key: str, value: bytes, *, last: int | None, ttl: int | None = None,
                    op: str | None = None) -> int:
        return await kv_write(self.nc, self.prefix + key, value, last=last, ttl=ttl, op=op)

    async def read(self, key: str) -> Any:
        try:
            return await self.js.get_msg(self.stream, subject=self.prefix + key)
        except NotFoundError:
            return None


async def kv_write(nc: Any, subject: str, value: bytes, *, last: int | None, ttl: int | None = None,
                   op: str | None = None, timeout: float = KV_TIMEOUT) -> int:
    """A KV write (a JetStream publish to `$KV.<bucket>.<key>`) by a plain request, its revision
    back: js.publish costs 70% more client CPU (its PubAck dataclass), and the guard writes twice
    per job. `last`: the revision the key must be at (0: the key must have no value); Conflict
    when it is not. `ttl`: whole seconds the value lives (Nats-TTL)."""
    headers = {} if last is None else {"Nats-Expected-Last-Subject-Sequence": str(last)}
    if ttl is not None:
        headers["Nats-TTL"] = str(int(ttl))
    if op:
        headers[KV_OPERATION] = op
    reply = json.loads((await nc.request(subject, value, timeout=timeout, headers=headers or None)).data)
    error = reply.get("error")
    if error:
        if error.get("err_code") == WRONG_LAST_SEQUENCE:
            raise Conflict(subject)
        raise BucketError(f"{error.get('description', 'error')} (err_code {error.get('err_code')})")
    return int(reply["seq"])


# ---------------------------------------------------------------- the guard as a worker's middleware

class IdempotencyGuard(Middleware):
    """[idempotency] on the middleware API: claim before the handler, done-marker (or release)
    after it, the held leases released when the worker exits. Its hooks are async: for a sync
    handler they run on the worker's loop while the handler thread waits (chain.py)."""

    def __init__(self, bucket: str, delay_for: Callable[[int], float], scope: str = ""):
        self.bucket, self.delay_for, self.scope = bucket, delay_for, scope
        self.guard: Guard | None = None

    async def setup(self, ctx: Context) -> None:
        self.guard = Guard(ctx.nc, self.bucket, f"worker {ctx.slot}", self.delay_for, scope=self.scope).start()

    async def before_job(self, job: Job) -> None:
        assert self.guard is not None, "setup() makes the guard"
        verdict = await self.guard.before(job)
        if verdict.action == DUPLICATE:
            raise Duplicate(f"duplicate: {verdict.reason}"[:200])
        if verdict.action == RETRY:
            raise Retry(verdict.delay, reason=verdict.reason)

    async def after_job(self, job: Job, outcome: str, error: BaseException | None) -> None:
        """The done-marker before the ack; a failed job's lease released for its redelivery."""
        assert self.guard is not None, "setup() makes the guard"
        await self.guard.after(job, outcome == "ack")

    async def close(self) -> None:
        if self.guard:
            await self.guard.close()   # leases of jobs we did not finish: free for their redelivery
