"""A per-worker shared-memory table: what the worker holds, its heartbeat, its counters.

The parent maps one table per worker (anonymous MAP_SHARED) just before forking it. The worker
writes it on the hot path with a few 8-byte stores per message: no syscall, no IPC. The parent
reads it on a timer (heartbeats, long jobs, /status) and once more after the worker died, to
know exactly which jobs to NAK.

Each in-flight entry carries a version word bumped before and after every write (odd while
writing), so a reader racing a live writer can tell a torn read and retry. An entry moves
FREE -> HELD (pulled) -> RUNNING (handler started) -> ACKED or SETTLED (ack or nak/term
published but not yet confirmed by a flush) -> FREE. ACKED entries are kept until a flush proves
the server has the ack, because an ack still in a dead process's socket buffer is lost: the
parent NAKs them at death, which is a no-op for an ack that did arrive.
"""

from __future__ import annotations

import mmap
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass

# Upper bounds (seconds) of the job-duration histogram buckets; +Inf is implicit.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

# Worker states (header STATE word).
EMPTY, STARTING, READY, DRAINING = 0, 1, 2, 3
WORKER_STATES = {EMPTY: "empty", STARTING: "starting", READY: "ready", DRAINING: "draining"}

# Entry states.
FREE, HELD, RUNNING, ACKED, SETTLED = 0, 1, 2, 3, 4
ENTRY_STATES = {HELD: "held", RUNNING: "running", ACKED: "acked", SETTLED: "settled"}

# Header words (8 bytes each; doubles and int64s share the buffer through two casts).
# SERVER_SEEN: when the worker sent the last PING the NATS server answered (the send time, not the
# PONG's: everything the server sent before reading that PING had been read and recorded by the
# time the PONG came, since nats-py runs on_message for the MSGs ahead of a PONG before flush()
# returns, and a PONG read late by a stalled loop must not vouch for what came after it), so the
# parent can tell a beating worker whose connection has gone half-open from a healthy one, and
# which deliveries a worker has surely read (supervisor/parent/safety/in_transit.py).
# DUPLICATE_N: jobs acked without running because their key was already done ([idempotency]).
# SPENT, SPENT_SQ, SEEN: the worker's recent job times, summed, squared and counted
# (workers/runtime/pulls.py, the spread); FLEET_RESIDUAL, FLEET_SEEN: what the parent made of
# every worker's (the words it writes here).
# ORDER_PARKED: jobs parked now until they are the first of their key in the stream ([ordering]:
# workers/runtime/ordering.py); ORDER_CHECKS: the stream asked, ever; ORDER_WAITED: seconds parked
# jobs waited, summed when they leave parking (a double).
# PINGS_BEGUN, PINGS_FENCED (the parent's), NAKING (the worker's): a +WPI that reaches the server
# after a NAK with a delay turns the delay into a whole AckWait (nats-server's progressUpdate
# restarts the timer the NAK set), and the two go out on different connections. The parent bumps
# PINGS_BEGUN before it reads which entries to ping, and sets PINGS_FENCED to that count once a
# flush proved the server read those pings; the worker counts NAKING up before it reads
# PINGS_BEGUN and down once its NAK is out and its entry SETTLED. Each writes before it reads the
# other's word, so either the parent sees the NAK coming (and pings none of that worker's jobs this
# tick) or the worker sees the round begun (and waits for its fence): workers/runtime/settle.py.
# That needs each store visible before the load after it, which a CPU may reorder (x86's store
# buffer): a lock taken and given back between them is a locked instruction, a full fence on x86.
_FENCE = threading.Lock()
(PID, STATE, HEARTBEAT, ACKED_N, NAKED_N, TERMED_N, STARTED_N, CREDITS, HIGH_WATER,
 MAX_DURATION, DURATION_SUM, SERVER_SEEN, DUPLICATE_N, SPENT, SPENT_SQ, FLEET_RESIDUAL, SEEN, FLEET_SEEN,
 ORDER_PARKED, ORDER_CHECKS, ORDER_WAITED, PINGS_BEGUN, PINGS_FENCED, NAKING) = range(24)
BUCKETS_AT = 24
HEADER_WORDS = BUCKETS_AT + len(DURATION_BUCKETS) + 1

# Per-limit words, after the entries (one block per [limits.NAME], in the config's order):
# slots this worker holds now, its jobs waiting for the limit now, how many times it took the
# limit, and the seconds its jobs spent waiting for it (a double, waits that ended); the waits
# under way: how many, and the sum of their start times (a double), so a reader counts them up
# to its own moment (limit_wait_seconds_total grows during a long wait, not only at its end).
# LIMIT_VER: a seqlock over the last three (odd while the worker writes them), so the parent
# never reads a wait counted as under way and ended, or in neither. workers/middleware/limits.py.
LIMIT_IN_USE, LIMIT_WAITING, LIMIT_TAKEN, LIMIT_WAITED, LIMIT_OPEN, LIMIT_OPEN_SINCE, LIMIT_VER = range(7)
LIMIT_WORDS = 7
READ_TRIES = 1000           # a read of a worker's limit words gives up after this many tries (a writer killed mid-write)

# Entry words. A parked job ([ordering]) has its key (KEY_LEN bytes after the reply) and the
# first sequence of that key the stream last said it stores (WAIT_SEQ; 0 before the first answer).
VER, ESTATE, SSEQ, CSEQ, DELIVERY, T_HELD, T_STARTED, REPLY_LEN, WAIT_SEQ, KEY_LEN = range(10)
ENTRY_FIXED_WORDS = 10
KEY_BYTES = 64              # a key is kept to this many bytes in the table (what /status shows of it)


@dataclass(frozen=True)
class Entry:
    index: int
    state: int
    stream_seq: int
    consumer_seq: int
    delivery: int
    t_held: float
    t_started: float
    reply: str
    waiting_for: int = 0        # parked ([ordering]): the first stored job of its key, when known
    key: str = ""               # parked ([ordering]): its key ("" = not parked)


class SlotTable:
    def __init__(self, entries: int, reply_bytes: int, limits: int = 0, key_bytes: int = 0):
        self.entries = entries
        self.limits = limits
        self.reply_words = (reply_bytes + 7) // 8
        self.key_words = (key_bytes + 7) // 8
        self.entry_words = ENTRY_FIXED_WORDS + self.reply_words + self.key_words
        self.limits_at = HEADER_WORDS + entries * self.entry_words
        size = 8 * (self.limits_at + limits * LIMIT_WORDS)
        self._mm = mmap.mmap(-1, size)
        self.q = memoryview(self._mm).cast("q")
        self.d = memoryview(self._mm).cast("d")
        self.b = memoryview(self._mm)
        self._free = list(range(entries - 1, -1, -1))   # LIFO: used entries stay low
        self._waited_read: dict[int, float] = {}        # reader side: limit k's seconds waited, as last read
        self.born = time.monotonic()                     # before the worker's fork: no wait began earlier
        self._high = 0

    def close(self) -> None:
        for view in (self.q, self.d, self.b):
            view.release()
        self._mm.close()

    def _base(self, i: int) -> int:
        return HEADER_WORDS + i * self.entry_words

    # ------------------------------------------------------------ worker side (hot path)

    def set_state(self, state: int) -> None:
        self.q[STATE] = state

    def beat(self) -> None:
        self.d[HEARTBEAT] = time.monotonic()

    def server_answered(self, at: float) -> None:
        self.d[SERVER_SEEN] = at

    def free_entries(self) -> int:
        return len(self._free)

    def hold(self, sseq: int, cseq: int, delivery: int, reply: bytes, now: float | None = None) -> int:
        """Record a pulled message (that came at `now`, the monotonic clock); returns its entry
        index (or -1 when the table is full)."""
        if not self._free:
            return -1
        i = self._free.pop()
        if i >= self._high:                 # before the entry is published: readers scan up to HIGH_WATER
            self._high = i + 1
            self.q[HIGH_WATER] = self._high
        base = self._base(i)
        q = self.q
        q[base + VER] += 1
        q[base + SSEQ] = sseq
        q[base + CSEQ] = cseq
        q[base + DELIVERY] = delivery
        self.d[base + T_HELD] = time.monotonic() if now is None else now
        self.d[base + T_STARTED] = 0.0      # not the start time of the entry's previous job
        q[base + WAIT_SEQ] = q[base + KEY_LEN] = 0
        if len(reply) <= self.reply_words * 8:
            start = 8 * (base + ENTRY_FIXED_WORDS)
            self.b[start:start + len(reply)] = reply
            q[base + REPLY_LEN] = len(reply)
        else:
            q[base + REPLY_LEN] = -1
        q[base + VER] += 1
        q[base + ESTATE] = HELD             # the commit: one word, last, with the version even again
        return i

    def start(self, i: int) -> None:
        base = self._base(i)
        self.d[base + T_STARTED] = time.monotonic()   # before the state word that makes it count
        self.q[base + ESTATE] = RUNNING
        self.q[STARTED_N] += 1

    def mark(self, i: int, state: int) -> None:
        self.q[self._base(i) + ESTATE] = state       # one aligned word: atomic, no version needed

    def held_at(self, i: int) -> float:
        return self.d[self._base(i) + T_HELD]

    def state_of(self, i: int) -> int:
        return self.q[self._base(i) + ESTATE]

    def release(self, i: int) -> None:
        self.mark(i, FREE)
        self._free.append(i)

    def naking(self, n: int) -> int | None:
        """A NAK with a delay begins (n=1: the number of the parent's ping round to wait for, or
        None when none is on its way) or is out (n=-1). See PINGS_BEGUN."""
        q = self.q
        q[NAKING] += n
        if n < 0:
            return None
        with _FENCE:                    # the write above before the read below (the order is the point)
            pass
        begun = q[PINGS_BEGUN]
        return begun if q[PINGS_FENCED] < begun else None

    def pings_fenced(self, round_: int) -> bool:
        return self.q[PINGS_FENCED] >= round_

    def count(self, which: int, n: int = 1) -> None:
        self.q[which] += n

    def park(self, i: int, key: bytes) -> None:
        """Entry i waits to be the first of its key ([ordering]); its key is kept (up to the room
        the table has for it) for /status."""
        assert self.key_words, "a table made without room for keys (key_bytes)"
        base, q = self._base(i), self.q
        key = key[:self.key_words * 8] or b"?"
        q[base + VER] += 1
        start = 8 * (base + ENTRY_FIXED_WORDS + self.reply_words)
        self.b[start:start + len(key)] = key
        q[base + WAIT_SEQ] = 0
        q[base + KEY_LEN] = len(key)
        q[base + VER] += 1
        q[ORDER_PARKED] += 1

    def waits_for(self, i: int, head: int) -> None:
        self.q[self._base(i) + WAIT_SEQ] = head       # one aligned word: no version needed

    def unpark(self, i: int, waited: float) -> None:
        base, q = self._base(i), self.q
        q[base + VER] += 1
        q[base + WAIT_SEQ] = q[base + KEY_LEN] = 0
        q[base + VER] += 1
        q[ORDER_PARKED] -= 1
        self.d[ORDER_WAITED] += waited

    def observe(self, seconds: float) -> None:
        d = self.d
        self.q[BUCKETS_AT + bisect_left(DURATION_BUCKETS, seconds)] += 1
        d[DURATION_SUM] += seconds
        if seconds > d[MAX_DURATION]:
            d[MAX_DURATION] = seconds

    def add_credits(self, n: int) -> None:
        self.q[CREDITS] += n

    def set_credits(self, n: int) -> None:
        self.q[CREDITS] = n

    def share_spread(self, spent: float, spent_sq: float, seen: float) -> None:
        d = self.d
        d[SPENT], d[SPENT_SQ], d[SEEN] = spent, spent_sq, seen

    def fleet_spread(self) -> tuple[float, float]:
        """The fleet's residual and the count of jobs it rests on, as the parent last wrote them."""
        return self.d[FLEET_RESIDUAL], self.d[FLEET_SEEN]

    def limit_add(self, k: int, word: int, n: int = 1) -> None:
        """Limit k's LIMIT_IN_USE / LIMIT_WAITING / LIMIT_TAKEN moved by n (the worker's loop is
        its one writer)."""
        self.q[self.limits_at + k * LIMIT_WORDS + word] += n

    def limit_wait_begins(self, k: int, since: float) -> None:
        """A job of this worker waits for limit k from `since` (monotonic)."""
        at = self.limits_at + k * LIMIT_WORDS
        self.q[at + LIMIT_VER] += 1
        self.q[at + LIMIT_OPEN] += 1
        self.d[at + LIMIT_OPEN_SINCE] += since
        self.q[at + LIMIT_VER] += 1

    def limit_wait_ends(self, k: int, since: float, now: float) -> None:
        """The wait begun at `since` ended at `now`: from the waits under way to those that ended."""
        at = self.limits_at + k * LIMIT_WORDS
        self.q[at + LIMIT_VER] += 1
        self.q[at + LIMIT_OPEN] -= 1
        # Back to exactly 0 with none under way: the sum of start times must not drift.
        self.d[at + LIMIT_OPEN_SINCE] = self.d[at + LIMIT_OPEN_SINCE] - since if self.q[at + LIMIT_OPEN] else 0.0
        self.d[at + LIMIT_WAITED] += now - since
        self.q[at + LIMIT_VER] += 1

    # ------------------------------------------------------------ parent side (readers)

    def limit(self, k: int, now: float | None = None) -> tuple[int, int, int, float]:
        """Limit k as this worker sees it: (in use, waiting, taken, seconds waited: the waits that
        ended, and those under way up to `now`, read after the words). Never less than this
        reader saw last (a counter): a wait read as under way up to `now` may have ended a moment
        before it, by the worker's clock, and then counts a little less."""
        at = self.limits_at + k * LIMIT_WORDS
        for _ in range(READ_TRIES):      # the worker's loop writes in a few steps, never for long ...
            ver = self.q[at + LIMIT_VER]
            waited, open_, since = self.d[at + LIMIT_WAITED], self.q[at + LIMIT_OPEN], self.d[at + LIMIT_OPEN_SINCE]
            if not ver & 1 and self.q[at + LIMIT_VER] == ver:
                now = time.monotonic() if now is None else now
                # Never more than the waits under way can have lasted since the table was made
                # (a CPU that reorders stores, ARM's, may pair a new count with an old sum).
                waited += min(max(0.0, open_ * now - since), open_ * (now - self.born)) if open_ > 0 else 0.0
                break
        else:
            # ... unless it was killed or stopped between two of them: no whole read is to be had
            # (a loop on the parent's own would hang it). The ended waits alone are one word.
            waited = self.d[at + LIMIT_WAITED]
        waited = self._waited_read[k] = max(waited, self._waited_read.get(k, 0.0))
        return self.q[at + LIMIT_IN_USE], self.q[at + LIMIT_WAITING], self.q[at + LIMIT_TAKEN], waited

    def header(self, word: int) -> int:
        return self.q[word]

    def header_seconds(self, word: int) -> float:
        """A header word that holds seconds (a double): ORDER_WAITED."""
        return self.d[word]

    def heartbeat(self) -> float:
        return self.d[HEARTBEAT]

    def server_seen(self) -> float:
        return self.d[SERVER_SEEN]

    def max_duration(self) -> float:
        return self.d[MAX_DURATION]

    def spread(self) -> tuple[float, float, float]:
        """The worker's recent job times: (sum, sum of squares, count), as it last shared them."""
        return self.d[SPENT], self.d[SPENT_SQ], self.d[SEEN]

    def pings_begin(self) -> tuple[int, bool]:
        """A +WPI round for this worker begins: its number (to fence, sent or not) and whether a
        NAK with a delay is on its way (then none of its jobs is pinged this tick). See PINGS_BEGUN."""
        q = self.q
        q[PINGS_BEGUN] += 1
        with _FENCE:                    # the write above before the read below (the order is the point)
            pass
        return q[PINGS_BEGUN], q[NAKING] > 0

    def set_pings_fenced(self, round_: int) -> None:
        if round_ > self.q[PINGS_FENCED]:
            self.q[PINGS_FENCED] = round_

    def set_fleet_spread(self, seconds: float, seen: float) -> None:
        self.d[FLEET_RESIDUAL], self.d[FLEET_SEEN] = seconds, seen

    def histogram(self) -> tuple[list[int], float]:
        """Per-bucket counts (not cumulative, +Inf last) and the sum of durations."""
        return list(self.q[BUCKETS_AT:HEADER_WORDS]), self.d[DURATION_SUM]

    def snapshot(self) -> list[Entry]:
        """Every entry not FREE, each read consistently (retrying torn reads)."""
        out = []
        for i in range(min(self.q[HIGH_WATER], self.entries)):
            entry = self._read(i)
            if entry is not None:
                out.append(entry)
        return out

    def running_since(self, since: float) -> bool:
        """Whether an entry is RUNNING, started at `since` or later (0: any): snapshot()'s answer
        without building an Entry (decoding its reply) for each of hundreds of buffered jobs. Two
        words per entry, read under the entry's version as _read() does."""
        q, d = self.q, self.d
        for i in range(min(q[HIGH_WATER], self.entries)):
            base = self._base(i)
            for _ in range(100):
                ver = q[base + VER]
                if ver & 1:
                    continue
                running = q[base + ESTATE] == RUNNING and d[base + T_STARTED] >= since
                if q[base + VER] == ver:
                    if running:
                        return True
                    break
        return False

    def _read(self, i: int) -> Entry | None:
        base = self._base(i)
        q, d = self.q, self.d
        for _ in range(100):
            ver = q[base + VER]
            if q[base + ESTATE] == FREE:
                return None
            if ver & 1:
                continue
            n = q[base + REPLY_LEN]
            start = 8 * (base + ENTRY_FIXED_WORDS)
            reply = bytes(self.b[start:start + n]).decode() if n > 0 else ""
            k = q[base + KEY_LEN]
            start += 8 * self.reply_words
            key = bytes(self.b[start:start + k]).decode(errors="replace") if k > 0 else ""
            entry = Entry(i, q[base + ESTATE], q[base + SSEQ], q[base + CSEQ], q[base + DELIVERY],
                          d[base + T_HELD], d[base + T_STARTED], reply, q[base + WAIT_SEQ], key)
            if q[base + VER] == ver:
                return entry if entry.state != FREE else None
        return None
