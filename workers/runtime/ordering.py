"""[ordering] in a worker: a pulled job starts only once it is the first stored job of its key.

The rule and why it holds are in supervisor/config/ordering.py (the pure part). Here is its
mechanism. Every pulled job with a key is *parked* first: held in the slot table (HELD, kept
alive by the parent's +WPI, NAKed by the parent if this worker dies), its key written beside it
for /status, spending no delivery attempt and holding no handler. Per key, only the lowest
parked sequence (the *candidate*) is ever checked, and only while no job of that key taken from
here is still unsettled: one STREAM.MSG.GET per filter of the key (`next_by_subj`, from the
lowest sequence the key can still have: `floors`), the lowest answer winning.
  - It IS the candidate: the job goes on (the worker's `clear`: [limits] if it needs one, then
    the queue). Jobs of other keys never wait for it.
  - An earlier job of the key is stored: the candidate waits. It looks again when a worker says
    it settled a job of its key (a core NATS note on `note_subject`, sent after the ack or TERM:
    its sequence; this worker's own come back to it too), when a job of its key settled here
    was NAKed (at once), and otherwise after POLL_FIRST,
    doubling up to POLL_MAX (a lost note, or a key settled by a dead-letter copy, a quarantine,
    a deletion). When the earlier job is one said to be settled, the server has read its ack
    but not applied it yet: it looks again after QUICK_FIRST, doubling up to QUICK_MAX.
  - The candidate's own sequence was said to have left the stream (settled here, or a note): it
    is a second delivery of a job done, which the stream may still store while the server has
    read the first one's ack and not applied it (F15). It is acked unrun, never asked about:
    the job was done, and an ack is right whoever holds the delivery now.
  - The candidate itself is not stored (acked, TERMed or deleted elsewhere: it came twice) or
    not yet on the server that answers: it is looked for GONE_CHECKS times, GONE_RECHECK apart,
    then given back with a NAK (the server drops the redelivery of a message it no longer has,
    and redelivers one it had not stored yet). Never a start.
  - The stream does not answer: it looks again later, never starts.

Pulling: a parked job counts as taking a handler only until the stream first answers for it
(`occupying`: most jobs start at once). After that it waits without one, and the worker pulls
on while its handlers are idle: the job its key waits for may be a NAKed retry that only a pull
request brings back. So parking is bounded by consumer.max_ack_pending (the slot table has room
for that many: supervisor/parent/pool.py), not by the worker. Parked jobs do not count against
max_jobs until they start, for the same reason.

A drain (STOPPING) NAKs parked jobs at once, in stream order (`take_parked`), and so does a
retirement, without the drain's delay: a parked job that started late in a retirement could not
finish within graceful_timeout, and its redelivery would run beside it (F16).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from supervisor.config import Config
from supervisor.config.ordering import GONE, START, WAIT, key_filters, key_of, token_of, verdict
from supervisor.config.schedules import job_subjects
from workers import Job
from workers.protocol import slots
from workers.protocol.modes import STOPPING
from workers.protocol.slots import SlotTable
from workers.runtime.puller import Puller
from workers.runtime.settle import Settler

log = logging.getLogger("worker")

CHECK_TIMEOUT = 2.0        # one question to the stream
POLL_FIRST = 0.05          # a waiting key looks again this soon without a word ...
POLL_MAX = 1.0             # ... doubling to this: what a lost note costs at most
QUICK_FIRST = 0.001        # a key whose first job was said to be settled (its ack read, not yet applied) ...
QUICK_MAX = 0.05           # ... looks again this soon, doubling to this
GONE_CHECKS = 3            # a candidate the stream does not store is looked for this many times ...
GONE_RECHECK = 0.05        # ... this far apart, then given back
FLOOR_KEYS = 10000         # keys whose lowest possible sequence is remembered (most recent first)
SETTLED_KEEP = 1024        # sequences of a key said to have left the stream, remembered while it is busy
WARN_EVERY = 10.0          # an unanswered stream is logged at most this often
NOTE_PREFIX = "_SUPERVISOR.ordering"
LEFT = ("ack", "duplicate", "term", "later")   # outcomes after which the job is no longer stored

Item = tuple[Any, int, Job]                    # (message, table entry, job) as the worker pulled it


def note_subject(stream: str, consumer: str, key: str = "*") -> str:
    """Core NATS: a worker that settled a job of `key` says so here, so one waiting for it looks now."""
    return f"{NOTE_PREFIX}.{stream}.{consumer}.{key}"


@dataclass
class Parked:
    item: Item
    seq: int
    since: float                   # monotonic: when it was parked
    answered: bool = False         # the stream has told it to wait once: it no longer takes a handler


@dataclass
class Key:
    """One key's jobs in this worker: those parked, and those cleared and not settled yet."""
    name: str
    parked: dict[int, Parked] = field(default_factory=dict)     # by table entry
    cleared: set[int] = field(default_factory=set)
    checking: asyncio.Task | None = None
    again: bool = False            # woken while a check was in flight: check once more after it
    timer: asyncio.TimerHandle | None = None
    poll: float = POLL_FIRST       # the next look without a word ...
    quick: float = QUICK_FIRST     # ... and when the first job was said to be settled
    left: int = 0                  # the highest sequence of the key said to have left the stream
    settled: set[int] = field(default_factory=set)   # ... each of them (the latest SETTLED_KEEP)
    gone: int = 0                  # GONE answers in a row for the candidate

    def heard(self, seq: int) -> None:
        """A job of the key left the stream (a settle here, or a note): look again at once."""
        self.left = max(self.left, seq)
        self.settled.add(seq)
        if len(self.settled) > SETTLED_KEEP:
            self.settled.discard(min(self.settled))
        self.poll, self.quick = POLL_FIRST, QUICK_FIRST

    def candidate(self) -> tuple[int, Parked] | None:
        """The parked job that may be the key's first: the lowest, while none taken from here is
        unsettled (one of those is lower, or the same job delivered twice)."""
        if self.cleared or not self.parked:
            return None
        i = min(self.parked, key=lambda j: (self.parked[j].seq, j))
        return i, self.parked[i]


class OrderingHost(Protocol):
    """What [ordering] needs of the worker that owns it (workers/runtime/worker.py Worker)."""
    mode: str
    table: SlotTable
    wake_pull: asyncio.Event               # a job that starts counts differently for pull sizing
    pulls: Puller
    settler: Settler

    def cleared(self, item: Item) -> None: ...     # on to its limits, or the queue


class Ordering:
    """A worker's [ordering]. `ask(filter, from_seq)` is the stream's first stored sequence on
    `filter` at or after `from_seq` (None: none), and `publish(subject, payload)` sends a note:
    the worker's connection's (`start`), or a test's."""

    def __init__(self, cfg: Config, slot: int, host: OrderingHost):
        token = token_of(cfg.ordering.key)
        assert token is not None, "[ordering] off: no Ordering"
        self.token, self.patterns, self.slot, self.host, self.table = token, job_subjects(cfg), slot, host, host.table
        self.stream, self.consumer = cfg.stream.name, cfg.consumer.name
        host.settler.on_settled = self.settled
        self.ask: Callable[[str, int], Awaitable[int | None]] = _unconnected
        self.publish: Callable[[str, bytes], Awaitable[None]] = _unconnected
        self.keys: dict[str, Key] = {}
        self.where: dict[int, str] = {}                          # table entry -> its key, parked or cleared
        self.floors: OrderedDict[str, int] = OrderedDict()       # key -> no job of it below this is stored
        self.unanswered: set[str] = set()                        # keys whose candidate has no answer yet
        self.warned = 0.0

    # -- from the worker

    async def start(self, nc: Any) -> None:
        """Ask and announce on the worker's connection; hear the other workers' notes (before the
        first pull: a note may be all that wakes a parked job)."""
        async def ask(subject: str, from_seq: int) -> int | None:
            return await first_stored(nc, self.stream, subject, from_seq)

        async def on_note(msg: Any) -> None:
            if msg.data.isdigit():
                self.note(msg.subject.rpartition(".")[2], int(msg.data))
        self.ask, self.publish = ask, nc.publish
        await nc.subscribe(note_subject(self.stream, self.consumer), cb=on_note)

    def admit(self, item: Item) -> bool:
        """Park a pulled job until it is the first of its key; False for a job without a key
        (fewer subject tokens than the key's: it runs unordered)."""
        _, i, job = item
        name = key_of(job.subject, self.token)
        if name is None:
            return False
        k = self.keys.get(name) or self.keys.setdefault(name, Key(name))
        k.parked[i] = Parked(item, job.stream_seq, time.monotonic())
        self.where[i] = name
        self.table.park(i, name.encode())
        self.consider(k)
        return True

    def settled(self, i: int, job: Job, outcome: str) -> None:
        """Entry i was settled (any way, by anyone in this worker). A job of a key that left the
        stream is announced, and the key's next parked job looks at once."""
        name = self.where.get(i)
        k = self.keys.get(name) if name is not None else None
        if k is None or i not in k.cleared:
            return
        del self.where[i]
        k.cleared.discard(i)
        if outcome not in LEFT:
            self.consider(k)
            return
        # The word goes out after the ack, on the same connection, and comes back to us too:
        # by then the server has read the ack. Asking sooner would mostly find the job still
        # stored (the ack read, not applied yet) and cost a question more; QUICK_MAX if it is lost.
        self.spawn(self.publish(note_subject(self.stream, self.consumer, k.name), str(job.stream_seq).encode()))
        k.heard(job.stream_seq)
        if k.checking is None:
            if k.timer is not None:
                k.timer.cancel()
            k.timer = asyncio.get_running_loop().call_later(QUICK_MAX, self.wake, k)

    def note(self, name: str, seq: int) -> None:
        """A worker (this one's note comes back too) settled job `seq` of key `name`."""
        k = self.keys.get(name)
        if k is not None:
            k.heard(seq)
            self.consider(k)

    def parked(self) -> int:
        return sum(len(k.parked) for k in self.keys.values())

    def occupying(self) -> int:
        """Parked jobs that count as taking a handler: candidates the stream has not answered for
        yet (most start at once, and would find their handler given away)."""
        return len(self.unanswered)

    def waiting(self) -> int:
        """Parked jobs told to wait (or behind one that is): they do not count against max_jobs."""
        return self.parked() - self.occupying()

    def take_parked(self) -> list[Item]:
        """A drain: every parked job back, in stream order, for the worker to NAK (never started)."""
        out: list[tuple[int, Item]] = []
        now = time.monotonic()
        for k in self.keys.values():
            self.stop_looking(k)
            for i, p in k.parked.items():
                self.table.unpark(i, now - p.since)
                self.where.pop(i, None)
                out.append((p.seq, p.item))
            k.parked.clear()
        self.unanswered.clear()
        self.drop_idle()
        return [item for _, item in sorted(out, key=lambda x: x[0])]

    def close(self) -> None:
        for k in self.keys.values():
            self.stop_looking(k)

    def stopping(self) -> bool:
        return self.host.mode == STOPPING

    def clear(self, item: Item) -> None:
        """The candidate is the first of its key: on to run."""
        self.host.cleared(item)
        self.host.wake_pull.set()

    async def give_back(self, i: int, job: Job, reason: str) -> None:
        """A job that never started, NAKed (it may come back: its handler never ran)."""
        self.host.pulls.not_started()
        await self.host.settler.settle(i, job, b"-NAK", "nak", reason)

    # -- checking

    def consider(self, k: Key) -> None:
        """Check the key's candidate now (or once more after the check in flight)."""
        if k.checking is not None:
            k.again = True
            return
        if k.timer is not None:
            k.timer.cancel()
            k.timer = None
        k.checking = self.spawn(self.check(k))

    async def check(self, k: Key) -> None:
        """Ask the stream for the key's candidate until it starts, waits (a look scheduled), or
        there is none."""
        delay: float | None = None
        try:
            while not self.stopping():
                k.again, delay = False, None
                c = k.candidate()
                self.mark(k, c)
                if c is None:
                    if not k.parked and not k.cleared:
                        self.keys.pop(k.name, None)
                    return
                i, p = c
                if p.seq in k.settled:                   # a second delivery of a job done (F15)
                    await self.done_before(k, i, p)
                    continue
                head = await self.first(k.name, p.seq)
                now = k.candidate()
                if now is None or now[1] is not p:       # settled, started or drained meanwhile
                    continue
                if head is False:                        # unanswered: look again later, never start
                    delay = self.backoff(k)
                else:
                    self.table.count(slots.ORDER_CHECKS)
                    delay = await self.act(k, i, p, head)
                if delay is not None and not k.again:
                    return
        finally:
            k.checking = None
            if delay is not None and not self.stopping() and self.keys.get(k.name) is k:
                k.timer = asyncio.get_running_loop().call_later(delay, self.wake, k)

    def mark(self, k: Key, c: tuple[int, Parked] | None) -> None:
        if c is not None and not c[1].answered:
            self.unanswered.add(k.name)
        else:
            self.unanswered.discard(k.name)

    async def act(self, k: Key, i: int, p: Parked, head: int | None) -> float | None:
        """What the answer means for the candidate; the delay before the next look (None: now)."""
        rule = verdict(p.seq, head)
        if rule == START:
            self.floor(k.name, p.seq)
            k.gone = 0
            del k.parked[i]
            k.cleared.add(i)
            self.unanswered.discard(k.name)
            self.table.unpark(i, time.monotonic() - p.since)
            self.clear(p.item)
            return None
        if rule == WAIT:
            assert head is not None
            self.floor(k.name, head)
            k.gone = 0
            p.answered = True
            self.unanswered.discard(k.name)
            self.table.waits_for(i, head)
            return self.backoff(k, settled=head <= k.left)
        assert rule == GONE
        k.gone += 1
        if k.gone < GONE_CHECKS:
            return GONE_RECHECK * k.gone
        job = self.unpark(k, i, p)
        log.info("worker %d: job seq=%d (key %s) is no longer in the stream (done elsewhere: it came twice); "
                 "giving it back unrun", self.slot, p.seq, k.name,
                 extra={"event": "ordering_gone", "seq": p.seq, "key": k.name, "delivery": job.delivery})
        await self.give_back(i, job, f"key {k.name}: no longer in the stream (done elsewhere)")
        return None

    def unpark(self, k: Key, i: int, p: Parked) -> Job:
        """The candidate leaves this worker's parking without starting; its job."""
        k.gone = 0
        del k.parked[i]
        self.where.pop(i, None)
        self.unanswered.discard(k.name)
        self.table.unpark(i, time.monotonic() - p.since)
        return p.item[2]

    async def done_before(self, k: Key, i: int, p: Parked) -> None:
        """The candidate's sequence was said to have left the stream: acked unrun. Asking would
        find it still stored while the server applies the first ack (the START rule holds then),
        and a NAK would be wrong if a lost removal left it stored (it was done)."""
        job = self.unpark(k, i, p)
        log.info("worker %d: job seq=%d (key %s) came again after it was settled (delivery %d); acking it unrun",
                 self.slot, p.seq, k.name, job.delivery,
                 extra={"event": "ordering_settled_twice", "seq": p.seq, "key": k.name, "delivery": job.delivery})
        self.host.pulls.not_started()
        await self.host.settler.ack(i, job, "duplicate")

    def backoff(self, k: Key, settled: bool = False) -> float:
        """The next look's delay: soon when the key's first job was said to be settled, else the
        slower poll a note cuts short."""
        if settled and k.quick <= QUICK_MAX:
            delay, k.quick = k.quick, k.quick * 2
            return delay
        delay, k.poll = k.poll, min(k.poll * 2, POLL_MAX)
        return delay

    def wake(self, k: Key) -> None:
        k.timer = None
        if self.keys.get(k.name) is k:
            self.consider(k)

    async def first(self, name: str, seq: int) -> int | None | bool:
        """The first stored sequence of key `name` from its floor (None: none stored there), or
        False when the stream did not answer. A candidate below the floor is asked about from its
        own sequence: it can only be there again if a server lost the removal (a SIGKILL before
        it was persisted), and then it must run, not be given back as gone over and over."""
        floor = min(self.floors.get(name, 1), seq)
        try:
            answers = await asyncio.gather(*(self.ask(f, floor) for f in key_filters(self.patterns, self.token, name)))
        except Exception as exc:
            self.unanswered_stream(exc)
            return False
        found = [a for a in answers if a is not None]
        return min(found) if found else None

    def floor(self, name: str, seq: int) -> None:
        """No job of `name` below `seq` is stored, for good (publishing appends)."""
        if seq > self.floors.get(name, 0):
            self.floors[name] = seq
        self.floors.move_to_end(name)
        while len(self.floors) > FLOOR_KEYS:
            self.floors.popitem(last=False)

    def unanswered_stream(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self.warned >= WARN_EVERY:
            self.warned = now
            log.warning("worker %d: stream %s does not answer which job of a key is first (%s); ordered jobs wait",
                        self.slot, self.stream, f"{type(exc).__name__}: {exc}", extra={"event": "ordering_unanswered"})

    # -- plumbing

    def stop_looking(self, k: Key) -> None:
        if k.timer is not None:
            k.timer.cancel()
            k.timer = None
        if k.checking is not None:
            k.checking.cancel()
            k.checking = None

    def drop_idle(self) -> None:
        for name in [n for n, k in self.keys.items() if not k.parked and not k.cleared]:
            del self.keys[name]

    def spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        task.add_done_callback(_log_failure)
        return task


async def _unconnected(*_: Any) -> Any:
    raise ConnectionError("[ordering] not started on a connection")


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("worker: [ordering] task failed", exc_info=task.exception())


async def first_stored(nc: Any, stream: str, subject: str, from_seq: int) -> int | None:
    """The stream leader's first stored sequence on `subject` (wildcards allowed) at or after
    `from_seq`; None when there is none (JetStream's 404, err_code 10037)."""
    request = json.dumps({"seq": from_seq, "next_by_subj": subject, "no_hdr": True}).encode()
    reply = json.loads((await nc.request(f"$JS.API.STREAM.MSG.GET.{stream}", request, timeout=CHECK_TIMEOUT)).data)
    error = reply.get("error")
    if error is None:
        return int(reply["message"]["seq"])
    if error.get("err_code") == 10037:
        return None
    raise RuntimeError(f"{error.get('description', 'refused')} ({error.get('err_code')})")
