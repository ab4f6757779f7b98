"""Acks a consumer leader change may have lost, sent again until the new leader confirms them.

The fence (settle.py) proves only that the server we are connected to read an ack. In a cluster
the ack then travels to the consumer leader, which applies it at once and replicates it
after (nats-server consumer.go `updateAcks`: a raft proposal). A leader that dies before a quorum
stored it loses it. From its death until a new leader is elected (raft's election timeout, 4-9 s)
nobody subscribes to `$JS.ACK.<stream>.<consumer>.>` at all, so the server drops acks silently
while the fence succeeds; a step-down drops the acks queued on the old leader too (`setLeader`:
`ackMsgs.drain()`). The new leader holds those jobs as pending and hands them out again after
AckWait: a job that completed runs twice.

So every plain ack stays in a window (`RecentAcks`, pure) for AckWait: after that the server has
handed the job out again if it lost the ack, and nothing we send can undo it. When the consumer
may have changed leader (its LEADER_ELECTED advisory, a 409 "Leadership Change" or a 503 "no
responders" answering a pull, a reconnect of our own), each ack in the window is sent again with
a reply subject of ours. The consumer leader replies once the ack is committed to a quorum
(`processReplicatedAck`; a non-replicated consumer at once), so a reply proves that no later
failover can lose it, and the ack leaves the window. No reply (no leader yet: 503; a leader still
catching up; one that died again) and it is sent again every RESEND_EVERY until proven or out of
the window, when the parent is told (`acks_resent` with `unconfirmed`) so its ledger explains the rerun.
Once one re-sent ack is proven a leader is in place: acks sent from then on are as safe as any,
and the round ends when every ack sent before that is proven.

An ack sent again acts on the job's current delivery, whoever holds it (acks match by stream
sequence, DESIGN.md): for a job that completed that is right. With workers.double_ack the ack is
a request that the leader answers after the commit, so it is proven already and kept nowhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers.protocol.events import AcksResent, Event

log = logging.getLogger("worker")

RESEND_EVERY = 1.0      # seconds between passes while acks wait for the leader's confirmation
WINDOW_LIMIT = 4096     # acks kept at most: the ones a failover loses are the last before it
                        # (its gap delivers nothing new), a table's worth plus a commit latency's
UNCONFIRMED_REPORTED = 100   # stream seqs named in one report to the parent


class RecentAcks:
    """The plain acks sent in the last `keep` seconds, at most `limit`, oldest first. Pure."""

    def __init__(self, keep: float, limit: int = WINDOW_LIMIT):
        self.keep, self.limit = keep, limit
        self.acks: OrderedDict[int, tuple[str, float]] = OrderedDict()    # seq -> (reply subject, sent at)

    def add(self, sent: Iterable[tuple[int, str]], now: float) -> None:
        """Acks (stream seq, reply subject) sent at `now` (a batch of them: one prune)."""
        acks = self.acks
        for seq, reply in sent:
            acks.pop(seq, None)
            acks[seq] = (reply, now)
        self.prune(now)

    def prune(self, now: float) -> list[int]:
        """Drop what is older than `keep` or over `limit`; returns their seqs."""
        gone = []
        while self.acks and (len(self.acks) > self.limit or now - next(iter(self.acks.values()))[1] > self.keep):
            gone.append(self.acks.popitem(last=False)[0])
        return gone

    def proven(self, seq: int) -> bool:
        return self.acks.pop(seq, None) is not None

    def sent_before(self, t: float | None) -> list[tuple[int, str]]:
        """(seq, reply) of the acks sent before `t` (None: all of them)."""
        return [(seq, reply) for seq, (reply, at) in self.acks.items() if t is None or at < t]

    def __len__(self) -> int:
        return len(self.acks)


@dataclass
class Round:
    """One leader change's re-sends, until every ack sent before a leader was back is proven."""
    why: str
    resent: set[int] = field(default_factory=set)
    confirmed: int = 0
    unconfirmed: list[int] = field(default_factory=list)
    leader_back: float | None = None     # when the first re-sent ack was confirmed (since the last trigger)


class ReackHost(Protocol):
    """What re-acking needs of the worker that owns it (worker.py Worker)."""
    nc: Any

    def emit(self, event: Event) -> None: ...


class Reacker:
    def __init__(self, owner: ReackHost, slot: int, stream: str, consumer: Any):
        """`consumer`: the [consumer] config (its name; AckWait and backoff size the window)."""
        self.owner, self.slot = owner, slot
        self.stream, self.consumer = stream, consumer.name
        # The longest AckWait: after it a job whose ack was lost has been handed out again.
        self.window = RecentAcks(keep=max((consumer.ack_wait, *consumer.backoff)))
        self.round: Round | None = None
        self.wake = asyncio.Event()
        self.inbox = ""

    async def start(self) -> None:
        nc = self.owner.nc
        self.inbox = nc.new_inbox()
        await nc.subscribe(f"{self.inbox}.*", cb=self.on_reply)
        # Without permission to subscribe here, nats-py only calls error_cb: the 409s, 503s and
        # reconnects still trigger a round.
        await nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.{self.stream}.{self.consumer}",
                           cb=self.on_leader_elected)

    # -- what the worker tells us

    def sent(self, acks: Iterable[tuple[int, str]]) -> None:
        """Plain acks (stream seq, reply subject) were published (Settler.sent, ack_all)."""
        self.window.add(acks, time.monotonic())

    def trigger(self, why: str) -> None:
        """The consumer may have another leader now, or none: prove what the window holds."""
        if self.round is None:
            self.round = Round(why)
        self.round.leader_back = None    # a confirmation from before this says nothing about now
        self.wake.set()

    def on_pull_status(self, headers: dict[str, str]) -> None:
        status, description = headers.get("Status"), headers.get("Description", "")
        if status == "409" and "Leadership Change" in description:
            self.trigger("409 Leadership Change on a pull")
        elif status == "503":
            self.trigger("no consumer leader (503 on a pull)")

    async def on_leader_elected(self, msg: Any) -> None:
        try:
            leader = json.loads(msg.data).get("leader", "?")
        except ValueError:
            leader = "?"
        self.trigger(f"consumer leader {leader} elected")

    async def on_reply(self, msg: Any) -> None:
        if (msg.headers or {}).get("Status") == "503" or self.round is None:
            return                       # no leader to take it (yet): the next pass sends it again
        try:
            seq = int(msg.subject.rsplit(".", 1)[1])
        except ValueError:
            return
        if self.window.proven(seq):
            self.round.confirmed += 1
        if self.round.leader_back is None:
            self.round.leader_back = time.monotonic()
        self.wake.set()

    # -- the task

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.round is not None and self.due():
                if self.owner.nc.is_connected:   # a reconnect triggers us again
                    await self.resend()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), RESEND_EVERY)
                self.wake.clear()
                self.expire()
            self.report()

    def due(self) -> list[tuple[int, str]]:
        assert self.round is not None
        return self.window.sent_before(self.round.leader_back)

    async def resend(self) -> None:
        assert self.round is not None
        nc = self.owner.nc
        due = self.due()
        if not self.round.resent:
            log.info("worker %d: %s; sending %d recent ack(s) again until the leader confirms them",
                     self.slot, self.round.why, len(due), extra={"event": "acks_resending", "acks": len(due)})
        for seq, reply in due:
            try:
                await nc.publish(reply, b"+ACK", reply=f"{self.inbox}.{seq}")
            except Exception as exc:     # nats-py refused it (reconnecting, buffer full): next pass
                log.debug("worker %d: re-sending acks: %s", self.slot, exc)
                return
            self.round.resent.add(seq)

    def expire(self) -> None:
        """Acks out of the window unconfirmed: if the leader change lost them, AckWait has run
        out by now and the job may run again."""
        due = {seq for seq, _ in self.due()}
        self.round.unconfirmed += [seq for seq in self.window.prune(time.monotonic()) if seq in due]  # type: ignore[union-attr]

    def report(self) -> None:
        """The round is over: tell the parent (its ledger counts them and expects the lost)."""
        done, self.round = self.round, None
        if done is None or not done.resent:
            return
        level = logging.WARNING if done.unconfirmed else logging.INFO
        log.log(level, "worker %d: %d ack(s) sent again after a consumer leader change (%s): %d confirmed, "
                "%d never (those jobs may run again)", self.slot, len(done.resent), done.why, done.confirmed,
                len(done.unconfirmed), extra={"event": "acks_resent", "acks": len(done.resent),
                                              "confirmed": done.confirmed,
                                              "unconfirmed": done.unconfirmed[:UNCONFIRMED_REPORTED]})
        self.owner.emit(AcksResent(done.why, len(done.resent), done.confirmed,
                                   tuple(done.unconfirmed[:UNCONFIRMED_REPORTED])))

    def close(self) -> None:
        """The worker is leaving: what an open round has not confirmed yet may run again."""
        if self.round is not None:
            self.round.unconfirmed += [seq for seq, _ in self.due()]
            self.report()
