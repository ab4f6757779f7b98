"""A sync `with limit("NAME"):` block against SoftTimeout landing anywhere in it
(workers/middleware/limits.py `limit`, workers/middleware/timeouts.py).

workers.soft_timeout raises SoftTimeout in a handler thread asynchronously: at whatever bytecode
the thread runs next, inside `limit.__enter__`, `__exit__`, asyncio's call_soon_threadsafe, or just
after a C call (a lock's acquire) returned and before its result was stored. Wherever it lands, the
slot the block's take got must be given back exactly once, by the block or at the end of the job,
and never be held by nobody. The sweep below raises it at each point in turn: every `call`, `line`
and `return` event of every Python frame the thread runs from the `with` statement to its end, and
every return from a C call there (sys.settrace / sys.setprofile, whose exceptions propagate from
exactly that point, once), against the real Gate on a real asyncio loop in another thread (the
worker's loop) and an in-memory bucket."""

from __future__ import annotations

import asyncio
import sys
import threading
from types import SimpleNamespace

import pytest

import workers.middleware.limits as limits_mod
from workers import Job, SoftTimeout
from workers.middleware.guard import Conflict
from workers.middleware.limits import Gate, limit
from workers.middleware.timeouts import SoftTimeoutSync
from workers.protocol import slots
from workers.protocol.limitkeys import slot_key

JOB = Job(data=b"", subject="jobs.x")


class Bucket:
    """The Limiter's side the Gate uses, in memory: slot keys and who released which revision."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.keys, self.rev = loop, {}, 0
        self.created: list[tuple[str, int]] = []
        self.released: list[tuple[str, int]] = []
        self.tasks: set[asyncio.Task] = set()
        self.table = slots.SlotTable(4, 64, limits=1)
        self.gates: dict[str, Gate] = {}
        self.closing = False

    async def create(self, key: str, ttl: int) -> int:
        if key in self.keys:
            raise Conflict(key)
        self.rev += 1
        self.keys[key] = self.rev
        self.created.append((key, self.rev))
        return self.rev

    async def release(self, name: str, k: int, revision: int) -> None:
        key = slot_key(name, k)
        self.released.append((key, revision))
        if self.keys.get(key) == revision:
            del self.keys[key]

    def spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def gate(self, name: str) -> Gate:
        return self.gates[name]

    def want(self, name: str) -> None:
        """The word a worker waiting for a full limit sends: nobody else listens here."""

    def admit(self) -> None:
        """Before each take: a worker's parked jobs without a handler withdraw (none here)."""

    def timed(self, seconds: float) -> None:
        """A take's round trip (the worker's look-ahead): not measured here."""


@pytest.fixture
def worker_loop(monkeypatch):
    """The worker's loop in a thread of its own, a gate `db` of one slot on it, and limit() wired
    to them as in a worker (`_current`)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    bucket = Bucket(loop)

    async def make() -> None:
        bucket.gates["db"] = Gate(bucket, 0, "db", concurrency=1, rate=0.0)    # type: ignore[arg-type]
    asyncio.run_coroutine_threadsafe(make(), loop).result(5)
    monkeypatch.setattr(limits_mod, "_current", SimpleNamespace(limiter=bucket))
    monkeypatch.setattr(limits_mod, "LINGER", 0.0)      # a slot nobody waits for goes back at once
    yield bucket
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def settled(bucket: Bucket) -> dict:
    """Once the loop has nothing left to do for the gate (with a deadline: a stuck loop is a
    failure too): what is held, in the bucket and in the worker's table."""
    async def look() -> dict | None:
        gate = bucket.gates["db"]
        for _ in range(500):
            busy = bucket.tasks or gate.waiters or (gate.server is not None and not gate.server.done()) or \
                gate.lingering is not None
            if not busy:
                in_use, waiting, _, _ = bucket.table.limit(0)
                return {"held": dict(gate.held), "keys": dict(bucket.keys), "in_use": in_use, "waiting": waiting}
            await asyncio.sleep(0.002)
        return None
    try:
        state = asyncio.run_coroutine_threadsafe(look(), bucket.loop).result(5)
    except TimeoutError:
        pytest.fail("the worker's loop is stuck (a lock left held in the handler thread?)")
    assert state is not None, "the gate never went idle"
    return state


def raise_at(n: int) -> tuple[callable, list[str]]:
    """Hooks that raise SoftTimeout at the n-th event of this thread once armed, and say where."""
    seen, where = [0], []

    def hit(frame, what: str) -> None:
        if frame.f_code.co_filename.endswith("_weakrefset.py"):
            return                       # a garbage collector's callback: what is raised there is lost
        seen[0] += 1
        if seen[0] == n:
            sys.settrace(None)
            sys.setprofile(None)
            where.append(f"{what} in {frame.f_code.co_name} ({frame.f_code.co_filename.rsplit('/', 1)[-1]}:"
                         f"{frame.f_lineno})")
            raise SoftTimeout("raised by the test")

    def tracer(frame, event, arg):
        if event in ("call", "line", "return"):
            hit(frame, event)
        return tracer

    def profiler(frame, event, arg):
        if event == "c_return":
            hit(frame, f"after {getattr(arg, '__qualname__', arg)}() returned")

    def arm() -> None:
        caller = sys._getframe(1)
        caller.f_trace = tracer
        sys.settrace(tracer)
        sys.setprofile(profiler)
    return arm, where


def test_a_soft_timeout_anywhere_in_a_sync_limit_block_never_strands_its_slot(worker_loop):
    """At every point: the job ends (SoftTimeout or not), then the slot is free in the bucket and
    in the worker's table, nothing waits, and each revision taken was released exactly once.
    Before: a SoftTimeout at __exit__'s first line, or inside call_soon_threadsafe, left the slot
    held (renewed for good); one just after the Future's lock was taken in result() froze the
    loop."""
    bucket = worker_loop
    mw = SoftTimeoutSync(3600.0)         # its around is the job's end a worker's handler thread runs
    points = 0
    for n in range(1, 2000):
        arm, where = raise_at(n)
        ran: list[bool] = []

        def handler() -> None:
            arm()
            with limit("db"):
                ran.append(True)
            sys.settrace(None)
            sys.setprofile(None)
        try:
            mw.around(JOB, handler)
        except SoftTimeout:
            pass
        finally:
            sys.settrace(None)
            sys.setprofile(None)
        state = settled(bucket)
        at = where[0] if where else "nowhere (the block ran to its end)"
        assert state == {"held": {}, "keys": {}, "in_use": 0, "waiting": 0}, f"raised at {at}: {state}"
        assert sorted(bucket.released) == sorted(set(bucket.released)) == sorted(bucket.created), \
            f"raised at {at}: created {bucket.created}, released {bucket.released}"
        assert len(ran) <= 1
        if not where:
            assert ran == [True]
            break
        points += 1
    assert points >= 30, f"only {points} points swept: the hooks did not see the block"


def test_a_soft_timeout_while_a_block_waits_gives_up_its_place_at_once(worker_loop):
    """The slot is held elsewhere; SoftTimeout raised while the block waits for it ends the wait
    (within the block's wake-up interval, not when the slot comes), and the take is withdrawn:
    once the slot is free again, nobody holds it."""
    bucket = worker_loop
    bucket.keys[slot_key("db", 0)] = 999                 # another worker's
    thread_id: list[int] = []
    outcome: list[BaseException] = []

    def handler() -> None:
        thread_id.append(threading.get_ident())
        try:
            with limit("db"):
                outcome.append(AssertionError("the block ran without the slot"))
        except SoftTimeout as exc:
            outcome.append(exc)
    t = threading.Thread(target=handler, daemon=True)
    t.start()

    async def waiting() -> bool:
        for _ in range(500):
            if bucket.table.limit(0)[1] == 1:
                return True
            await asyncio.sleep(0.002)
        return False
    assert asyncio.run_coroutine_threadsafe(waiting(), bucket.loop).result(5), "the block never waited"
    from workers.middleware.timeouts import raise_in
    raise_in(thread_id[0], SoftTimeout)
    t.join(2)
    assert not t.is_alive(), "the block kept waiting for the slot"
    assert len(outcome) == 1 and isinstance(outcome[0], SoftTimeout)
    del bucket.keys[slot_key("db", 0)]
    bucket.loop.call_soon_threadsafe(bucket.gates["db"].on_freed, 0)
    assert settled(bucket) == {"held": {}, "keys": {}, "in_use": 0, "waiting": 0}
