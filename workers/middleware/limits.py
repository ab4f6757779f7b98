"""[limits.NAME] in a worker: fleet-wide slots and starts kept in a KV bucket (the layout, shared
with the parent: workers/protocol/limitkeys.py), the built-in middleware that holds a job's
limits for its whole run (`subjects`), and `limit("NAME")`, which holds one for part of a job.

    from workers import limit

    def handle(job):                   # a sync handler: blocks its thread while it waits
        with limit("db"):
            write(job)

    async def handle(job):             # an async handler: waits on the loop
        async with limit("db"):
            await write(job)

Taking a limit (`Gate.take`): its concurrency slot (a key written with "expected last subject
sequence 0": one request when one is free), then, when it has a rate, a start (a key that lives
for the rate's window). Nothing is NAKed while waiting, so no delivery attempt is spent: a job
waits where it is, held (and kept alive by the parent's +WPI like any held job).
  - Each worker takes a limit for its waiters in FIFO order, for up to BATCH of them at once
    (their requests sent together, one round trip).
  - A slot stays the worker's from job to job while nobody elsewhere waits for it (Gate.give_back):
    handed straight to the next job waiting here, or kept as a spare for LINGER that the next job
    takes at once (`take_now`: no task, no request). The key is never given up meanwhile, so the
    fleet's count of holders is unchanged and a death still frees it. A worker that finds the
    limit full says so on core NATS (`wanted_subject`); for CONTENDED_FOR after that word every
    slot goes back to the fleet when its job ends, and never later than KEEP_FOR after it was
    taken from the bucket.
  - A holder that gives a slot back purges its key (up to its own revision: never a later
    holder's) and says so on core NATS (`freed_subject`); every worker waiting for that limit
    tries that slot at once. Without a word (lost, or a holder's host died and its lease ran out)
    a waiter looks again every POLL seconds, at SCAN slots at most.
  - A rate's starts: a waiter knows, from the keys' timestamps, when the next one frees (the
    server stamps them; compared with this host's clock, so a skewed clock only makes it look
    too early or too late, never run over the rate).
  - The bucket does not answer (deleted, a leader election, NATS away): it waits and tries again
    every UNAVAILABLE_RETRY, saying so at most every WARN_EVERY. A job never runs without its limit.
  - Held slots are renewed every RENEW_EVERY; a slot is gone LEASE_TTL after its holder last
    renewed it. A worker that dies holding one has it released by its parent at once
    (supervisor/nats/limits.py, matching the holder's pid in the value).

Whole-job limits do not take a handler while they wait (`Limits.park`): a pulled job that needs
one and cannot have it at once (`Limits.hold_now`) is parked (it stays in the slot table, HELD)
until it has them, then goes first in the worker's queue; jobs that need none go on past it.
Which parked jobs try for their limits, and when (only while a handler is free for them), is
workers/middleware/parking.py; a job that waits for a full limit takes no handler, and how many
such a worker holds beside what it runs is pull sizing's (workers/runtime/pulls.py). A drain
NAKs parked jobs at once (they never started); a retirement lets them wait, within
graceful_timeout.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sized
from dataclasses import dataclass
from typing import Any, Protocol

from nats.js.errors import NotFoundError

from supervisor.config import Config
from supervisor.config.subjects import subject_matches
from workers import Job
from workers.middleware.base import Context, Middleware
from workers.middleware.guard import KV_TIMEOUT, Conflict, kv_write
from workers.middleware.parking import Parking, delivery_key
from workers.protocol import slots
from workers.protocol.limitkeys import (
    LEASE_TTL,
    RENEW_EVERY,
    Holder,
    freed_subject,
    rate_key,
    rate_window,
    slot_key,
    wanted_subject,
    words_subject,
)

log = logging.getLogger("worker")

POLL = 0.5                 # seconds between looks at a full limit's slots when no holder said one was freed
SCAN = 8                   # slots (or rate keys) tried per look, at most
UNAVAILABLE_RETRY = 0.5    # the bucket did not answer: try again this soon
WARN_EVERY = 10.0          # an unavailable bucket is logged at most this often per worker
EARLY_RETRY = 0.02         # a start should be free by now but is not (the server expires a little late)
BATCH = 64                 # waiters a worker takes a limit for at once (their requests sent together)
KEEP_FOR = 5.0             # a slot passed from job to job in one worker goes back to the fleet after this long
CONTENDED_FOR = 2.0        # after a worker elsewhere said it waits, slots go back to the fleet after each job this long
WANT_EVERY = 0.25          # a worker waiting for a full limit says so at most this often (and at every look: POLL)
LINGER = 0.5               # a slot nobody here waits for stays a spare this long while the limit has room
NAMES_KEPT = 1024          # subjects whose whole-job limits a worker remembers
RTT_SAMPLES = 8            # a take's round trip is the worst of this many recent ones (the look-ahead's)


@dataclass
class Grant:
    """A limit held: its slot (None without a concurrency cap), given back once."""
    gate: Gate
    slot: int | None
    counted: bool = False      # counted in the table's in-use word (handed to a waiter)


class Gate:
    """One limit in one worker: its waiters, the slots it holds, what it knows of the starts."""

    def __init__(self, limiter: Limiter, index: int, name: str, concurrency: int, rate: float):
        self.limiter, self.index, self.name = limiter, index, name
        self.concurrency = concurrency
        self.starts = Starts(limiter, name, rate) if rate else None
        self.waiters: deque[tuple[asyncio.Future[Grant], Callable[[], None] | None]] = deque()
        self.server: asyncio.Task | None = None
        self.freed = asyncio.Event()
        self.hints: set[int] = set()          # slots someone said were freed
        self.scan_due = True                  # look at SCAN slots, not only the hinted ones
        self.roomy = False                    # the last look found a free slot: look every time
        self.spares: list[int] = []           # slots taken, not handed yet (waiting for a start)
        self.held: dict[int, int] = {}        # our slots: index -> revision
        self.kept: dict[int, float] = {}      # our slots: index -> when taken from the bucket (monotonic)
        self.idle: dict[int, float] = {}      # spares lingering: index -> since when (monotonic)
        self.lingering: asyncio.TimerHandle | None = None     # the next look at what lingers too long
        self.wanted_until = 0.0               # a worker elsewhere waits for this limit until then (monotonic)
        self.taking = False                   # serve() has a take's requests out
        self.full = False                     # the last look found it full: a new waiter waits at once
        self.wanted_at = -WANT_EVERY          # when this worker last said it waits

    # -- for the waiters

    async def take(self, waiting: Callable[[], None] | None = None, counted: bool = True) -> Grant:
        """Wait until this worker holds the limit for the caller (FIFO among its waiters).
        `waiting` is called once if the limit was not to be had at once: the caller waits.
        `counted`: the wait is counted in the table's waiting word here (else by the caller)."""
        future: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        told: list[bool] = []

        def wait_begins() -> None:
            told.append(True)
            if counted and self.limiter.table is not None:
                self.limiter.table.limit_add(self.index, slots.LIMIT_WAITING)
            if waiting is not None:
                waiting()
        self.waiters.append((future, wait_begins))
        since = time.monotonic()
        if self.full:                          # full at the last look: it waits for a word or a poll
            self.waiters[-1] = (future, None)
            wait_begins()
        if self.server is None or self.server.done():
            self.server = asyncio.ensure_future(self.serve())
        table = self.limiter.table          # the one the wait is counted in, begun to end
        if table is not None:
            table.limit_wait_begins(self.index, since)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.give_back(future.result())      # granted just as the caller gave up
            raise
        finally:
            if table is not None:
                if told and counted:
                    table.limit_add(self.index, slots.LIMIT_WAITING, -len(told))
                table.limit_wait_ends(self.index, since, time.monotonic())

    def give_back(self, grant: Grant) -> None:
        """On the loop: the holder is done (or never started); a grant given back already is
        ignored. The slot goes to the next job waiting for it here, lingers, or is released in the
        background (the bucket's TTL frees it if that fails): see below."""
        if grant.counted and self.limiter.table is not None:
            self.limiter.table.limit_add(self.index, slots.LIMIT_IN_USE, -1)
        grant.counted = False
        slot, grant.slot = grant.slot, None
        if slot is None or slot not in self.held:
            return
        now = time.monotonic()
        if self.starts or now < self.wanted_until or now - self.kept.get(slot, 0.0) >= KEEP_FOR:
            self.release(slot)
        elif self.someone_waits():
            self.hand(Grant(self, slot))
        elif self.roomy:
            self.linger(slot)
        else:
            self.release(slot)

    # A slot given back can stay this worker's for its next job, with no trip to the bucket: the
    # key stays ours (same revision, renewed, naming this worker), so the fleet's count of holders
    # does not change, and a death still frees it. It goes straight to the next job waiting here,
    # or, while the last look found room, it lingers as a spare for LINGER. Only while no worker
    # elsewhere said it waits for the limit (`wanted`, within CONTENDED_FOR): then every slot goes
    # back to the fleet when its job ends, and the waiters race for it as before. Never past
    # KEEP_FOR since it was taken from the bucket (a lost word cannot keep a slot here for good).
    # Not for a limit with a rate (each job needs a start of its own).

    def wanted(self) -> None:
        """A worker elsewhere waits for this limit: no slot stays here past its job for a while,
        and spares go back now."""
        self.wanted_until = time.monotonic() + CONTENDED_FOR
        if self.lingering is not None:
            self.lingering.cancel()
            self.end_lingering(everything=True)

    def want(self) -> None:
        """This worker waits for a full limit: say so (at most every WANT_EVERY)."""
        now = time.monotonic()
        if now - self.wanted_at >= WANT_EVERY:
            self.wanted_at = now
            self.limiter.want(self.name)

    def release(self, slot: int) -> None:
        revision = self.held.pop(slot)
        self.kept.pop(slot, None)
        self.idle.pop(slot, None)
        self.limiter.spawn(self.limiter.release(self.name, slot, revision))

    def linger(self, slot: int) -> None:
        self.spares.append(slot)
        self.idle[slot] = time.monotonic()
        if self.lingering is None:
            self.lingering = asyncio.get_running_loop().call_later(LINGER, self.end_lingering)

    def end_lingering(self, everything: bool = False) -> None:
        """Spares that lingered LINGER (or all of them) go back to the fleet. A waiter takes the
        one that lingered last first (`attempt`, `take_now`), so what a worker holds shrinks to
        what it uses."""
        self.lingering = None
        now, keep = time.monotonic(), []
        for slot in self.spares:
            since = self.idle.get(slot)
            if since is None or (now - since < LINGER and not everything):
                keep.append(slot)             # not lingering (a start's wait), or not for long
            elif slot in self.held:
                self.release(slot)
        self.spares = keep
        if self.idle:
            due = min(self.idle.values()) + LINGER - time.monotonic()
            self.lingering = asyncio.get_running_loop().call_later(max(due, 0.0), self.end_lingering)

    # -- taking it for them, a batch of attempts at a time

    async def serve(self) -> None:
        while self.someone_waits() and not self.limiter.closing:
            self.limiter.admit()                  # jobs with no handler free for them withdraw (Limits.rebalance)
            if not self.someone_waits():
                break
            self.full = False
            self.taking = True                    # requests out: Limiter.close lets them come back
            try:
                grants, wait = await self.attempt(min(self.live_waiters(), BATCH))
            except Exception as exc:              # the bucket does not answer: wait, never run unlimited
                self.taking = False
                self.limiter.unavailable(self.name, exc)
                self.tell_waiting()
                await asyncio.sleep(UNAVAILABLE_RETRY)
                continue
            self.taking = False
            for grant in grants:
                self.hand(grant)
            if grants or self.limiter.closing:
                continue
            self.tell_waiting()
            if self.concurrency:
                self.want()
            await wait()
        unused = [k for k in self.spares if k not in self.idle]     # nobody left to give them to
        self.spares = [k for k in self.spares if k in self.idle]
        for slot in unused:
            self.give_back(Grant(self, slot))

    def someone_waits(self) -> bool:
        while self.waiters and self.waiters[0][0].done():     # gave up (a drain cancelled it)
            self.waiters.popleft()
        return bool(self.waiters)

    def live_waiters(self) -> int:
        return sum(not future.done() for future, _ in self.waiters)

    def tell_waiting(self) -> None:
        """The limit is not to be had now: each waiter not told yet is told, once (and so is each
        that comes before the next look: `full`)."""
        self.full = True
        for k, (future, told) in enumerate(list(self.waiters)):
            if told is not None and not future.done():
                told()
                self.waiters[k] = (future, None)

    async def attempt(self, n: int) -> tuple[list[Grant], Callable[[], Awaitable[None]]]:
        """The limit for up to n waiters (its requests sent together), or none and how to wait
        for a chance of it."""
        if self.concurrency:
            if len(self.spares) < n:
                await self.take_slots(n - len(self.spares))
            if not self.spares:
                return [], self.wait_freed
            n = min(n, len(self.spares))
        if self.starts:
            n = await self.starts.take(n)
            if not n:
                return [], self.starts.wait
        if not self.concurrency:
            return [Grant(self, None) for _ in range(n)], self.wait_freed
        handed, self.spares = self.spares[len(self.spares) - n:], self.spares[:len(self.spares) - n]
        for slot in handed:
            self.idle.pop(slot, None)
        return [Grant(self, slot) for slot in handed], self.wait_freed

    def hand(self, grant: Grant) -> None:
        while self.waiters:
            future, _ = self.waiters.popleft()
            if not future.done():
                future.set_result(self.counted(grant))
                return
        self.give_back(grant)

    def take_now(self) -> Grant | None:
        """A lingering spare slot for the caller at once (no task, no request), when nobody here
        waits before it; else None (take() then)."""
        if self.starts or not self.spares or self.someone_waits():
            return None
        slot = self.spares.pop()
        self.idle.pop(slot, None)
        return self.counted(Grant(self, slot))

    def counted(self, grant: Grant) -> Grant:
        grant.counted = True
        table = self.limiter.table
        if table is not None:
            table.limit_add(self.index, slots.LIMIT_IN_USE)
            table.limit_add(self.index, slots.LIMIT_TAKEN)
        return grant

    # -- concurrency slots

    async def take_slots(self, n: int) -> None:
        """Up to n more slots into `spares`: the candidates tried n at a time, each batch's
        requests sent together. A bucket error is raised only when nothing was taken."""
        hinted, looks = self.candidates(n)
        queue, taken, found = hinted + looks, 0, False
        while queue and taken < n:
            batch, queue = queue[:n - taken], queue[n - taken:]
            sent = time.monotonic()
            results = await asyncio.gather(*(self.limiter.create(slot_key(self.name, k), LEASE_TTL) for k in batch),
                                           return_exceptions=True)
            self.limiter.timed(time.monotonic() - sent)
            failure: BaseException | None = None
            for k, result in zip(batch, results):
                if isinstance(result, Conflict):
                    continue
                if isinstance(result, BaseException):
                    failure = failure or result
                    continue
                self.held[k], self.kept[k] = result, time.monotonic()
                self.spares.append(k)
                taken += 1
                found = found or k not in hinted
            if failure is not None and not taken:
                raise failure
        if found:
            self.roomy = True
        elif looks and not queue:
            self.roomy = False                # all it looked at is taken: wait for a word, or POLL

    def candidates(self, n: int = 1) -> tuple[list[int], list[int]]:
        """Slots worth a try: the ones said to be freed, and SCAN (or n) others when a look is due
        or the last look found room. (Waiting for a word while the limit has room would make every
        take wait for the last holder's release: measured, `python -m bench --only limits`.)"""
        hinted = [k for k in self.hints if k not in self.held and k < self.concurrency]
        self.hints.clear()
        if not (self.scan_due or self.roomy):
            return hinted, []
        self.scan_due = False
        looks = random.sample(range(self.concurrency), min(max(SCAN, n), self.concurrency))   # O(n), any size
        return hinted, [k for k in looks if k not in self.held and k not in hinted]

    async def wait_freed(self) -> None:
        if self.hints:
            return
        self.freed.clear()
        try:
            await asyncio.wait_for(self.freed.wait(), POLL * (1 + random.random() / 2))
        except TimeoutError:
            self.scan_due = True

    def on_freed(self, k: int) -> None:
        self.hints.add(k)
        self.full = False
        self.freed.set()

    def known_full(self) -> bool:
        """The last look found the limit full and no word since said a slot was freed."""
        return self.full

class Starts:
    """A rate's starts in one worker (rate_window: `keys` start keys of `window` seconds each): what
    it knows of when each taken key frees, and where it looks next."""

    def __init__(self, limiter: Limiter, name: str, rate: float):
        self.limiter, self.name = limiter, name
        self.keys, self.window = rate_window(rate)
        self.free_at: dict[int, float] = {}    # start key -> when it frees (monotonic, estimated) ...
        self.cursor = random.randrange(self.keys)     # ... and where to look next

    async def take(self, n: int) -> int:
        """Up to n starts (how many taken): candidates tried n at a time, their requests sent
        together. A start once taken is spent (it frees itself with its window), so a bucket error
        is raised only when none was taken."""
        queue, taken = self.candidates(time.monotonic(), n), 0
        while queue and taken < n:
            batch, queue = queue[:n - taken], queue[n - taken:]
            sent = time.monotonic()
            results = await asyncio.gather(*(self.limiter.create(rate_key(self.name, k), self.window) for k in batch),
                                           return_exceptions=True)
            self.limiter.timed(time.monotonic() - sent)
            failure: BaseException | None = None
            refused = []
            for k, result in zip(batch, results):
                if isinstance(result, Conflict):
                    refused.append(k)
                elif isinstance(result, BaseException):
                    failure = failure or result
                else:
                    self.free_at[k] = time.monotonic() + self.window
                    self.cursor = (k + 1) % self.keys
                    taken += 1
            frees = await asyncio.gather(*(self.limiter.frees_at(rate_key(self.name, k), self.window) for k in refused))
            self.free_at.update(zip(refused, frees))
            if failure is not None and not taken:
                raise failure
        return taken

    def candidates(self, now: float, n: int = 1) -> list[int]:
        """Start keys worth a try, not known to be taken: a few keys (SCAN, or n) from where this
        worker's cursor stands (workers start at random places, so they seldom collide), any
        number of keys in all. What is known to free later is forgotten once it has."""
        self.free_at = {k: t for k, t in self.free_at.items() if t > now}
        want = max(SCAN, n)
        ahead = [(self.cursor + i) % self.keys for i in range(min(self.keys, 4 * want))]
        return [k for k in ahead if k not in self.free_at][:want]

    async def wait(self) -> None:
        soonest = min(self.free_at.values(), default=0.0) - time.monotonic()
        await asyncio.sleep(min(max(soonest, EARLY_RETRY), float(self.window)) + random.random() * 0.005)


class Limiter:
    """A worker's limits: a Gate per [limits.NAME], the renewal of held slots, the freed-slot
    subscription, and the bucket's requests."""

    def __init__(self, nc: Any, loop: asyncio.AbstractEventLoop, cfg: Config, slot: int,
                 table: slots.SlotTable | None):
        self.nc, self.loop, self.slot, self.table = nc, loop, slot, table
        self.bucket = cfg.fleet.limits_bucket
        self.stream, self.prefix = f"KV_{self.bucket}", f"$KV.{self.bucket}."
        self.holder = Holder(socket.gethostname(), os.getppid(), os.getpid(), secrets.token_hex(4))
        self.value = self.holder.value()
        self.gates = {name: Gate(self, k, name, lim.concurrency, lim.rate) for k, (name, lim) in
                      enumerate(cfg.limits.items())}
        self.tasks: set[asyncio.Task] = set()
        self.renewer: asyncio.Task | None = None
        self.sub: Any = None
        self.last_warning = 0.0
        self.lost = 0
        self.closing = False
        # The worker exits with a handler thread still running a job (graceful_timeout ran out:
        # a thread cannot be cancelled): giving its slots back here would let another worker
        # start beside it until the process ends (F23, seed 1170: 15 ms over a cap of 1).
        self.keep_held = False
        self.admit: Callable[[], None] = lambda: None    # before each take: Limits.rebalance
        self.rtts: deque[float] = deque(maxlen=RTT_SAMPLES)

    def timed(self, seconds: float) -> None:
        self.rtts.append(seconds)

    @property
    def take_rtt(self) -> float:
        """A take's round trip to the bucket: the worst of the last RTT_SAMPLES."""
        return max(self.rtts, default=0.0)

    async def start(self) -> Limiter:
        self.sub = await self.nc.subscribe(words_subject(self.bucket), cb=self.on_word)
        self.renewer = asyncio.ensure_future(self.renew_forever())
        return self

    async def close(self) -> None:
        """The worker exits: stop waiting, give back every slot it holds (for the next holder now,
        not after their TTL). A take whose requests are out is let finish first (within
        KV_TIMEOUT): cancelled, a slot the server wrote for it would be held by nobody until its
        TTL (found by `python -m chaos --random --seed 56`: a recycled worker's exit stalled a
        cap of 1 for 10 s)."""
        self.closing = True
        if self.renewer is not None:
            self.renewer.cancel()
        if self.keep_held:                # a handler runs on: the parent releases them once we are gone
            return
        servers = [g.server for g in self.gates.values() if g.server is not None and not g.server.done()]
        taking = [g.server for g in self.gates.values() if g.server in servers and g.taking]
        for task in servers:
            if task not in taking:
                task.cancel()                     # waiting (a word, a poll, a start): nothing out
        if taking:
            await asyncio.wait(taking, timeout=KV_TIMEOUT + 1.0)
            for task in taking:
                task.cancel()
        releases = [self.release(g.name, k, rev) for g in self.gates.values() for k, rev in g.held.items()]
        for g in self.gates.values():
            if g.lingering is not None:
                g.lingering.cancel()
            g.held.clear()
            g.kept.clear()
            g.idle.clear()
            g.spares.clear()
        await asyncio.gather(*releases, *self.tasks, return_exceptions=True)

    def gate(self, name: str) -> Gate:
        gate = self.gates.get(name)
        if gate is None:
            known = ", ".join(self.gates) or "none"
            raise LookupError(f"no [limits.{name}] in the config (limits: {known})")
        return gate

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- the bucket

    async def create(self, key: str, ttl: int) -> int:
        """Write our value to a key that must have none; its revision (Conflict: someone's)."""
        return await kv_write(self.nc, self.prefix + key, self.value, last=0, ttl=ttl)

    async def release(self, name: str, k: int, revision: int) -> None:
        """Purge slot k up to our revision (a later holder's value stays), then say so."""
        subject = self.prefix + slot_key(name, k)
        try:
            reply = json.loads((await self.nc.request(f"$JS.API.STREAM.PURGE.{self.stream}", json.dumps(
                {"filter": subject, "seq": revision + 1}).encode(), timeout=KV_TIMEOUT)).data)
            if "error" in reply:
                raise RuntimeError(reply["error"].get("description", "purge refused"))
            await self.nc.publish(freed_subject(self.bucket, name), str(k).encode())
        except Exception as exc:          # its TTL frees it
            log.info("worker %d: limit %s slot %d not released (%s); it frees itself within %ds", self.slot, name,
                     k, f"{type(exc).__name__}: {exc}", LEASE_TTL, extra={"event": "limit_release_failed"})

    async def frees_at(self, key: str, window: int) -> float:
        """When the start on `key` expires (monotonic), from the server's timestamp of it."""
        try:
            msg = await self.nc.jetstream().get_msg(self.stream, subject=self.prefix + key)
        except NotFoundError:
            return 0.0
        now = time.monotonic()
        if msg.time is None:
            return now + window
        left = msg.time.timestamp() + window - time.time()
        return now + min(max(left, 0.0), float(window))

    async def on_word(self, msg: Any) -> None:
        *_, name, word = msg.subject.split(".")
        gate = self.gates.get(name)
        if gate is None:
            return
        if word == "freed" and msg.data.isdigit():
            gate.on_freed(int(msg.data))
        elif word == "wanted" and msg.data != self.holder.nonce.encode():
            gate.wanted()

    def want(self, name: str) -> None:
        self.spawn(self.nc.publish(wanted_subject(self.bucket, name), self.holder.nonce.encode()))

    def unavailable(self, name: str, exc: Exception) -> None:
        now = time.monotonic()
        if now - self.last_warning >= WARN_EVERY:
            self.last_warning = now
            log.warning("worker %d: limits bucket %s unavailable (%s); jobs wait for limit %s, none runs without it",
                        self.slot, self.bucket, f"{type(exc).__name__}: {exc}", name,
                        extra={"event": "limit_unavailable", "limit": name})

    # -- renewing held slots

    async def renew_forever(self) -> None:
        while True:
            await asyncio.sleep(RENEW_EVERY)
            await asyncio.gather(*(self.renew(g, k, rev) for g in self.gates.values() for k, rev in
                                   list(g.held.items())))

    async def renew(self, gate: Gate, k: int, revision: int) -> None:
        """Renew slot k at `revision`. Two races with a renewal on its way are settled here:
          - the slot given back meanwhile: the release purged below `revision` + 1, and if this
            renewal landed after that purge was decided, its new revision stays, a slot held by
            nobody until its TTL. So a renewal that wrote a slot no longer held purges it too.
          - an earlier renewal that landed but whose answer timed out: our value is at a later
            revision, so this one conflicts. The slot is still ours (the value names this worker
            process): its revision is taken up, and it is renewed from there (or, given back
            while we read it, purged up to it).
        Every decision is made on what `held` says after the last await (a give-back may have
        come in while a request was out)."""
        key = slot_key(gate.name, k)
        try:
            new = await kv_write(self.nc, self.prefix + key, self.value, last=revision, ttl=LEASE_TTL)
        except Conflict:
            ours = await self.ours_at(key)
            if gate.held.get(k) != revision:      # given back meanwhile (also while we read it)
                if k not in gate.held and ours is not None and ours > revision:
                    await self.release(gate.name, k, ours)     # the purge below `revision` left it
                return
            if ours is not None and ours > revision:
                gate.held[k] = ours
                await self.renew(gate, k, ours)
                return
            del gate.held[k]                      # it expired (a long outage): someone may hold it now
            self.lost += 1
            log.warning("worker %d: limit %s slot %d expired while held (the bucket was away longer than %ds); "
                        "another job may hold it too now", self.slot, gate.name, k, LEASE_TTL,
                        extra={"event": "limit_slot_lost", "limit": gate.name})
            return
        except Exception as exc:                  # the next round tries again: the TTL leaves room for 4 misses
            log.debug("worker %d: renewing limit %s slot %d: %s", self.slot, gate.name, k, exc)
            return
        if gate.held.get(k) == revision:
            gate.held[k] = new
        elif k not in gate.held:                  # given back while this renewal was on its way
            await self.release(gate.name, k, new)

    async def ours_at(self, key: str) -> int | None:
        """The revision of `key` when its value is this worker process's, else None."""
        try:
            msg = await self.nc.jetstream().get_msg(self.stream, subject=self.prefix + key)
        except Exception:
            return None
        return int(msg.seq) if msg.data == self.value else None


# ---------------------------------------------------------------- the built-in middleware

_current: Limits | None = None         # this worker's, once set up (limit() uses it)


class WorkerView(Protocol):
    """What Limits.attach reads of the worker (workers/runtime/worker.py Worker)."""
    @property
    def table(self) -> slots.SlotTable: ...
    @property
    def wake_pull(self) -> asyncio.Event: ...
    @property
    def running(self) -> int: ...       # jobs taken from its queue (sync: handed to the threads), not finished
    @property
    def queue(self) -> Sized: ...       # pulled, not started
    @property
    def pulls(self) -> Any: ...         # its puller: `.sizer.job_time`, seconds per job per handler


class Limits(Middleware):
    """[limits]: holds each job's whole-job limits (those whose `subjects` match its subject)
    from before its first hook until it is settled, and serves `limit()`. The worker parks a job
    that needs limits until it has them (`park`), so `before_job` finds them taken already; it
    takes them itself only for a job that was not parked."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.whole = [(name, lim.subjects) for name, lim in sorted(cfg.limits.items()) if lim.subjects]
        self.names: dict[str, list[str]] = {}            # subject -> its whole-job limits (names_for)
        self.table: slots.SlotTable | None = None       # the worker's, set before setup()
        self.limiter: Limiter | None = None
        # By delivery: the Job a delivery made (`id(job)`, the job kept in the value, so the id
        # cannot be reused while the entry lives). Neither (seq, delivery) nor anything else the
        # server says is unique to a delivery: a job parked past AckWait (its +WPI stalled with the
        # parent's link) can be redelivered to this same worker while its first delivery still
        # waits, at delivery 1 again if the server lost the consumer's state meanwhile, and each
        # delivery has its own grants to give back.
        self.granted: dict[int, tuple[Job, list[Grant]]] = {}     # the job's whole-job limits
        self.parked = Parking(self, cfg.workers.concurrency)      # jobs waiting for theirs: which try, when
        self.wake_pull: Callable[[], None] = lambda: None   # the worker's: a parked job waits, pull for its handler
        self.line: Callable[[], tuple[int, float | None]] = lambda: (0, None)   # the worker's: (running or
        #                                                                         queued, job time)

    async def setup(self, ctx: Context) -> None:
        global _current
        self.limiter = await Limiter(ctx.nc, ctx.loop, ctx.cfg, ctx.slot, self.table).start()
        self.limiter.admit = self.parked.rebalance
        _current = self

    def keep_slots(self) -> None:
        """At the worker's exit: hold on to every slot (the parent releases them once the process
        is gone: its table still counts them in use, supervisor/parent/crew.py release_limits)."""
        if self.limiter is not None:
            self.limiter.keep_held = True

    async def close(self) -> None:
        global _current
        self.parked.close()
        if self.limiter is not None:
            await self.limiter.close()
        _current = None

    def attach(self, worker: WorkerView) -> None:
        """The worker's: its slot table (our waits and holdings, for the parent's /status), the
        event that wakes its pulls (set when a parked job waits: it frees its handler; and, a
        `Wake`, it nudges the parked jobs whenever the worker's room changes), and what it runs
        (jobs running or queued, the job time): which parked jobs may take their limits."""
        self.table, self.wake_pull = worker.table, worker.wake_pull.set
        self.line = lambda: (worker.running + len(worker.queue), worker.pulls.sizer.job_time)
        if isinstance(worker.wake_pull, Wake):
            worker.wake_pull.also = self.nudge

    def names_for(self, job: Job) -> list[str]:
        """The whole-job limits of `job`, in name order: every worker takes them in the same order,
        so two jobs that need two limits can never each hold one and wait for the other. Known
        per subject (at most NAMES_KEPT subjects: a subject per customer must not grow it)."""
        names = self.names.get(job.subject)
        if names is None:
            if len(self.names) >= NAMES_KEPT:
                self.names.clear()
            names = self.names[job.subject] = [name for name, subjects in self.whole
                                               if any(subject_matches(s, job.subject) for s in subjects)]
        return names

    def needs(self, job: Job) -> bool:
        return bool(self.whole) and bool(self.names_for(job))

    async def hold(self, job: Job, on_wait: Callable[[Gate], None] | None = None) -> None:
        """Take the job's whole-job limits (waiting as long as it takes). `on_wait(gate)`: a parked
        job's, told its limit is full (it counts its own wait: Parking.refused)."""
        assert self.limiter is not None, "setup() makes the limiter"
        grants: list[Grant] = []
        try:
            for name in self.names_for(job):
                gate = self.limiter.gate(name)
                told = None if on_wait is None else functools.partial(on_wait, gate)
                grants.append(await gate.take(told, counted=on_wait is None))
        except BaseException:
            for grant in grants:
                grant.gate.give_back(grant)
            raise
        self.granted[delivery_key(job)] = (job, grants)

    def hold_now(self, job: Job) -> bool:
        """A job just pulled: its whole-job limits at once if a handler is free for it and this
        worker has them to spare (`take_now`); else nothing is taken (the job is parked)."""
        return self.parked.may_take_now() and self.take_now(job)

    def take_now(self, job: Job) -> bool:
        """The job's whole-job limits from this worker's spares (Gate.take_now), all or none."""
        assert self.limiter is not None, "setup() makes the limiter"
        grants: list[Grant] = []
        for name in self.names_for(job):
            grant = self.limiter.gate(name).take_now()
            if grant is None:
                for taken in grants:
                    taken.gate.give_back(taken)
                return False
            grants.append(grant)
        self.granted[delivery_key(job)] = (job, grants)
        return True

    def first_gate(self, job: Job) -> Gate:
        assert self.limiter is not None, "setup() makes the limiter"
        return self.limiter.gate(self.names_for(job)[0])

    def take_rtt(self) -> float:
        return self.limiter.take_rtt if self.limiter is not None else 0.0

    def finished(self, job: Job) -> None:
        """The job is settled (or given back unrun): its whole-job limits go back."""
        _, grants = self.granted.pop(delivery_key(job), (job, ()))
        for grant in grants:
            grant.gate.give_back(grant)

    # -- the hooks

    async def before_job(self, job: Job) -> None:
        if delivery_key(job) not in self.granted and self.needs(job):
            await self.hold(job)

    async def after_job(self, job: Job, outcome: str, error: BaseException | None) -> None:
        self.finished(job)

    # -- parking: jobs waiting for their limits hold no handler (workers/middleware/parking.py)

    def park(self, item: Any, job: Job, admitted: Callable[[Any], None]) -> None:
        """Hold `item` (the worker's queue entry of `job`) until the job has its limits, then
        hand it to `admitted` (the front of the worker's queue)."""
        self.parked.park(item, job, admitted)

    def take_parked(self) -> list[Any]:
        """A drain: the parked jobs back (their takes cancelled, nothing held for them)."""
        return self.parked.take_back()

    def occupying(self) -> int:
        return self.parked.occupying()

    def pull_state(self) -> tuple[int, bool]:
        return self.parked.pull_state()

    def nudge(self) -> None:
        self.parked.nudge()


class limit:  # noqa: N801 (used like a function: `with limit("db"):`)
    """Hold the limit NAME ([limits.NAME]) for a block: `with limit("db"):` in a sync handler (its
    thread waits), `async with limit("db"):` in an async one. Waiting spends no delivery attempt.
    One object per block (they are cheap): `with limit("db"):` each time.

    A sync block is safe from workers.soft_timeout's SoftTimeout, which lands in the handler's
    thread at whatever bytecode it runs next (tests/unit/test_limit_blocks.py raises it at every
    point): the take runs on the worker's loop, which puts the grant in this thread's registry
    (`_Ticket`) before it wakes the thread, so whatever the thread had done when the exception
    came, the loop knows who holds what. `__enter__` raising withdraws the take (the loop gives
    back a grant already made); `__exit__` asks the loop to give back what the registry holds;
    and once the job is over (after the soft limit's disarm: nothing can be raised then),
    whatever a block could not give back is given back (`give_back_stranded`). The thread waits
    on a plain lock in steps of WAKE_EVERY, so a SoftTimeout raised while it waits ends the wait
    then, not when a slot comes."""

    def __init__(self, name: str):
        self.name = name
        self.grant: Grant | None = None           # async blocks
        self.ticket: _Ticket | None = None        # sync blocks

    def __enter__(self) -> limit:
        limiter = _limiter()
        if _on_the_loop(limiter.loop):
            raise RuntimeError("`with limit()` would block the worker's loop: in an async handler use "
                               "`async with limit()`")
        ticket = self.ticket = _Ticket(limiter.gate(self.name), _registry())
        try:
            limiter.loop.call_soon_threadsafe(ticket.start)
            while not ticket.ready.acquire(timeout=WAKE_EVERY):
                pass
        except BaseException:
            self.ticket = None
            limiter.loop.call_soon_threadsafe(ticket.withdraw)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        ticket = self.ticket
        if ticket is not None:
            ticket.gate.limiter.loop.call_soon_threadsafe(ticket.give_back)
            self.ticket = None

    async def __aenter__(self) -> limit:
        self.grant = await _limiter().gate(self.name).take()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        grant, self.grant = self.grant, None
        if grant is not None:
            grant.gate.give_back(grant)


WAKE_EVERY = 0.25                 # a sync block waiting for its limit looks up this often (a SoftTimeout lands then)
_blocks = threading.local()       # per thread: the grants its sync blocks hold (`_Ticket.held`)
_tickets = itertools.count(1)


def _registry() -> dict[int, Grant]:
    held = getattr(_blocks, "held", None)
    if held is None:
        held = _blocks.held = {}
    return held


class _Ticket:
    """One sync block's take, between its handler thread and the worker's loop. Every decision is
    made on the loop (one thread, so no race): the thread only posts `start`, then `give_back` or
    `withdraw`, in that order, and waits for `ready`. The grant is in the thread's registry
    (`held`) from the moment the loop makes it until the loop gives it back, so a grant is never
    held by nobody and never given back twice (Gate.give_back ignores a grant given back already)."""

    def __init__(self, gate: Gate, held: dict[int, Grant]):
        self.gate, self.held, self.key = gate, held, next(_tickets)
        self.ready = threading.Lock()
        self.ready.acquire()
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.take())

    async def take(self) -> None:
        grant = await self.gate.take()
        self.held[self.key] = grant
        self.ready.release()

    def withdraw(self) -> None:
        """`__enter__` raised: its take is cancelled (Gate.take gives back a grant made as it was),
        and a grant already made is given back."""
        if self.task is not None:
            self.task.cancel()
        self.give_back()

    def give_back(self) -> None:
        grant = self.held.pop(self.key, None)
        if grant is not None:
            grant.gate.give_back(grant)


class Wake(asyncio.Event):
    """A worker's `wake_pull`: set whenever its room changes (a job ended, a message or a 408 came,
    a parked job was admitted); with [limits] it also nudges the parked jobs (Limits.attach)."""

    def __init__(self) -> None:
        super().__init__()
        self.also: Callable[[], None] | None = None

    def set(self) -> None:
        super().set()
        if self.also is not None:
            self.also()


def give_back_stranded() -> None:
    """In a handler thread once its job is over and nothing can be raised in it any more: what a
    sync block of the job could not give back (a SoftTimeout landed in `__exit__` before it
    asked) goes back now. A plain read of this thread's registry: the loop only ever removes
    from it, and a block whose take is still under way has withdrawn it already."""
    held = getattr(_blocks, "held", None)
    if held and _current is not None and _current.limiter is not None:
        _current.limiter.loop.call_soon_threadsafe(_give_back_all, held)


def _give_back_all(held: dict[int, Grant]) -> None:
    for key in list(held):
        grant = held.pop(key, None)
        if grant is not None:
            grant.gate.give_back(grant)


def _limiter() -> Limiter:
    if _current is None or _current.limiter is None:
        raise LookupError("limit() needs a [limits.NAME] section in the config (and runs inside a worker)")
    return _current.limiter


def _on_the_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:                 # no loop in this thread: a handler thread
        return False
