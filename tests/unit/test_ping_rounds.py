"""Unit tests for the parent's side of the +WPI / NAK handshake (supervisor/parent/safety/watch.py
send_pings, fence_pings; slots.PINGS_BEGUN): real slot tables, a client that records what it
publishes and whether its fence works."""

from __future__ import annotations

import asyncio
import types

from supervisor.parent.safety.watch import Watch
from workers.protocol.slots import PINGS_BEGUN, PINGS_FENCED, RUNNING, SlotTable

REPLY = b"$JS.ACK.JOBS.workers.1.7.7.1700000000000000000.0"


class Client:
    def __init__(self) -> None:
        self.published: list[bytes] = []
        self.is_connected = True
        self.fence_fails = False

    async def publish(self, subject: str, payload: bytes) -> None:
        self.published.append(payload)

    async def fence(self, timeout: float) -> None:
        if self.fence_fails:
            raise TimeoutError


def worker(pid: int, running: bool) -> types.SimpleNamespace:
    table = SlotTable(entries=2, reply_bytes=64)
    if running:
        i = table.hold(7, 7, 1, REPLY)
        table.mark(i, RUNNING)
    return types.SimpleNamespace(pid=pid, pidfd=3, table=table)


def watch(nc: Client) -> Watch:
    w = Watch.__new__(Watch)      # send_pings and the fence need only these
    w.nc, w.unfenced, w.fencing, w.pings_waiting = nc, {}, None, False
    w.deaths = types.SimpleNamespace(pinged_now=lambda pid, seq, now: None)
    w.stats = types.SimpleNamespace(totals=types.SimpleNamespace(pings=0))
    return w


async def round_of(watcher: Watch, living: list) -> None:
    busy = living[0]
    await watcher.send_pings([(busy, busy.table.snapshot()[0])], 0.0, living)
    watcher.fence_pings()
    await watcher.fencing


def test_a_round_begins_in_every_living_workers_table_and_its_fence_reaches_each():
    """A +WPI acts on its job's current delivery, whoever holds it: the idle worker B, which may
    be handed that job next, must see the round too."""
    nc, a, b = Client(), worker(1, running=True), worker(2, running=False)
    watcher = watch(nc)
    asyncio.run(round_of(watcher, [a, b]))
    assert nc.published == [b"+WPI"]
    assert [t.table.header(PINGS_BEGUN) for t in (a, b)] == [1, 1]
    assert [t.table.header(PINGS_FENCED) for t in (a, b)] == [1, 1]


def test_no_ping_for_a_worker_whose_nak_is_on_its_way():
    nc, a = Client(), worker(1, running=True)
    a.table.naking(1)
    asyncio.run(round_of(watch(nc), [a]))
    assert nc.published == []
    assert a.table.header(PINGS_FENCED) == 1      # the round is fenced all the same: nobody waits on it


def test_a_round_whose_fence_failed_stays_owed():
    nc, a = Client(), worker(1, running=True)
    nc.fence_fails = True
    watcher = watch(nc)
    asyncio.run(round_of(watcher, [a]))
    assert a.table.header(PINGS_FENCED) == 0 and watcher.unfenced == {1: (a, 1)}
    nc.fence_fails = False

    async def next_tick() -> None:
        watcher.fence_pings()
        await watcher.fencing
    asyncio.run(next_tick())
    assert a.table.header(PINGS_FENCED) == 1 and watcher.unfenced == {}
