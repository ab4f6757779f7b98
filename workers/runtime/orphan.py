"""A worker's parent: the event pipe to it, whether it is still there, and what an orphan does
once it is not.

Nobody will NAK what an orphan holds when it exits, nor read its events. So it stops pulling,
NAKs what it has not started, gives running jobs and the fence of their acks ORPHAN_GRACE
(however much of a stop under way was left), NAKs what still runs, and exits; at once if its
server went with the supervisor (the embedded one), since nothing it sends could arrive.

Its NAKs would reach no ledger: its parent announced a worker's NAKs to the peer supervisors on
the ledger subject, and a peer (or the next supervisor) that gets the redelivery would count it
unexplained, a false ack_wait_too_short (F4). So an orphan announces each NAK there itself,
before it sends it, as `<host>/<pid>/<token> (worker N, orphan of pid P)`. A supervisor that
hears it counts it as a peer (it holds its running jobs: no NAK by sequence may touch them)
until its goodbye at its exit, which comes with its NAKs once more, for a supervisor that was
not listening yet (the successor a restart brings up while the orphan winds down). The NAKs
of a stop are kept from its start: the parent-death signal can read as an ordinary stop (below)
and its NAKs go out before the worker knows it is an orphan; they are announced the moment it
does (a parent alive then may have announced some too: a NAK explained twice). Each comes with
what a supervisor on the same host needs to NAK its redelivery again if that went to a worker
of its own that died before reading it (F9, supervisor/parent/safety/in_transit.py): the
delivery, when it was sent and held on the host's monotonic clock, its delay; and the goodbye
says whether the server had read every NAK (the settler's last fence went through). It leaves
the same in the fleet bucket at its exit (leave_record): the supervisor started in its parent's
place may come up only after it said them.

Before it NAKs anything as an orphan it claims its jobs in its parent's fleet heartbeat
(workers/protocol/fleetclaim.py, a revision-checked write): the fleet's poller, finding the
parent lost, releases (NAKs) the jobs that heartbeat listed, and a NAK of ours after such a
release, matching by stream sequence, would hit the job's next holder (seed 52). A claim made
first keeps the poller from releasing what it names; a release made first is read from the
poller's mark, and those jobs are not NAKed here (nor what it cannot tell: the claim failing).

It learns of the death two ways, each covering what the other misses:
  - the kernel's parent-death signal (SIGTERM, PR_SET_PDEATHSIG: set at fork, it also ends a
    worker still in its init hook, where no loop runs). The kernel sends it when the *thread*
    that forked us exits: while the parent's other threads (uvloop's resolver pool) are still
    dying, getppid() still names it, but its main thread is a zombie (`exiting`: /proc), so the
    signal is read as the death it is. And a change of credentials (an init that drops
    privileges) clears it;
  - the heartbeat's look at getppid(), in any mode, which hurries a stop already under way,
    and a last look at a stop's end: a stop that NAKed jobs and ends within a heartbeat of a
    death read as a stop says its NAKs as an orphan all the same (goodbye).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import secrets
import socket
import time
from typing import Any, Protocol

from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

from workers import Job
from workers.protocol import fleetclaim, slots
from workers.protocol.events import Event, boot_id, ledger_subject
from workers.protocol.exits import EXIT_ORPHANED
from workers.protocol.modes import STOPPING
from workers.runtime.events import EventPipe
from workers.runtime.shutdown import Shutdown
from workers.runtime.spec import ChildSpec

log = logging.getLogger("worker")

ORPHAN_GRACE = 2.0          # running jobs (and their acks' fence) get this long when the parent has died
ANNOUNCED_MAX = 500         # an orphan's NAKs said again with its goodbye, at most (one ledger message)
BOOT = boot_id()            # with its NAKs' times: a supervisor on another host cannot read them
CLAIM_RETRY = 0.05          # at most this long (at random) between two tries of a claim another write beat
RECORD_TIMEOUT = 1.0        # an orphan's record in the fleet bucket: each step of it waits this long at most


class OrphanHost(Protocol):
    """What the watch needs of the worker that owns it (workers/runtime/worker.py Worker)."""
    nc: Any
    table: slots.SlotTable
    grace: float                           # graceful_timeout as forked; an orphan's is shorter
    shutdown: Shutdown
    stream: str
    consumer: str
    mode: str

    def set_mode(self, mode: str) -> None: ...


def exiting(pid: int) -> bool:
    """The process is gone, or exiting: its main thread a zombie while the others die. The
    parent-death signal comes when the thread that forked us exits, and getppid() names the
    parent until its last thread has (module docstring): /proc tells the dying parent apart.
    Without /proc, False: getppid() alone then decides, as before."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"Z", b"X")


class ParentWatch:
    def __init__(self, owner: OrphanHost, spec: ChildSpec):
        self.owner = owner
        slot, parent_pid = spec.slot, spec.parent_pid
        self.fleet = (spec.cfg.fleet.bucket, spec.fleet_key)   # the parent's fleet heartbeat ("" key: none)
        c = spec.cfg.consumer                 # our record (leave_record) is of use while our NAKs' AckWait runs
        self.record_ttl = 2 * max(c.ack_wait, *c.backoff, 1.0)
        self.claiming: asyncio.Future | None = None   # the claim on it: the jobs not ours to NAK (claim())
        self.slot = slot
        self.parent_pid = parent_pid
        self.events = EventPipe(spec.events_fd, slot)
        self.server_dies_with_parent = spec.server_dies_with_parent
        self.orphaned = False
        self.stop_naks: list[list] = []  # [seq, why] of the NAKs since the stop began (module docstring) ...
        self.naked: list[list] = []      # ... and [seq, delivery, at, delay, held_at] of each
        self.announcing: asyncio.Future | None = None
        self.token = secrets.token_hex(4)
        self.origin = f"{socket.gethostname()}/{os.getpid()}/{self.token} (worker {slot}, orphan of pid {parent_pid})"

    def tell(self, event: Event) -> None:
        self.events.send(event)        # best effort, never blocks, never raises (workers/runtime/events.py)

    def beat(self) -> None:
        """The heartbeat's turn: send what a busy parent left in the pipe's backlog, and look for
        the parent, in any mode (a stop under way is hurried too)."""
        self.events.flush()
        if self.gone():
            self.give_up_if_server_gone()

    def gone(self) -> bool:
        """True once the supervisor is gone; the first time, turn the worker into an orphan
        (see the module's docstring). Called by the SIGTERM handler and by the heartbeat."""
        if self.orphaned:
            return True
        if os.getppid() == self.parent_pid and not exiting(self.parent_pid):
            return False
        self.orphaned = True
        w = self.owner
        self.events.close()
        log.warning("worker %d: supervisor is gone; stopping within %gs", self.slot, ORPHAN_GRACE,
                    extra={"event": "worker_orphaned", "slot": self.slot})
        self.claiming = asyncio.ensure_future(self.claim())     # first: our NAKs wait for it
        w.grace = min(w.grace, ORPHAN_GRACE)
        w.shutdown.hurry(time.monotonic() + ORPHAN_GRACE)
        w.set_mode(STOPPING)
        if self.stop_naks:               # NAKed before we knew: the parent-death signal read as a stop
            self.announcing = asyncio.ensure_future(self.publish(self.naks_said(self.stop_naks, self.naked)))
        self.give_up_if_server_gone()
        return True

    async def announce_nak(self, job: Job, reason: str, delay: float, held_at: float) -> bool:
        """Before an orphan's NAK (sent with `delay`, of a delivery held since `held_at`): tell
        whoever keeps a ledger of this consumer (module docstring). Best effort, as its parent's
        announcements were: a refused publish is only logged. False: the NAK must not be sent
        (the fleet's poller released the job, or may have: may_nak)."""
        if not self.orphaned and self.owner.mode != STOPPING:
            return True                  # the parent announces it (arbiter.py, Settled)
        if self.orphaned and not await self.may_nak(job):
            return False
        why = f"NAKed by worker {self.slot} (pid {os.getpid()}) at delivery {job.delivery}, its supervisor gone: {reason}"
        self.stop_naks.append([job.stream_seq, why])
        self.naked.append([job.stream_seq, job.delivery, round(time.monotonic(), 6), delay, round(held_at, 6)])
        del self.stop_naks[:-ANNOUNCED_MAX], self.naked[:-ANNOUNCED_MAX]
        if self.orphaned:
            await self.publish(self.naks_said(self.stop_naks[-1:], self.naked[-1:]))
        return True

    async def may_nak(self, job: Job) -> bool:
        """Not a job the fleet's poller released before our claim (nor any, when the claim could
        not tell): our NAK would hit its next holder's delivery."""
        assert self.claiming is not None, "gone() claims first"
        released = await asyncio.shield(self.claiming)
        if released is not None and (job.stream_seq, job.delivery) not in released:
            return True
        log.warning("worker %d: job seq=%d (delivery %d) %s: not NAKing it (a NAK matches by sequence and would hit "
                    "its next delivery); it comes back %s", self.slot, job.stream_seq, job.delivery,
                    "was released by the fleet's poller, which found its supervisor lost" if released is not None
                    else "may have been released by the fleet's poller (the claim on its heartbeat failed)",
                    "from that release" if released is not None else "from a release or after AckWait",
                    extra={"event": "orphan_nak_skipped", "slot": self.slot, "seq": job.stream_seq,
                           "delivery": job.delivery, "released": released is not None})
        return False

    async def claim(self) -> set[fleetclaim.Job] | None:
        """Claim what we hold (and NAKed) in the parent's fleet heartbeat before we NAK anything
        (module docstring): the jobs a poller's mark released first, or None when we cannot tell
        (the claim failed within ORPHAN_GRACE)."""
        bucket, key = self.fleet
        if not key:
            return set()
        try:
            return await asyncio.wait_for(self.claim_in(bucket, key), ORPHAN_GRACE)
        except Exception as exc:
            log.warning("worker %d: cannot claim our jobs in the supervisor's fleet heartbeat (%s): NAKing none of "
                        "them (the fleet's poller may release them)", self.slot, str(exc) or type(exc).__name__,
                        extra={"event": "orphan_claim_failed", "slot": self.slot})
            return None

    async def claim_in(self, bucket: str, key: str) -> set[fleetclaim.Job]:
        try:
            kv = await self.owner.nc.jetstream().key_value(bucket)
        except BucketNotFoundError:
            return set()                 # no fleet: nobody releases anything
        while True:
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                return set()             # it never beat: nothing listed, nothing to release
            beat = json.loads(entry.value or b"{}")
            released = fleetclaim.released(beat, self.owner.consumer)
            if released is not None:
                return released
            mine = {(e.stream_seq, e.delivery) for e in self.owner.table.snapshot() if e.state != slots.FREE}
            mine |= {(seq, delivery) for seq, delivery, *_ in self.naked}
            body = json.dumps(fleetclaim.claimed(beat, mine, time.time(), self.origin), separators=(",", ":"))
            try:
                await kv.update(key, body.encode(), last=entry.revision)
            except KeyWrongLastSequenceError:    # another orphan's claim, or the poller's mark: read again
                await asyncio.sleep(random.uniform(0, CLAIM_RETRY))
                continue
            return set()

    def naks_said(self, naks: list[list], naked: list[list]) -> dict:
        return {"origin": self.origin, "naks": naks, "naked": naked, "boot": BOOT}

    async def goodbye(self, fenced: bool) -> None:
        """At an orphan's exit: its NAKs once more, for a supervisor that was not listening yet
        (the successor a restart brings up), then the goodbye that ends its hold on the peers,
        `fenced` when the server had read every NAK (and ack) it sent. A stop whose NAKs are
        done may have been the parent's death read as a stop, the heartbeat not yet round to
        seeing it: look once more, or nobody says those NAKs, and claim (F11) before we go."""
        if not self.orphaned and self.stop_naks and self.gone() and self.claiming is not None:
            await asyncio.shield(self.claiming)
        if self.orphaned and self.stop_naks:
            await self.publish(self.naks_said(self.stop_naks, self.naked))
            await self.publish({"origin": self.origin, "bye": 1, **({"fenced": 1} if fenced else {})})
            await self.leave_record(fenced)

    async def leave_record(self, fenced: bool) -> None:
        """The same, kept in the fleet bucket (workers/protocol/fleetclaim.py orphan_key): the
        supervisor started in our parent's place may not have been listening yet. Best effort."""
        bucket, key = self.fleet
        if not key:
            return
        body = {**self.naks_said(self.stop_naks, self.naked), "bye": 1, "consumer": self.owner.consumer,
                **({"fenced": 1} if fenced else {})}
        try:
            kv = await asyncio.wait_for(self.owner.nc.jetstream().key_value(bucket), RECORD_TIMEOUT)
            await asyncio.wait_for(kv.create(fleetclaim.orphan_key(key, self.token), json.dumps(
                body, separators=(",", ":")).encode(), msg_ttl=self.record_ttl), RECORD_TIMEOUT)
        except Exception as exc:
            log.warning("worker %d: cannot leave our NAKs in the fleet bucket: %s", self.slot,
                        str(exc) or type(exc).__name__)

    async def publish(self, body: dict) -> None:
        w = self.owner
        try:
            await w.nc.publish(ledger_subject(w.stream, w.consumer), json.dumps(body, separators=(",", ":")).encode())
        except Exception as exc:         # the NAK goes out all the same; its redelivery may then read as unexplained
            log.warning("worker %d: cannot announce on the ledger subject: %s", self.slot, exc)

    def give_up_if_server_gone(self) -> None:
        """An orphan whose server died with the supervisor can settle nothing: what it holds waits
        for the server's next start and AckWait whatever it does, so it exits now instead of
        waiting out its grace for acks nobody can take."""
        nc = self.owner.nc
        if not (self.orphaned and self.server_dies_with_parent) or (nc and nc.is_connected):
            return
        held = sum(1 for e in self.owner.table.snapshot() if e.state != slots.FREE)
        log.warning("worker %d: the supervisor and its embedded NATS server are gone; exiting, %d job(s) left "
                    "to the server's AckWait", self.slot, held,
                    extra={"event": "worker_gave_up", "slot": self.slot, "held": held})
        logging.shutdown()
        os._exit(EXIT_ORPHANED)
