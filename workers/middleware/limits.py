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
  - Each worker takes a limit for its waiters in turn (FIFO), one attempt at a time.
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
one is parked (it stays in the slot table, HELD) until it has them, then goes first in the
worker's queue; jobs that need none go on past it. A parked job counts as taking a handler
(for pull sizing: `occupying`) while it tries for its limits (most get them at once, and would
find the handler given away), and again beyond `workers.concurrency` of them waiting: a worker
holds at most `concurrency` jobs waiting for a limit on top of what it can run, and stops
pulling what it could not start. A drain NAKs parked jobs at once (they never started); a
retirement lets them wait, within graceful_timeout.
"""

from __future__ import annotations

import asyncio
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from nats.js.errors import NotFoundError

from supervisor.config import Config
from supervisor.config.subjects import subject_matches
from workers import Job
from workers.middleware.base import Context, Middleware
from workers.middleware.guard import KV_TIMEOUT, Conflict, kv_write
from workers.protocol import slots
from workers.protocol.limitkeys import (
    LEASE_TTL,
    RENEW_EVERY,
    Holder,
    freed_subject,
    rate_key,
    rate_window,
    slot_key,
)

log = logging.getLogger("worker")

POLL = 0.5                 # seconds between looks at a full limit's slots when no holder said one was freed
SCAN = 8                   # slots (or rate keys) tried per look, at most
UNAVAILABLE_RETRY = 0.5    # the bucket did not answer: try again this soon
WARN_EVERY = 10.0          # an unavailable bucket is logged at most this often per worker
EARLY_RETRY = 0.02         # a start should be free by now but is not (the server expires a little late)


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
        self.keys, self.window = rate_window(rate) if rate else (0, 0)
        self.waiters: deque[tuple[asyncio.Future[Grant], Callable[[], None] | None]] = deque()
        self.server: asyncio.Task | None = None
        self.freed = asyncio.Event()
        self.hints: set[int] = set()          # slots someone said were freed
        self.scan_due = True                  # look at SCAN slots, not only the hinted ones
        self.roomy = False                    # the last look found a free slot: look every time
        self.spare: int | None = None         # a slot taken, waiting for a start
        self.held: dict[int, int] = {}        # our slots: index -> revision
        self.starts_free: dict[int, float] = {}   # rate key -> when it frees (monotonic, estimated) ...
        self.cursor = random.randrange(self.keys) if self.keys else 0     # ... and where to look next

    # -- for the waiters

    async def take(self, waiting: Callable[[], None] | None = None) -> Grant:
        """Wait until this worker holds the limit for the caller (FIFO among its waiters).
        `waiting` is called once if the limit was not to be had at once: the caller waits."""
        future: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        told: list[bool] = []

        def wait_begins() -> None:
            told.append(True)
            if self.limiter.table is not None:
                self.limiter.table.limit_add(self.index, slots.LIMIT_WAITING)
            if waiting is not None:
                waiting()
        self.waiters.append((future, wait_begins))
        since = time.monotonic()
        if self.server is None or self.server.done():
            self.server = asyncio.ensure_future(self.serve())
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.give_back(future.result())      # granted just as the caller gave up
            raise
        finally:
            table = self.limiter.table
            if table is not None:
                table.limit_add(self.index, slots.LIMIT_WAITING, -len(told))
                table.limit_waited(self.index, time.monotonic() - since)

    def give_back(self, grant: Grant) -> None:
        """On the loop: the holder is done (or never started). The slot is released in the
        background; the bucket's TTL frees it if that fails."""
        if grant.counted and self.limiter.table is not None:
            self.limiter.table.limit_add(self.index, slots.LIMIT_IN_USE, -1)
        grant.counted = False
        if grant.slot is not None and grant.slot in self.held:
            slot, revision = grant.slot, self.held.pop(grant.slot)
            grant.slot = None
            self.limiter.spawn(self.limiter.release(self.name, slot, revision))

    # -- taking it for them, one attempt at a time

    async def serve(self) -> None:
        while self.someone_waits():
            try:
                grant, wait = await self.attempt()
            except Exception as exc:              # the bucket does not answer: wait, never run unlimited
                self.limiter.unavailable(self.name, exc)
                self.tell_waiting()
                await asyncio.sleep(UNAVAILABLE_RETRY)
                continue
            if grant is not None:
                self.hand(grant)
                continue
            self.tell_waiting()
            await wait()
        if self.spare is not None:                # nobody left to give it to
            self.give_back(Grant(self, self.spare))
            self.spare = None

    def someone_waits(self) -> bool:
        while self.waiters and self.waiters[0][0].done():     # gave up (a drain cancelled it)
            self.waiters.popleft()
        return bool(self.waiters)

    def tell_waiting(self) -> None:
        """The limit is not to be had now: each waiter not told yet is told, once."""
        for k, (future, told) in enumerate(self.waiters):
            if told is not None and not future.done():
                told()
                self.waiters[k] = (future, None)

    async def attempt(self) -> tuple[Grant | None, Callable[[], Awaitable[None]]]:
        """The limit for the next waiter, or None and how to wait for a chance of it."""
        if self.concurrency and self.spare is None:
            self.spare = await self.take_slot()
            if self.spare is None:
                return None, self.wait_freed
        if self.keys and not await self.take_start():
            return None, self.wait_start
        slot, self.spare = self.spare, None
        return Grant(self, slot), self.wait_freed

    def hand(self, grant: Grant) -> None:
        while self.waiters:
            future, _ = self.waiters.popleft()
            if not future.done():
                grant.counted = True
                table = self.limiter.table
                if table is not None:
                    table.limit_add(self.index, slots.LIMIT_IN_USE)
                    table.limit_add(self.index, slots.LIMIT_TAKEN)
                future.set_result(grant)
                return
        self.give_back(grant)

    # -- concurrency slots

    async def take_slot(self) -> int | None:
        hinted, looks = self.candidates()
        for k in hinted + looks:
            try:
                revision = await self.limiter.create(slot_key(self.name, k), LEASE_TTL)
            except Conflict:
                continue
            self.held[k] = revision
            if k not in hinted:
                self.roomy = True
            return k
        if looks:
            self.roomy = False                # all it looked at is taken: wait for a word, or POLL
        return None

    def candidates(self) -> tuple[list[int], list[int]]:
        """Slots worth a try: the ones said to be freed, and SCAN others when a look is due or
        the last look found room. (Waiting for a word while the limit has room would make every
        take wait for the last holder's release: measured, `python -m bench --only limits`.)"""
        hinted = [k for k in self.hints if k not in self.held and k < self.concurrency]
        self.hints.clear()
        if not (self.scan_due or self.roomy):
            return hinted, []
        self.scan_due = False
        looks = random.sample(range(self.concurrency), min(SCAN, self.concurrency))   # O(SCAN), any size
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
        self.freed.set()

    # -- rate starts

    async def take_start(self) -> bool:
        for k in self.start_candidates(time.monotonic()):
            key = rate_key(self.name, k)
            try:
                await self.limiter.create(key, self.window)
            except Conflict:
                self.starts_free[k] = await self.limiter.frees_at(key, self.window)
                continue
            self.starts_free[k] = time.monotonic() + self.window
            self.cursor = (k + 1) % self.keys
            return True
        return False

    def start_candidates(self, now: float) -> list[int]:
        """Start keys worth a try, not known to be taken: a few keys from where this worker's
        cursor stands (workers start at random places, so they seldom collide), any number of
        keys in all. What is known to free later is forgotten once it has."""
        self.starts_free = {k: t for k, t in self.starts_free.items() if t > now}
        ahead = [(self.cursor + i) % self.keys for i in range(min(self.keys, 4 * SCAN))]
        return [k for k in ahead if k not in self.starts_free][:SCAN]

    async def wait_start(self) -> None:
        soonest = min(self.starts_free.values(), default=0.0) - time.monotonic()
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

    async def start(self) -> Limiter:
        self.sub = await self.nc.subscribe(freed_subject(self.bucket, "*"), cb=self.on_freed)
        self.renewer = asyncio.ensure_future(self.renew_forever())
        return self

    async def close(self) -> None:
        """The worker exits: stop waiting, give back every slot it holds (for the next holder now,
        not after their TTL)."""
        for task in (self.renewer, *(g.server for g in self.gates.values())):
            if task is not None:
                task.cancel()
        releases = [self.release(g.name, k, rev) for g in self.gates.values() for k, rev in g.held.items()]
        for g in self.gates.values():
            g.held.clear()
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

    async def on_freed(self, msg: Any) -> None:
        name = msg.subject.split(".")[-2]
        gate = self.gates.get(name)
        if gate is not None and msg.data.isdigit():
            gate.on_freed(int(msg.data))

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
            process): its revision is taken up, and it is renewed from there."""
        key = slot_key(gate.name, k)
        try:
            new = await kv_write(self.nc, self.prefix + key, self.value, last=revision, ttl=LEASE_TTL)
        except Conflict:
            if gate.held.get(k) != revision:      # given back meanwhile
                return
            ours = await self.ours_at(key)
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


class Limits(Middleware):
    """[limits]: holds each job's whole-job limits (those whose `subjects` match its subject)
    from before its first hook until it is settled, and serves `limit()`. The worker parks a job
    that needs limits until it has them (`park`), so `before_job` finds them taken already; it
    takes them itself only for a job that was not parked."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.whole = [(name, lim.subjects) for name, lim in sorted(cfg.limits.items()) if lim.subjects]
        self.allowance = cfg.workers.concurrency
        self.table: slots.SlotTable | None = None       # the worker's, set before setup()
        self.limiter: Limiter | None = None
        # By delivery: the Job a delivery made (`id(job)`, the job kept in the value, so the id
        # cannot be reused while the entry lives). Neither (seq, delivery) nor anything else the
        # server says is unique to a delivery: a job parked past AckWait (its +WPI stalled with the
        # parent's link) can be redelivered to this same worker while its first delivery still
        # waits, at delivery 1 again if the server lost the consumer's state meanwhile, and each
        # delivery has its own grants to give back.
        self.granted: dict[int, tuple[Job, list[Grant]]] = {}     # the job's whole-job limits
        self.parked: dict[int, tuple[Any, asyncio.Task]] = {}     # the task's callback holds the job
        self.waiting: set[int] = set()   # parked jobs refused their limit once: they wait
        self.wake_pull: Callable[[], None] = lambda: None   # the worker's: a parked job waits, pull for its handler

    async def setup(self, ctx: Context) -> None:
        global _current
        self.limiter = await Limiter(ctx.nc, ctx.loop, ctx.cfg, ctx.slot, self.table).start()
        _current = self

    async def close(self) -> None:
        global _current
        for _, task in self.parked.values():
            task.cancel()
        if self.limiter is not None:
            await self.limiter.close()
        _current = None

    def names_for(self, job: Job) -> list[str]:
        """The whole-job limits of `job`, in name order: every worker takes them in the same order,
        so two jobs that need two limits can never each hold one and wait for the other."""
        return [name for name, subjects in self.whole if any(subject_matches(s, job.subject) for s in subjects)]

    def needs(self, job: Job) -> bool:
        return bool(self.whole) and bool(self.names_for(job))

    async def hold(self, job: Job) -> None:
        """Take the job's whole-job limits (waiting as long as it takes)."""
        assert self.limiter is not None, "setup() makes the limiter"
        grants: list[Grant] = []

        key = delivery_key(job)

        def waits() -> None:
            if key in self.parked and key not in self.waiting:
                self.waiting.add(key)
                self.wake_pull()
        try:
            for name in self.names_for(job):
                grants.append(await self.limiter.gate(name).take(waits))
        except BaseException:
            for grant in grants:
                grant.gate.give_back(grant)
            raise
        self.granted[key] = (job, grants)

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

    # -- parking: jobs waiting for their limits hold no handler

    def park(self, item: Any, job: Job, admitted: Callable[[Any], None]) -> None:
        """Hold `item` (the worker's queue entry of `job`) until the job has its limits, then
        hand it to `admitted` (the front of the worker's queue)."""
        key = delivery_key(job)
        task = asyncio.ensure_future(self.hold(job))
        self.parked[key] = (item, task)

        def done(t: asyncio.Task) -> None:
            self.waiting.discard(key)
            if self.parked.pop(key, None) is None or t.cancelled():
                return                           # taken back by a drain
            if t.exception() is not None:        # before_job tries again, in the chain
                log.error("worker: taking the limits of seq=%d failed", job.stream_seq, exc_info=t.exception())
            admitted(item)
        task.add_done_callback(done)

    def take_parked(self) -> list[Any]:
        """A drain: the parked jobs back (their waits cancelled, nothing taken for them)."""
        items = []
        for item, task in self.parked.values():
            task.cancel()
            items.append(item)
        self.parked.clear()
        self.waiting.clear()
        return items

    def occupying(self) -> int:
        """Parked jobs that count as taking a handler (for pull sizing): those still trying for
        their limits (most get them at once, and would find the handler taken), and those
        waiting beyond `workers.concurrency` of them."""
        return len(self.parked) - len(self.waiting) + max(0, len(self.waiting) - self.allowance)


def delivery_key(job: Job) -> int:
    """One delivery's key: its Job, made once per message received (see Limits.granted)."""
    return id(job)


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
