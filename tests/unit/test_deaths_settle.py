"""Deaths.settle (supervisor/parent/safety/deaths.py) with a real slot table, ledger and boards:
a crash posts its held jobs on the crash board (their next spans name it) and its running ones
on the suspect board before the NAKs bring them back; a clean exit that gave up a live pull
request (F20) is a death that is no crash, and what its table held is NAKed and expected back
as any clean exit's. Red on the first F20 commit (a cold review's find): its branch took the
boards' updates with it, and such an exit with an entry in its table hit an unbound `death`."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from test_nak_read_at_death import Wire

from supervisor.config import Config
from supervisor.core.ledger import CrashLedger
from supervisor.parent.safety.deaths import Deaths
from workers.protocol.crashes import CrashBoard
from workers.protocol.slots import SlotTable
from workers.runtime.solo import SuspectBoard


class Peers:
    def __init__(self) -> None:
        self.deaths: list = []
        self.naks: list = []

    def death(self, death) -> None:
        self.deaths.append(death)

    def announce(self, seq: int, why: str) -> None:
        self.naks.append(seq)

    async def flush(self) -> None:
        return None


@pytest.mark.parametrize("clean,credits", [(False, 0), (True, 2)])
def test_settle_posts_the_crash_and_naks_what_was_held(clean, credits):
    cfg = Config()
    ledger, wire, peers = CrashLedger(cfg.consumer.ack_wait, 3), Wire(), Peers()
    crashes, suspects = CrashBoard(capacity=16), SuspectBoard()
    deaths = Deaths(cfg, wire, ledger, peers, lambda *_: None, suspects, crashes)
    table = SlotTable(8, 128)
    table.hold(7, 70, 1, f"$JS.ACK.{cfg.stream.name}.{cfg.consumer.name}.1.7.70.0.0".encode(), time.monotonic())
    table.set_credits(credits)
    w = SimpleNamespace(slot=0, pid=4242, table=table, kill=None)
    asyncio.run(deaths.settle(w, "signal SIGKILL" if not clean else "retired", clean))
    assert [p for p in wire.published if p[1] == b"-NAK"], "the held entry was not NAKed"
    if not clean:
        assert crashes.lookup(7) is not None, "the crash's held job is not on the crash board"
        return
    assert crashes.lookup(7) is None                     # no crash
    [death] = ledger.deaths
    assert (death.in_transit, death.held, ledger.counts["crashes"]) == (2, [], 0)
    assert ledger.expecting(7), "what the clean exit left is not expected back"


def test_a_crash_beside_others_shows_its_running_jobs_on_the_suspect_board_before_the_naks():
    cfg = Config()
    ledger, wire = CrashLedger(cfg.consumer.ack_wait, 3), Wire()
    suspects = SuspectBoard()
    deaths = Deaths(cfg, wire, ledger, Peers(), lambda *_: None, suspects, CrashBoard(capacity=16))
    table = SlotTable(8, 128)
    for seq in (7, 8):
        i = table.hold(seq, seq * 10, 1, f"$JS.ACK.{cfg.stream.name}.{cfg.consumer.name}.1.{seq}.{seq * 10}.0.0".encode())
        table.start(i)
    asyncio.run(deaths.settle(SimpleNamespace(slot=0, pid=4242, table=table, kill=None), "signal SIGSEGV", False))
    assert ledger.on_probation() == [7, 8]
    assert suspects.suspect(7) and suspects.suspect(8), "probation not on the board when the NAKs went out"
