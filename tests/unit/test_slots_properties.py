"""Property-based tests of workers/protocol/slots.py: the slot table protocol.

1. A state machine: random hold / start / mark / release / counter sequences against a model;
   after every step the parent-side reads (snapshot, free entries, high water, counters,
   histogram) say exactly what the model says.
2. Torn reads: for a random writing program (reply lengths, whether a job starts, how it is
   settled, which entry is released when), a forked child replays it as fast as it can while
   the parent snapshots; every entry the parent gets must come from one single write.
The clock is faked (`slots.time` replaced), so times identify writes.
"""

from __future__ import annotations

import mmap
import os
import time
import traceback
import types
from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from workers.protocol import slots
from workers.protocol.slots import (
    ACKED,
    ACKED_N,
    DURATION_BUCKETS,
    HELD,
    HIGH_WATER,
    NAKED_N,
    RUNNING,
    SETTLED,
    STARTED_N,
    TERMED_N,
    SlotTable,
)

ENTRIES = 5
REPLY_BYTES = 40          # rounds up to 40: replies of 41+ bytes are stored as "too long" (read as "")


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def monotonic(self) -> float:
        return self.now


@dataclass
class Model:
    state: int
    sseq: int
    cseq: int
    delivery: int
    reply: str
    t_held: float
    t_started: float = 0.0              # 0 until started in this use of the entry


class SlotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.saved_time = slots.time
        slots.time = types.SimpleNamespace(monotonic=self.clock.monotonic)
        self.table = SlotTable(ENTRIES, REPLY_BYTES)
        self.model: dict[int, Model] = {}
        self.counters = {ACKED_N: 0, NAKED_N: 0, TERMED_N: 0}
        self.started = 0
        self.buckets = [0] * (len(DURATION_BUCKETS) + 1)
        self.high = 0

    def teardown(self) -> None:
        self.table.close()
        slots.time = self.saved_time

    @rule(sseq=st.integers(1, 2**40), cseq=st.integers(1, 2**40), delivery=st.integers(1, 1000),
          reply=st.text("abc.$JS0123456789", max_size=60))
    def hold(self, sseq: int, cseq: int, delivery: int, reply: str) -> None:
        raw = reply.encode()
        i = self.table.hold(sseq, cseq, delivery, raw)
        if len(self.model) == ENTRIES:
            assert i == -1
            return
        assert 0 <= i < ENTRIES and i not in self.model
        self.model[i] = Model(HELD, sseq, cseq, delivery, reply if len(raw) <= REPLY_BYTES else "", self.clock.now)
        self.high = max(self.high, i + 1)

    def live(self, *states: int) -> list[int]:
        return sorted(i for i, m in self.model.items() if m.state in states)

    @precondition(lambda self: self.live(HELD))
    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self.live(HELD)))
        self.table.start(i)
        self.model[i].state, self.model[i].t_started = RUNNING, self.clock.now
        self.started += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data(), state=st.sampled_from([ACKED, SETTLED]))
    def settle(self, data: st.DataObject, state: int) -> None:
        i = data.draw(st.sampled_from(sorted(self.model)))
        self.table.mark(i, state)
        self.model[i].state = state

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(sorted(self.model)))
        self.table.release(i)
        del self.model[i]

    @rule(dt=st.floats(0.001, 100.0))
    def time_passes(self, dt: float) -> None:
        self.clock.now += dt

    @rule(which=st.sampled_from([ACKED_N, NAKED_N, TERMED_N]))
    def count(self, which: int) -> None:
        self.table.count(which)
        self.counters[which] += 1

    @rule(seconds=st.floats(0.0, 1000.0))
    def observe(self, seconds: float) -> None:
        self.table.observe(seconds)
        self.buckets[sum(b < seconds for b in DURATION_BUCKETS)] += 1

    @invariant()
    def snapshot_is_the_model(self) -> None:
        got = self.table.snapshot()
        assert [e.index for e in got] == sorted(self.model)
        for e in got:
            m = self.model[e.index]
            assert (e.state, e.stream_seq, e.consumer_seq, e.delivery, e.reply, e.t_held) == \
                   (m.state, m.sseq, m.cseq, m.delivery, m.reply, m.t_held), (e, m)
            assert e.t_started == m.t_started, (e, m)

    @invariant()
    def header_and_counters_are_the_model(self) -> None:
        t = self.table
        assert t.free_entries() == ENTRIES - len(self.model)
        assert t.header(HIGH_WATER) == self.high
        assert {k: t.header(k) for k in self.counters} == self.counters
        assert t.header(STARTED_N) == self.started
        assert t.histogram()[0] == self.buckets


SlotMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_slot_table_against_its_model = SlotMachine.TestCase


def test_a_reused_entry_shows_no_stale_start_time():
    """Issue 9 point 9: hold() resets the start time a reused entry kept from its previous job."""
    clock = FakeClock(5.0)
    saved, slots.time = slots.time, types.SimpleNamespace(monotonic=clock.monotonic)
    t = SlotTable(1, 64)
    try:
        t.start(t.hold(1, 1, 1, b"r1"))
        t.release(0)
        clock.now = 9.0
        t.hold(2, 2, 1, b"r2")
        [e] = t.snapshot()
        assert e.state == HELD and e.t_started == 0.0, e     # not the previous job's 5.0
    finally:
        t.close()
        slots.time = saved


# ---------------------------------------------------------------- torn reads across processes

STEP = st.tuples(st.integers(0, 60),                     # reply length (over 40: stored as too long)
                 st.booleans(),                          # the job starts
                 st.sampled_from([ACKED, SETTLED]),      # how it is settled
                 st.integers(0, 3))                      # which live entry (if any) is released after


def reply_of(k: int, length: int) -> bytes:
    return (b"r%d." % k + b"x" * length)[:max(length, len(b"r%d." % k))]


def writer(table: SlotTable, program: list, flag: memoryview) -> None:
    """In the child: replay `program` until the parent sets flag[1]; write k means seq 1000k."""
    clock = FakeClock(0.0)
    slots.time = types.SimpleNamespace(monotonic=clock.monotonic)
    flag[0] = 1
    live: list[int] = []
    k = 0
    while not flag[1]:
        for length, starts, outcome, release in program:
            k += 1
            clock.now = float(k)
            i = table.hold(k * 1000, k * 1000 + 1, k, reply_of(k, length))
            if i < 0:                            # full: release the oldest, then hold again
                table.release(live.pop(0))
                i = table.hold(k * 1000, k * 1000 + 1, k, reply_of(k, length))
            live.append(i)
            clock.now = k + 0.5
            if starts:
                table.start(i)
            table.mark(i, outcome)
            if release and live:
                table.release(live.pop(release % len(live)))


def check_entry(e: slots.Entry, program: list, started: dict[int, bool]) -> int:
    """Every field of `e` comes from the one write of job k (k = its delivery)."""
    k = e.delivery
    length = program[(k - 1) % len(program)][0]
    raw = reply_of(k, length)
    assert e.stream_seq == k * 1000 and e.consumer_seq == k * 1000 + 1, e
    assert e.reply == (raw.decode() if len(raw) <= REPLY_BYTES else ""), e
    assert e.t_held == float(k), e
    assert e.state in (HELD, RUNNING, ACKED, SETTLED), e
    starts = started[(k - 1) % len(program)]
    # start() writes the time before the state word, so a HELD entry being started right now may
    # already show it; never the start time of the entry's previous job.
    allowed = {k + 0.5} if e.state == RUNNING or (e.state != HELD and starts) else {0.0, k + 0.5} if starts else {0.0}
    assert e.t_started in allowed, e
    return k


@settings(max_examples=8, deadline=None)
@given(program=st.lists(STEP, min_size=1, max_size=8))
def test_snapshot_never_returns_a_torn_entry(program):
    # A last step that keeps its entry: a program whose every step releases one leaves the table
    # empty but for moments, and a loaded box's reader then saw fewer than 100 writes in 10 s.
    program = [*program, (8, True, ACKED, 0)]
    table = SlotTable(3, REPLY_BYTES)
    flags = mmap.mmap(-1, 16)
    flag = memoryview(flags).cast("q")
    started = {n: step[1] for n, step in enumerate(program)}
    told, tell = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        os.close(told)
        try:
            writer(table, program, flag)
        except BaseException:                  # noqa: BLE001 - any failure is a failed child: say which
            code = 1
            os.write(tell, traceback.format_exc().encode()[-4000:])
        finally:
            os._exit(code)
    os.close(tell)
    try:
        deadline = time.monotonic() + 10
        while not flag[0]:
            assert time.monotonic() < deadline, "writer did not start"
        seen: set[int] = set()
        begin = time.monotonic()
        # At least 0.15 s of racing, longer on a loaded box until enough distinct writes were read.
        while time.monotonic() - begin < 0.15 or (len(seen) < 100 and time.monotonic() - begin < 10):
            seen.update(check_entry(e, program, started) for e in table.snapshot())
    finally:
        flag[1] = 1
        _, status = os.waitpid(pid, 0)
        flag.release()
        flags.close()
        table.close()
    with os.fdopen(told, "rb") as f:
        why = f.read().decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, f"the writer failed: {why}"
    assert len(seen) >= 100, len(seen)           # the check was not vacuous
