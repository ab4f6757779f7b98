"""Messages in transit to a worker when it died: found and NAKed within a second (issue 9, point 11).

A worker that dies with pull credits outstanding may have been sent messages it never read:
they are in no slot table, and the server would redeliver them only after AckWait. In a
work-queue stream every message still stored is unacked, so after such a death the parent can
list the lost ones: a stored message the consumer has delivered (stream seq <= delivered), that
no worker of ours holds and that the ledger does not already expect back (a NAK we know of: a
dead worker's held job, a handler's Retry with its delay), went to a process that is gone.
A NAK brings it back at once. NAKs match by stream sequence, so the NAK's reply subject can be
built from the sequence alone (the server checks the stream sequence is pending and the consumer
sequence in range; supervisor/nats/fix.py has nothing to do with it: it is the wire protocol).

That is safe only when nothing else can hold a delivery of this consumer, so it runs only when:
 - the stream is a work queue (elsewhere an acked message stays stored: no way to tell);
 - no other supervisor spoke on the ledger subject lately (Peers.alone(); a supervisor that just
   started waits until it can tell, a few seconds, far less than AckWait);
 - every live worker proved, with a PING/PONG it sent after the ConsumerInfo was read (plus
   SLACK for the server's internal delivery queue), that it has read and recorded every message
   the server sent it before (TCP keeps the server's writes in order: the MSG before the PONG);
 - the candidates are no more than the credits the dead workers had outstanding.
Anything else is left to AckWait, where the ledger's in-transit attribution explains it.
A consumer outside any supervisor bound to the same durable would have its jobs NAKed by
this; the README says the consumer belongs to the supervisors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nats.js.errors import NotFoundError

from supervisor.config import Config, subject_matches

log = logging.getLogger("supervisor")

SLACK = 0.25            # after the ConsumerInfo, before a worker's PING counts as proof
GIVE_UP = 5.0           # workers that cannot prove it within this long: leave it to AckWait
MAX_SCAN = 2000         # stream sequences looked at, at most, per reconciliation


@dataclass
class InTransit:
    cfg: Config
    nc: Any
    ledger: Any
    credits: int = 0                        # outstanding at the deaths since the last reconciliation
    deaths: list[str] = field(default_factory=list)
    info: Any = None                        # the ConsumerInfo the scan is bounded by ...
    info_at: float = 0.0                    # ... and when we had it
    stats: dict = field(default_factory=lambda: {"runs": 0, "naked": 0, "skipped": 0})

    def death(self, t: float, credits: int, who: str) -> None:
        if credits > 0:
            self.credits += credits
            self.deaths.append(who)

    async def step(self, now: float, held_anywhere: Callable[[], set[int]],
                   links_fresh_since: Callable[[float], bool], alone: bool | None) -> None:
        if not self.credits or alone is None:
            return                          # nothing to look for, or wait: peers may still say hello
        if self.cfg.stream.retention != "workqueue" or not alone or not self.nc.is_connected:
            self.done("skipped")            # not provably safe here: AckWait it is
            return
        if self.info is None:
            await self.read_consumer()
            return
        if not links_fresh_since(self.info_at + SLACK):
            if now - self.info_at > GIVE_UP:
                log.info("in-transit check skipped: a worker could not prove within %gs what it holds", GIVE_UP)
                self.done("skipped")
            return
        await self.nak_lost(held_anywhere())

    async def read_consumer(self) -> None:
        try:
            self.info = await self.nc.jetstream().consumer_info(self.cfg.stream.name, self.cfg.consumer.name,
                                                                 timeout=2.0)
            self.info_at = time.monotonic()
        except Exception as exc:
            log.info("in-transit check skipped: ConsumerInfo failed: %s", exc or type(exc).__name__)
            self.done("skipped")

    async def nak_lost(self, held: set[int]) -> None:
        lost = await self.candidates(held)
        if lost is None or len(lost) > self.credits:
            log.info("in-transit check: %s; left to AckWait", "too many messages to scan" if lost is None else
                     f"{len(lost)} unaccounted message(s), more than the {self.credits} the dead worker(s) asked for")
            self.done("skipped")
            return
        delivered = self.info.delivered.consumer_seq     # any consumer seq in range will do
        who = ", ".join(self.deaths)
        for seq in lost:
            # $JS.ACK.<stream>.<consumer>.<deliveries>.<stream seq>.<consumer seq>.<time>.<pending>
            reply = f"$JS.ACK.{self.cfg.stream.name}.{self.cfg.consumer.name}.1.{seq}.{delivered}.0.0"
            self.ledger.in_transit_naked(seq, f"in transit to {who} at its death (found and NAKed)")
            await self.nc.publish(reply, b"-NAK")
        if lost:
            try:
                await self.nc.fence(timeout=2)
            except Exception as exc:    # NATS away mid-step: the NAKs wait in nats-py's buffer; never end the parent
                log.warning("fencing in-transit NAKs failed: %s", exc or type(exc).__name__)
            log.warning("NAKed %d message(s) that were on their way to %s when it died: seq %s", len(lost), who,
                        ", ".join(map(str, lost)))
        self.stats["naked"] += len(lost)
        self.done("runs")

    async def candidates(self, held: set[int]) -> list[int] | None:
        first, last = self.info.ack_floor.stream_seq + 1, self.info.delivered.stream_seq
        if last - first + 1 > MAX_SCAN:
            return None
        js, lost = self.nc.jetstream(), []
        wanted = self.cfg.consumer.filter_subject
        for seq in range(first, last + 1):
            if seq in held or self.ledger.expecting(seq):
                continue
            try:
                msg = await js.get_msg(self.cfg.stream.name, seq)
            except NotFoundError:
                continue                    # acked (a work queue deletes it) or never stored
            except Exception as exc:        # timeout, no responders, a leader election: AckWait, not a dead parent
                log.info("in-transit check: cannot read seq %d: %s", seq, exc or type(exc).__name__)
                return None
            if not wanted or subject_matches(wanted, msg.subject) or wanted == msg.subject:
                lost.append(seq)
        return lost

    def done(self, outcome: str) -> None:
        self.stats[outcome] += 1
        self.credits, self.deaths, self.info = 0, [], None
