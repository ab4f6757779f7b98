"""F18: a worker's NAK not yet fenced at its death, which the server had read all the same (its
MSG_NAKED advisory came), in whichever order the advisory and the death reach the parent
(supervisor/parent/safety/in_transit.py, supervisor/core/ledger.py NAK_READ). The in-transit
check NAKs the redelivery that may be on the dead worker's wire, and the ledger says so; with
no advisory nothing changes (F10: left to AckWait). The real-server test is
tests/integration/test_found_by_random.py::test_a_retry_read_by_the_server_before_its_workers_death_comes_back_at_once."""

from __future__ import annotations

import asyncio
import time

import pytest

from supervisor.config import Config
from supervisor.core.ledger import NAK_READ, NAK_READ_NAKED, NAK_UNSENT, CrashLedger
from supervisor.parent.safety.in_transit import SLACK, InTransit


class Wire:
    """The parent's connection as the check uses it: what it published."""
    is_connected = True

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append((subject, data))

    async def fence(self, timeout: float = 1) -> None:
        return None

    async def flush(self, timeout: float = 1) -> None:
        return None


def died_with_its_nak_unfenced(order: str, at_ago: float = 0.0):
    """Worker 0 NAKs seq 7 at delivery 1 (consumer seq 70) and dies with the entry in its table;
    the server's advisory comes `order` ("before" the death, "after" it, or "never")."""
    cfg = Config()
    ledger, wire = CrashLedger(cfg.consumer.ack_wait, 3), Wire()
    it = InTransit(cfg, wire, ledger)
    now = time.monotonic()
    at = now - at_ago
    ledger.settled(now, 7, 1, "nak")                    # the worker's Settled event ...
    it.worker_nak(7, 1, at, 0.0, at - 0.1, now)
    if order == "before":
        it.nak_advised(7, 1, 70, now + 0.01)
    it.death(now + 0.02, 2, "worker 0 (pid 9)", now, {7: (1, 70)}, pid=9, slot=0)   # as crew.reap_one: first
    death = ledger.record_death(now + 0.02, 0, 9, "signal SIGKILL", [(7, 1, "settled", False, at - 0.1)],
                                in_transit=2)
    if order == "after":
        it.nak_advised(7, 1, 70, now + 0.03)
    it.observed(now + 0.03 + SLACK, now + 0.04 + SLACK, 7, waiting=1, consumer_seq=71)   # a request waiting since
    return ledger, wire, it, death.held[0]


@pytest.mark.parametrize("order", ["before", "after"])
def test_a_nak_the_server_read_before_its_workers_death_is_naked_again_and_explained(order):
    ledger, wire, it, job = died_with_its_nak_unfenced(order)
    assert job.waits == NAK_READ
    asyncio.run(it.nak_redeliveries(set, lambda _t: True))
    assert wire.published == [(f"$JS.ACK.{it.cfg.stream.name}.{it.cfg.consumer.name}.1.7.71.0.0", b"-NAK")]
    assert it.stats["redeliveries_naked"] == 1 and ledger.counts["in_transit_naked"] == 1
    assert job.waits == NAK_READ_NAKED
    why = ledger.redelivered(time.monotonic(), 7, 2)
    assert why == f"held by worker 0 (pid 9) at its death (signal SIGKILL): {NAK_READ_NAKED}"
    assert ledger.crosscheck(time.monotonic())["left_to_ack_wait"][0]["waits"] == NAK_READ_NAKED


def test_a_live_worker_holding_it_stops_the_nak():
    """The proof's last look: the redelivery reached a live worker (in its table) after all."""
    ledger, wire, it, job = died_with_its_nak_unfenced("before")
    asyncio.run(it.nak_redeliveries(lambda: {7}, lambda _t: True))
    assert wire.published == [] and job.waits == NAK_READ


def test_without_the_advisory_the_job_is_left_to_ackwait_as_before():
    ledger, wire, it, job = died_with_its_nak_unfenced("never")
    assert job.waits == NAK_UNSENT
    asyncio.run(it.nak_redeliveries(set, lambda _t: True))
    assert wire.published == [] and job.waits == NAK_UNSENT
    # Once too late to prove, it is dropped silently: the death named it already.
    ledger, wire, it, job = died_with_its_nak_unfenced("never", at_ago=ledger.ack_wait)
    asyncio.run(it.nak_redeliveries(set, lambda _t: True))
    assert wire.published == [] and it.worker_naks.naks == {} and it.stats["skipped"] == 0
    assert ledger.redelivered(time.monotonic(), 7, 2).endswith(NAK_UNSENT)
