"""Unit tests for workers/protocol/slots.py: the shared-memory slot table.

In one process (hold/start/mark/release/snapshot, counters, histogram, heartbeat), across a real
fork (a child writes, the parent reads after it exits), a torn-read check against a child writing
as fast as it can, and a crash-consistency check (a worker killed between any two stores of a
write leaves an entry the parent reads correctly). The clock is faked: `slots.time` is replaced.
"""

from __future__ import annotations

import dis
import mmap
import os
import struct
import sys
import time
import types

import pytest

from workers.protocol import slots
from workers.protocol.slots import (
    ACKED,
    ACKED_N,
    CREDITS,
    DURATION_BUCKETS,
    FREE,
    HELD,
    HIGH_WATER,
    NAKED_N,
    PID,
    READY,
    RUNNING,
    SETTLED,
    STARTED_N,
    STATE,
    TERMED_N,
    SlotTable,
)


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(slots, "time", types.SimpleNamespace(monotonic=fake.monotonic))
    return fake


@pytest.fixture
def table():
    t = SlotTable(entries=4, reply_bytes=64)
    yield t
    t.close()


def reply_for(seq: int) -> bytes:
    return f"$JS.ACK.JOBS.workers.1.{seq}.{seq}.1700000000000000000.0".encode()


# ---------------------------------------------------------------- one process

def test_new_table_is_empty(table):
    assert table.snapshot() == []
    assert table.free_entries() == 4
    assert all(table.header(w) == 0 for w in (PID, STATE, ACKED_N, NAKED_N, TERMED_N, STARTED_N, CREDITS,
                                              HIGH_WATER))
    assert table.heartbeat() == 0.0 and table.max_duration() == 0.0
    assert table.histogram() == ([0] * (len(DURATION_BUCKETS) + 1), 0.0)


def test_hold_records_every_field(table, clock):
    clock.now = 12.5
    i = table.hold(100, 7, 3, reply_for(100))
    assert i == 0
    [e] = table.snapshot()
    assert (e.index, e.state, e.stream_seq, e.consumer_seq, e.delivery) == (0, HELD, 100, 7, 3)
    assert e.t_held == 12.5
    assert e.reply == reply_for(100).decode()
    assert table.free_entries() == 3
    assert table.header(HIGH_WATER) == 1


def test_entry_lifecycle(table, clock):
    clock.now = 1.0
    i = table.hold(5, 5, 1, b"r.5")
    clock.now = 2.0
    table.start(i)
    [e] = table.snapshot()
    assert (e.state, e.t_held, e.t_started) == (RUNNING, 1.0, 2.0)
    assert table.header(STARTED_N) == 1
    table.mark(i, ACKED)
    assert table.snapshot()[0].state == ACKED
    table.mark(i, SETTLED)
    assert table.snapshot()[0].state == SETTLED
    table.release(i)
    assert table.snapshot() == []
    assert table.free_entries() == 4
    assert table.header(HIGH_WATER) == 1           # high water never goes down


def test_running_since_answers_as_a_snapshot_would(table, clock):
    """The parent's "is a job running, started lately?" (stats.progress_beat) reads two words an
    entry instead of a snapshot: the same answer for held, running, settled and freed entries."""
    clock.now = 1.0
    held = table.hold(1, 1, 1, b"r.1")
    assert not table.running_since(0.0)
    clock.now = 5.0
    table.start(held)
    assert table.running_since(0.0) and table.running_since(5.0) and not table.running_since(5.5)
    clock.now = 9.0
    later = table.hold(2, 2, 1, b"r.2")
    table.start(later)
    assert table.running_since(8.0)
    table.mark(later, ACKED)
    assert not table.running_since(8.0) and table.running_since(4.0)
    table.release(later)
    table.release(held)
    assert not table.running_since(0.0)


def test_free_list_is_lifo(table):
    assert [table.hold(s, s, 1, b"r") for s in (1, 2, 3)] == [0, 1, 2]
    table.release(1)
    assert table.hold(4, 4, 1, b"r") == 1
    table.release(0)
    table.release(2)
    assert table.hold(5, 5, 1, b"r") == 2          # last released, first reused
    assert table.hold(6, 6, 1, b"r") == 0
    assert table.hold(7, 7, 1, b"r") == 3
    assert sorted(e.stream_seq for e in table.snapshot()) == [4, 5, 6, 7]


def test_full_table_returns_minus_one_and_changes_nothing(table):
    for s in range(4):
        assert table.hold(s, s, 1, b"r") == s
    before = table.snapshot()
    assert table.hold(99, 99, 1, b"r") == -1
    assert table.free_entries() == 0
    assert table.snapshot() == before
    table.release(2)
    assert table.hold(99, 99, 1, b"r") == 2


def test_zero_entry_table():
    t = SlotTable(entries=0, reply_bytes=64)
    try:
        assert t.hold(1, 1, 1, b"r") == -1
        assert t.snapshot() == []
    finally:
        t.close()


def test_reply_capacity_rounds_up_to_words():
    t = SlotTable(entries=2, reply_bytes=10)       # 2 words: 16 bytes fit
    try:
        t.hold(1, 1, 1, b"x" * 16)
        t.hold(2, 2, 1, b"y" * 17)
        by_seq = {e.stream_seq: e.reply for e in t.snapshot()}
        assert by_seq == {1: "x" * 16, 2: ""}
    finally:
        t.close()


def test_over_long_reply_is_stored_as_length_minus_one_and_read_as_empty(table):
    i = table.hold(1, 1, 1, b"z" * 65)
    base = table._base(i)
    assert table.q[base + slots.REPLY_LEN] == -1
    [e] = table.snapshot()
    assert e.reply == "" and e.stream_seq == 1       # the rest of the entry is intact


def test_empty_reply(table):
    table.hold(1, 1, 1, b"")
    assert table.snapshot()[0].reply == ""


def test_a_shorter_reply_in_a_reused_entry_has_no_stale_tail(table):
    i = table.hold(1, 1, 1, b"a-long-reply-subject")
    table.release(i)
    assert table.hold(2, 2, 1, b"short") == i
    assert table.snapshot()[0].reply == "short"
    table.release(i)
    table.hold(3, 3, 1, b"q" * 100)                 # too long: empty, not the old bytes
    assert table.snapshot()[0].reply == ""


def test_snapshot_lists_only_live_entries_in_index_order(table):
    for s in (10, 11, 12, 13):
        table.hold(s, s, 1, b"r")
    table.release(1)
    table.release(3)
    assert [(e.index, e.stream_seq) for e in table.snapshot()] == [(0, 10), (2, 12)]


def test_counters_state_pid_credits(table):
    table.q[PID] = 4321
    table.set_state(READY)
    for which, n in ((ACKED_N, 3), (NAKED_N, 2), (TERMED_N, 1)):
        for _ in range(n):
            table.count(which)
    table.add_credits(16)
    table.add_credits(-3)
    assert [table.header(w) for w in (PID, STATE, ACKED_N, NAKED_N, TERMED_N, CREDITS)] == [4321, READY, 3, 2, 1, 13]
    table.set_credits(0)
    assert table.header(CREDITS) == 0


def test_heartbeat_uses_the_clock(table, clock):
    clock.now = 55.25
    table.beat()
    assert table.heartbeat() == 55.25
    clock.now = 56.0
    table.beat()
    assert table.heartbeat() == 56.0


def test_histogram_buckets_are_upper_inclusive_with_inf_last(table):
    values = [0.0, 0.005, 0.0050001, 0.1, 1.0, 300.0, 300.0001, 1e6]
    for v in values:
        table.observe(v)
    counts, total = table.histogram()
    assert len(counts) == len(DURATION_BUCKETS) + 1
    expected = [0] * (len(DURATION_BUCKETS) + 1)
    for v in values:
        expected[next((k for k, bound in enumerate(DURATION_BUCKETS) if v <= bound), len(DURATION_BUCKETS))] += 1
    assert counts == expected
    assert counts[0] == 2 and counts[1] == 1 and counts[-1] == 2           # le=0.005, le=0.01, +Inf
    assert total == pytest.approx(sum(values))
    assert table.max_duration() == 1e6


def test_max_duration_only_grows(table):
    table.observe(2.0)
    table.observe(0.5)
    assert table.max_duration() == 2.0


def test_close_releases_the_mapping():
    t = SlotTable(entries=2, reply_bytes=32)
    t.hold(1, 1, 1, b"r")
    t.snapshot()
    t.close()
    assert t._mm.closed


# ---------------------------------------------------------------- across a fork

def run_child(body) -> int:
    """Fork; the child runs body() and exits at once (no pytest teardown). Returns the child's pid."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            body()
        except BaseException:                  # noqa: BLE001 - report anything as a failed child
            code = 1
        finally:
            os._exit(code)
    return pid


def wait_ok(pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_child_writes_parent_reads_after_exit(table, clock):
    def child():
        table.q[PID] = os.getpid()
        table.set_state(READY)
        clock.now = 10.0
        table.beat()
        a = table.hold(100, 1, 1, reply_for(100))
        b = table.hold(101, 2, 2, reply_for(101))
        c = table.hold(102, 3, 1, reply_for(102))
        clock.now = 11.0
        table.start(a)
        table.start(b)
        table.mark(b, ACKED)
        table.release(c)
        table.count(ACKED_N)
        table.count(NAKED_N)
        table.observe(0.2)
        table.observe(400.0)
        table.set_credits(5)

    pid = run_child(child)
    wait_ok(pid)
    assert table.header(PID) == pid
    assert table.header(STATE) == READY
    assert table.heartbeat() == 10.0
    got = [(e.stream_seq, e.consumer_seq, e.delivery, e.state, e.t_held, e.t_started, e.reply)
           for e in table.snapshot()]
    assert got == [(100, 1, 1, RUNNING, 10.0, 11.0, reply_for(100).decode()),
                   (101, 2, 2, ACKED, 10.0, 11.0, reply_for(101).decode())]
    assert [table.header(w) for w in (ACKED_N, NAKED_N, STARTED_N, CREDITS, HIGH_WATER)] == [1, 1, 2, 5, 3]
    counts, total = table.histogram()
    assert counts[DURATION_BUCKETS.index(0.25)] == 1 and counts[-1] == 1 and total == pytest.approx(400.2)
    assert table.max_duration() == 400.0


def test_parent_and_child_tables_are_independent_per_worker(clock):
    a, b = SlotTable(2, 32), SlotTable(2, 32)
    try:
        pid = run_child(lambda: (a.hold(1, 1, 1, b"a"), b.hold(2, 2, 1, b"b"), b.count(ACKED_N)))
        wait_ok(pid)
        assert [e.stream_seq for e in a.snapshot()] == [1]
        assert [e.stream_seq for e in b.snapshot()] == [2]
        assert (a.header(ACKED_N), b.header(ACKED_N)) == (0, 1)
    finally:
        a.close()
        b.close()


def test_snapshot_never_sees_a_torn_entry():
    """A child holds/starts/settles/releases as fast as it can; every entry the parent reads must
    come from one write: seq == delivery * 1000, cseq == seq + 1, reply and times derived likewise."""
    t = SlotTable(entries=3, reply_bytes=64)
    flags = mmap.mmap(-1, 16)                    # [0]: child running, [1]: parent says stop
    flag = memoryview(flags).cast("q")
    child_clock = FakeClock(0.0)

    def child():
        slots.time = types.SimpleNamespace(monotonic=child_clock.monotonic)   # the child's own copy
        flag[0] = 1
        k = 0
        live: list[int] = []
        while not flag[1]:
            k += 1
            child_clock.now = float(k)
            i = t.hold(k * 1000, k * 1000 + 1, k, (b"r" * (k % 40)) + b".%d" % k)
            if i >= 0:
                live.append(i)
            child_clock.now = k + 0.5
            t.start(i)
            t.mark(i, ACKED if k % 2 else SETTLED)
            if len(live) >= 2 or k % 3 == 0:     # vary which entry is released and when
                t.release(live.pop(k % len(live)))

    pid = run_child(child)
    try:
        deadline = time.monotonic() + 5.0
        while not flag[0]:
            assert time.monotonic() < deadline, "child did not start"
        seen = set()
        reads = 0
        # At least 0.3 s of racing, longer on a loaded machine until enough distinct writes were read.
        start = time.monotonic()
        while time.monotonic() - start < 0.3 or (len(seen) < 300 and time.monotonic() - start < 10.0):
            for e in t.snapshot():
                reads += 1
                k = e.delivery
                assert e.stream_seq == k * 1000, e
                assert e.consumer_seq == k * 1000 + 1, e
                assert e.reply == "r" * (k % 40) + f".{k}", e
                assert e.t_held == float(k), e
                assert e.state in (HELD, RUNNING, ACKED, SETTLED), e
                if e.state != HELD:
                    assert e.t_started == k + 0.5, e
                seen.add(k)
    finally:
        flag[1] = 1
        wait_ok(pid)
        flag.release()
        flags.close()
        t.close()
    assert len(seen) >= 300, (reads, len(seen))     # the check was not vacuous


# ---------------------------------------------------------------- a worker killed mid-write

class Killed(BaseException):
    pass


# The kill points, explicit: a worker can die before any store into the shared table. Every
# subscript store in a SlotTable method is one (q[...] = , d[...] = , b[a:b] = ; the methods'
# other state, _free and _high, is the worker's own memory), found in the bytecode, not the source.
STORE_OPS = {"STORE_SUBSCR", "STORE_SLICE"}
TABLE_CODES = {f.__code__ for f in vars(SlotTable).values() if isinstance(f, types.FunctionType)}
STORES = {(code, ins.offset) for code in TABLE_CODES for ins in dis.get_instructions(code) if ins.opname in STORE_OPS}


def kill_at(n: int, call) -> bool:
    """Run call(); die (raise Killed) just before the n-th store (from 0) into the table, in the
    order they run, whichever SlotTable method makes it. True if it died."""
    seen = 0

    def local(frame, event, arg):
        nonlocal seen
        if event == "opcode" and (frame.f_code, frame.f_lasti) in STORES:
            if seen == n:
                raise Killed
            seen += 1
        return local

    def tracer(frame, event, arg):
        if frame.f_code in TABLE_CODES:
            frame.f_trace_opcodes = True
            return local
        return None

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        call()
    except Killed:
        return True
    finally:
        sys.settrace(old)
    return False


def kill_points(prepare, call) -> int:
    """How many stores `call` makes (each is a kill point)."""
    t = SlotTable(entries=4, reply_bytes=64)
    try:
        i = prepare(t)
        n = 0
        while kill_at(n, lambda: call(t, i)):
            n += 1
            t.close()
            t = SlotTable(entries=4, reply_bytes=64)
            i = prepare(t)
        return n
    finally:
        t.close()


def dead_write_failures(prepare, call, before, after) -> list[str]:
    """Kill a worker before each store `call` makes; the parent must read `before` or `after`
    (the whole old entry or the whole new one), never anything in between."""
    failures = []
    for n in range(kill_points(prepare, call)):
        t = SlotTable(entries=4, reply_bytes=64)
        try:
            i = prepare(t)
            assert kill_at(n, lambda: call(t, i))
            got = read_entries(t)
            if got not in (before, after):
                failures.append(f"killed before store {n}: read {got}")
        finally:
            t.close()
    return failures


def read_entries(t: SlotTable) -> list[tuple]:
    """What the parent reads, and whether a RUNNING entry has its start time (the parent dates
    job_timeout and +WPI from it)."""
    return [(e.stream_seq, e.consumer_seq, e.delivery, e.reply, e.state, e.state != RUNNING or e.t_started > 0)
            for e in t.snapshot()]


def nothing(t):
    return None


def reused(t):
    """A used, released entry: high water already covers it, old bytes still in it."""
    t.release(t.hold(1, 1, 1, b"old.reply.subject"))


def new_hold(t, i):
    return t.hold(42000, 42001, 42, b"new.reply")


WHOLE = [(42000, 42001, 42, "new.reply", HELD, True)]


def held(t):
    return t.hold(7, 7, 1, b"r.7")


def running(t):
    i = held(t)
    t.start(i)
    return i


def acked(t):
    i = running(t)
    t.mark(i, ACKED)
    return i


def entry(state):
    return [(7, 7, 1, "r.7", state, True)]


def test_kill_points_are_every_store_of_a_write():
    # hold: high water (first use only), version, 3 ids, 2 times, the parked marks ([ordering]: 2),
    # the reply, its length, version, state
    assert kill_points(nothing, new_hold) == 13
    assert kill_points(reused, new_hold) == 12
    assert kill_points(held, lambda t, i: t.start(i)) == 3
    assert kill_points(running, lambda t, i: t.mark(i, ACKED)) == 1
    assert kill_points(acked, lambda t, i: t.release(i)) == 1


def test_kill_at_really_interrupts():
    t = SlotTable(entries=2, reply_bytes=32)
    try:
        last = kill_points(nothing, new_hold) - 1
        assert kill_at(last, lambda: new_hold(t, None))
        assert t.q[t._base(0) + slots.ESTATE] == FREE          # died just before the state word
        assert t.q[t._base(0) + slots.SSEQ] == 42000            # ... after everything else
        assert t.snapshot() == []
    finally:
        t.close()


@pytest.mark.parametrize("prepare", [nothing, reused], ids=["fresh-entry", "reused-entry"])
def test_worker_killed_inside_hold(prepare):
    # Until its last store (the state word) the entry is invisible: the parent counts the message
    # as in transit instead. After it, the parent reads it whole.
    assert dead_write_failures(prepare, new_hold, [], []) == []
    t = SlotTable(entries=4, reply_bytes=64)
    try:
        prepare(t)
        new_hold(t, None)
        assert read_entries(t) == WHOLE
    finally:
        t.close()


def test_worker_killed_inside_start():
    assert dead_write_failures(held, lambda t, i: t.start(i), entry(HELD), entry(RUNNING)) == []


def test_worker_killed_inside_mark():
    assert dead_write_failures(running, lambda t, i: t.mark(i, ACKED), entry(RUNNING), entry(ACKED)) == []


def test_worker_killed_inside_release():
    # Released entries were confirmed settled: seeing them or not are both fine, torn is not.
    assert dead_write_failures(acked, lambda t, i: t.release(i), entry(ACKED), []) == []


def test_layout_is_native_int64_and_double():
    # The parent and worker share the buffer through two casts of the same words.
    t = SlotTable(entries=1, reply_bytes=8)
    try:
        t.d[slots.HEARTBEAT] = 1.5
        assert struct.unpack_from("d", t._mm, 8 * slots.HEARTBEAT)[0] == 1.5
        assert t.q.itemsize == t.d.itemsize == 8
    finally:
        t.close()


def test_a_nak_with_a_delay_and_a_ping_round_see_each_other_whichever_writes_first(table):
    """slots.PINGS_BEGUN: each side writes its word before it reads the other's, so a +WPI round
    and a NAK with a delay never both go ahead unaware of each other."""
    # The parent's round first: the worker's NAK sees it and waits for its fence.
    round_, naks_coming = table.pings_begin()
    assert (round_, naks_coming) == (1, False)
    assert table.naking(1) == 1 and not table.pings_fenced(1)
    table.set_pings_fenced(1)
    assert table.pings_fenced(1)
    table.naking(-1)
    # The NAK first: nothing unfenced to wait for, and the parent's next round sees it coming.
    assert table.naking(1) is None
    assert table.pings_begin() == (2, True)
    table.naking(-1)
    assert table.pings_begin() == (3, False)
    # A round fenced later never moves the fence back; an unfenced newer round is waited for.
    table.set_pings_fenced(3)
    table.set_pings_fenced(2)
    assert table.pings_fenced(3)
    table.pings_begin()
    assert table.naking(1) == 4


def test_a_limit_wait_under_way_counts_up_to_the_readers_moment():
    """limit_wait_seconds_total grew only when a wait ended: a 60 s wait showed as nothing, then
    as 60 s at once. Waits under way now count up to the moment they are read, and when they
    end they move to the ended ones without a jump."""
    t = slots.SlotTable(4, 64, limits=2)
    b = t.born                                                      # times after the table was made
    assert t.limit(0, now=b + 100.0) == (0, 0, 0, 0.0)
    t.limit_wait_begins(0, b + 100.0)
    t.limit_wait_begins(0, b + 103.0)
    assert t.limit(0, now=b + 105.0)[3] == pytest.approx(5.0 + 2.0)
    t.limit_wait_ends(0, b + 100.0, b + 106.0)
    assert t.limit(0, now=b + 106.0)[3] == pytest.approx(6.0 + 3.0)
    t.limit_wait_ends(0, b + 103.0, b + 107.0)
    assert t.limit(0, now=b + 500.0)[3] == pytest.approx(10.0)      # none under way: it stays
    assert t.limit(1, now=b + 500.0)[3] == 0.0                      # the other limit's block


def test_limit_waits_read_while_the_worker_writes_them_never_go_back():
    """The parent reads a worker's limit words while the worker's loop writes them: successive
    reads never go back (a wait read as under way up to the reader's moment may have ended a
    moment before it) and never pass the time elapsed by all the waits. Red without the
    reader's own floor (a read a few µs back)."""
    import threading
    t = slots.SlotTable(4, 64, limits=1)
    stop, start = threading.Event(), time.monotonic()

    def worker() -> None:
        while not stop.is_set():
            since = time.monotonic()
            t.limit_wait_begins(0, since)
            t.limit_wait_begins(0, since)
            t.limit_wait_ends(0, since, time.monotonic())
            t.limit_wait_ends(0, since, time.monotonic())
    writer = threading.Thread(target=worker)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)                 # switch threads between the worker's stores
    writer.start()
    try:
        last = 0.0
        for _ in range(20_000):
            waited = t.limit(0)[3]
            now = time.monotonic()
            assert last - 1e-9 <= waited <= 2 * (now - start) + 1e-9, (last, waited, now - start)
            last = waited
    finally:
        stop.set()
        writer.join()
        sys.setswitchinterval(old)


def test_a_limit_read_never_counts_a_wait_half_written_nor_waits_for_its_writer_for_good():
    """A begin is several stores: between the count and the start time, a read would count the
    wait as under way since time 0 (a counter jumping by the host's uptime). While the version
    word is odd the reader takes what it last read (or the ended waits, one word), and tries a
    bounded number of times: a worker SIGKILLed (or SIGSTOPped) between two of its stores
    leaves the word odd for good, and the parent, reading it at the reap, hung (a cold review's
    find: Stats.carry never returned). Red without the version checks (the uptime counted), and
    red without the bound (the read never returns)."""
    import threading
    t = slots.SlotTable(4, 64, limits=1)
    at = t.limits_at                                          # limit 0's block
    t.limit_wait_begins(0, t.born + 1.0)
    t.limit_wait_ends(0, t.born + 1.0, t.born + 3.0)          # 2 s ended
    assert t.limit(0, now=t.born + 10.0)[3] == pytest.approx(2.0)
    t.q[at + slots.LIMIT_VER] += 1                            # the worker is writing a begin ...
    t.q[at + slots.LIMIT_OPEN] += 1                           # ... the count stored, the start not yet
    read: list[float] = []
    reader = threading.Thread(target=lambda: read.append(t.limit(0, now=t.born + 20.0)[3]), daemon=True)
    reader.start()
    reader.join(10)
    assert read == [pytest.approx(2.0)], f"a wait half written was counted, or the read hung: {read}"
    t.d[at + slots.LIMIT_OPEN_SINCE] += t.born + 15.0
    t.q[at + slots.LIMIT_VER] += 1                            # written
    assert t.limit(0, now=t.born + 20.0)[3] == pytest.approx(2.0 + 5.0)


def test_a_wait_read_out_of_order_counts_no_longer_than_the_table_has_lived():
    """On a CPU that reorders stores (ARM), a whole-looking read may pair a new count with an
    old sum of start times: never more than the waits under way can have lasted since the
    table was made before the worker's fork."""
    t = slots.SlotTable(4, 64, limits=1)
    at = t.limits_at
    t.q[at + slots.LIMIT_OPEN] = 1                            # the count, without its start time
    assert t.limit(0, now=t.born + 4.0)[3] == pytest.approx(4.0)
