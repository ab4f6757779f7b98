"""The NATS side of a worker's death: NAK what it held at once, quarantine poison, hold NAKs back
while NATS is away, NAK once more a job nobody has seen again, and fence it all.

The arbiter's loop is the only caller (one writer); what a dead worker held comes from its slot
table, read after the pidfd said it exited. The rules (when a NAK is safe, when to repeat one)
are pure functions in policy.py and liveness.py; this room sends what they decide.

Why NAK at all: a dead worker's deliveries would otherwise wait for AckWait (30 s by default).
Why never blindly: NAKs match by stream sequence, so a NAK for a delivery whose AckWait has (nearly)
run out may hit the job's next delivery, held by someone else (policy.nak_is_safe).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from supervisor.config import Config
from supervisor.core import liveness
from supervisor.core.ledger import CrashLedger
from supervisor.core.policy import ack_wait_for, nak_is_safe, nak_safe_until
from supervisor.parent.process import WorkerProcess
from supervisor.parent.safety.peers import Peers
from workers import Job
from workers.protocol import slots
from workers.protocol.crashes import Crash, CrashBoard
from workers.runtime.deadletter import dead_letter
from workers.runtime.solo import SuspectBoard

log = logging.getLogger("supervisor")


@dataclasses.dataclass
class SentNak:
    """A dead worker's job we NAKed, until some supervisor sees it again (renak_unseen)."""
    reply: str
    delivery: int
    sent_at: float
    pid: int = 0                          # the dead worker that held it
    confirmed_at: float | None = None     # when a fence proved the server had read it
    blocked: str = ""                     # why a re-NAK could not be proven safe yet


@dataclasses.dataclass
class HeldBack:
    """A NAK for a dead worker's job that could not be sent (NATS disconnected): sent on reconnect
    if its AckWait still allows it."""
    seq: int
    delivery: int
    reply: str
    timer_started: float
    pid: int                              # the dead worker that held it
    since: float = dataclasses.field(default_factory=time.monotonic)    # held back since


class Deaths:
    def __init__(self, cfg: Config, nc: Any, ledger: CrashLedger, peers: Peers,
                 alert: Callable[[str, str], None], suspects: SuspectBoard | None = None,
                 crashes: CrashBoard | None = None):
        self.cfg, self.nc, self.ledger, self.peers, self.alert = cfg, nc, ledger, peers, alert
        self.suspects = suspects
        self.crashes = crashes             # which death each redelivery comes back from, for its span
        self.pinged: dict[tuple[int, int], float] = {}     # (pid, seq) -> our last +WPI for it
        self.renak: dict[int, SentNak] = {}                # a dead worker's job NAKed, by stream seq
        self.held_back: list[HeldBack] = []

    # ---------------------------------------------------------------- AckWait timers

    def ack_wait(self, delivery: int) -> float:
        return ack_wait_for(self.cfg.consumer.ack_wait, self.cfg.consumer.backoff, delivery)

    def timer_started(self, pid: int, e: slots.Entry) -> float:
        """When the server's AckWait timer for this delivery last started: held, or our last +WPI."""
        return max(e.t_held, self.pinged.get((pid, e.stream_seq), 0.0))

    def stored_timer_started(self, pid: int, e: slots.Entry, now: float, wall: float) -> float:
        """When the AckWait timer the server *stores* for this delivery started (monotonic, like
        `now`): our last +WPI, or else the message's own timestamp. nats-server keeps the delivery
        time in memory only: its consumer store records the message's timestamp at a delivery
        (consumer.go deliverMsg: updateDelivered(..., pmsg.ts)), in whole seconds, and only a
        +WPI (or a NAK's delay) stores a time of its own. A restarted server, or a new consumer
        leader, counts AckWait from what is stored: a job published more than AckWait before it
        was delivered and not pinged since is redelivered at once while its holder runs it or
        waits with it (F14, docs/RELIABILITY.md)."""
        return liveness.stored_timer(e, self.pinged.get((pid, e.stream_seq), 0.0), now, wall)

    def pinged_now(self, pid: int, seq: int, now: float) -> None:
        self.pinged[(pid, seq)] = now

    def keep_pings(self, held: set[tuple[int, int]]) -> None:
        """Settled jobs need no memory; a dying worker's pings still date its jobs."""
        self.pinged = {k: t for k, t in self.pinged.items() if k in held}

    def forget(self, pid: int) -> None:
        self.pinged = {k: v for k, v in self.pinged.items() if k[0] != pid}

    # ---------------------------------------------------------------- a death

    async def settle(self, w: WorkerProcess, cause: str, clean: bool) -> None:
        """NAK what a dead worker held, at once, so it is redelivered in milliseconds, not AckWait.
        A worker that exited cleanly has settled and fenced everything: anything left (HELD,
        RUNNING, an ACKED entry in doubt) is a backstop NAK."""
        now = time.monotonic()
        entries = w.table.snapshot()
        nak = [self.nak_guard(w.pid, e, now) for e in entries]
        left: list = []                   # held jobs the death names as waiting for AckWait (F10)
        if not clean:
            held = [(e.stream_seq, e.delivery, slots.ENTRY_STATES[e.state], n, self.timer_started(w.pid, e))
                    for e, n in zip(entries, nak)]
            death = self.ledger.record_death(now, w.slot, w.pid, cause, held, in_transit=w.table.header(slots.CREDITS),
                                             job_to_blame=w.kill is None or w.kill.cause.blames_jobs,
                                             blame=w.kill.blame if w.kill else None, in_transit_since=w.table.server_seen())
            left = [job for job in death.held if job.waits]
            self.peers.death(death)       # what was on its wire may come back to a peer's worker after AckWait
            if self.suspects is not None:     # on the board before the NAKs bring the suspects back
                self.suspects.show(self.ledger.on_probation())
            if self.crashes is not None:      # likewise: their next spans name this death
                for e in entries:
                    self.crashes.post(Crash(e.stream_seq, e.delivery, death.id, w.slot, w.pid, time.time(), cause))
        elif w.table.header(slots.CREDITS):
            self.gave_up_requests(w, cause, now)
        for e, n in zip(entries, nak):
            if clean:         # no death in the ledger: what it left (NAKed now, or after AckWait) explains its rerun
                self.ledger.expect(e.stream_seq, f"left {slots.ENTRY_STATES[e.state]} by worker {w.slot} "
                                                 f"(pid {w.pid}) when it exited", e.delivery)
            if n:     # peers first: the redelivery our NAK causes may land on another host
                self.peers.announce(e.stream_seq, f"held by worker {w.slot} (pid {w.pid}) at its death ({cause})")
        for job in left:  # its redelivery (after AckWait) may land on another host too
            self.peers.announce(job.seq, f"held by worker {w.slot} (pid {w.pid}) at its death ({cause}): {job.waits}")
        await self.peers.flush()
        for e, n in zip(entries, nak):
            if not n:
                continue
            if not clean and e.state == slots.RUNNING and self.ledger.is_poison(e.stream_seq):
                await self.quarantine(e, self.timer_started(w.pid, e), w.pid)
            else:
                await self.nak(HeldBack(e.stream_seq, e.delivery, e.reply, self.timer_started(w.pid, e), w.pid))
        if any(nak):
            await self.flush()
        naked = [e.stream_seq for e, n in zip(entries, nak) if n]
        if clean:
            log.info("worker %d (pid %d) drained and exited", w.slot, w.pid,
                     extra={"event": "worker_exited", "slot": w.slot, "worker_pid": w.pid, "naked": naked})
        else:
            seqs = ", ".join(f"seq {e.stream_seq}" for e in entries) or "nothing"
            waits = "".join(f"; seq {job.seq} (delivery {job.delivery}) left to AckWait: {job.waits}" for job in left)
            log.warning("worker %d (pid %d) died: %s; held %s%s%s", w.slot, w.pid, cause, seqs,
                        f"; NAKed {len(naked)} for immediate redelivery" if naked else "", waits,
                        extra={"event": "worker_died", "slot": w.slot, "worker_pid": w.pid, "cause": cause,
                               "held": [e.stream_seq for e in entries], "naked": naked,
                               "left_to_ack_wait": [{"seq": job.seq, "delivery": job.delivery, "why": job.waits}
                                                    for job in left]})

    def gave_up_requests(self, w: WorkerProcess, cause: str, now: float) -> None:
        """No crash: a drain whose deadline came before its last pull request ended (F20). What
        may be on its wire is explained as at a death, here and at the peers; what its table
        still holds is the clean exit's (expected back, backstop NAKs), and nothing is blamed."""
        self.peers.death(self.ledger.record_death(
            now, w.slot, w.pid, f"{cause}, its last pull request given up at graceful_timeout", [],
            in_transit=w.table.header(slots.CREDITS), job_to_blame=False,
            in_transit_since=w.table.server_seen(), crash=False))

    def nak_guard(self, pid: int, e: slots.Entry, now: float) -> bool:
        """NAK unsettled jobs, and acked ones whose ack may be lost (a NAK after an ack is a no-op);
        never one whose AckWait has (nearly) run out: it may be redelivered to someone else already."""
        if e.state not in (slots.HELD, slots.RUNNING, slots.ACKED) or not e.reply:
            return False
        return nak_is_safe(now, self.timer_started(pid, e), self.ack_wait(e.delivery))

    async def nak(self, order: HeldBack) -> None:
        """NAK now, or, while NATS is disconnected, as soon as it is back (if still safe then)."""
        if not self.nc.is_connected:
            self.held_back.append(order)
            log.info("NATS is away: the NAK of seq=%d (delivery %d) waits for it", order.seq, order.delivery,
                     extra={"event": "nak_held_back", "seq": order.seq, "delivery": order.delivery})
            return
        log.debug("NAK seq=%d (delivery %d) via %s", order.seq, order.delivery, order.reply)
        await self.nc.publish(order.reply, b"-NAK")
        self.renak[order.seq] = SentNak(order.reply, order.delivery, time.monotonic(), order.pid)

    async def send_held_back(self) -> None:
        if not self.held_back or not self.nc.is_connected:
            return
        now, orders, self.held_back = time.monotonic(), self.held_back, []
        sent = 0
        for order in orders:
            if nak_is_safe(now, order.timer_started, self.ack_wait(order.delivery)):
                await self.nak(order)
                sent += 1
            else:
                log.warning("job seq=%d of a dead worker: NATS was down until its AckWait ran out; the server "
                            "redelivers it", order.seq, extra={"event": "held_back_expired", "seq": order.seq})
        if sent:
            log.info("NATS is back: sent %d NAK(s) held back while disconnected", sent,
                     extra={"event": "held_back_sent", "count": sent})
            await self.flush()

    def naks_in_doubt(self, now: float) -> list[dict]:
        """/status `crosscheck.naks_in_doubt`: dead workers' jobs whose NAK has not surely reached
        the server: held back while NATS is away, or sent and not yet confirmed by a fence (a
        stalled link holds it). A supervisor that dies meanwhile takes these NAKs with it: the
        jobs then come back after AckWait, or when a peer releases a lost supervisor's jobs, and
        its last /status names them."""
        held = [{"stream_seq": o.seq, "delivery": o.delivery, "pid": o.pid, "since_s": round(now - o.since, 3),
                 "waits": "its NAK waits for NATS to come back (the supervisor is disconnected)"}
                for o in self.held_back]
        sent = [{"stream_seq": seq, "delivery": n.delivery, "pid": n.pid, "since_s": round(now - n.sent_at, 3),
                 "waits": "its NAK was sent and no fence has confirmed it yet"}
                for seq, n in self.renak.items() if n.confirmed_at is None]
        return held + sent

    def held_back_useful_until(self) -> float:
        """The last moment any held-back NAK is still safe to send (monotonic); 0 when none is held."""
        return max((nak_safe_until(o.timer_started, self.ack_wait(o.delivery)) for o in self.held_back), default=0.0)

    async def quarantine(self, e: slots.Entry, timer_started: float, pid: int) -> None:
        """A job held at poison_after_crashes worker deaths: dead-letter it with the evidence, TERM it.
        The ledger marks it quarantined only once the TERM went out: a quarantine that fails (the
        dead-letter stream away, the parent disconnected) NAKs the job, or holds the NAK back while
        NATS is away, and the job's next fatal run tries again (R7, interleaving B)."""
        deaths = self.ledger.deaths_of(e.stream_seq)
        evidence = "; ".join(f"pid {d.pid} {d.cause}" for d in deaths)
        reason = f"poison: held at {len(deaths)} worker deaths ({evidence})"
        try:
            if not self.nc.is_connected:
                raise ConnectionError("not connected to NATS")
            raw = await self.nc.jetstream().get_msg(self.cfg.stream.name, e.stream_seq)
            headers = dict(raw.headers or {})
            job = Job(data=raw.data or b"", subject=raw.subject or "", headers=headers, stream_seq=e.stream_seq,
                      delivery=e.delivery, msg_id=headers.get("Nats-Msg-Id"))
            await dead_letter(self.nc, self.cfg, job, reason, {"Supervisor-Dead-Letter-Deaths": evidence})
            await self.nc.publish(e.reply, b"+TERM " + reason.encode()[:300])
        except Exception as exc:    # any failure: the job must not be left to AckWait, nor escape poison detection
            log.error("cannot quarantine poison job seq=%d (%s); NAKing it instead: its next fatal run tries again",
                      e.stream_seq, str(exc) or type(exc).__name__,
                      extra={"event": "quarantine_failed", "seq": e.stream_seq, "error": f"{type(exc).__name__}: {exc}"})
            await self.nak(HeldBack(e.stream_seq, e.delivery, e.reply, timer_started, pid))
            return
        self.ledger.quarantine(e.stream_seq)
        self.alert("poison", f"job seq={e.stream_seq} quarantined to {self.cfg.restart.dead_letter_subject}: {reason}")

    # ---------------------------------------------------------------- afterwards

    async def renak_unseen(self, fresh_view: Callable[[], set[int]], unproven: Callable[[float], str]) -> None:
        """A NAKed job can be handed straight to another dead worker's pull request when something
        else keeps that inbox alive (a `nats sub '>'` or '_INBOX.>' tap does): it would then wait
        for AckWait. One more NAK, RENAK_AFTER after a fence proved the first one arrived (two
        NAKs stuck in one stalled socket would arrive together and run the job twice), but only
        with proof that no live process holds the redelivery, since the server NAKs whoever holds
        the sequence: `unproven(confirmed_at)` says what is missing (a peer that may hold it; a
        live worker whose loop or link is stalled, with the job perhaps unread in its socket; no
        sign yet that the job has left the redelivery queue at all). Then no supervisor has seen
        it again, no worker of ours holds it as of now, and its AckWait is far from over. While
        the proof is missing it waits, up to that AckWait bound: a job that then comes back
        after AckWait is explained by the death that held it. A NAK matches by stream sequence,
        so a job redelivered to a consumer outside any supervisor would be NAKed too: every
        process bound to the consumer must be a supervisor's worker."""
        if not self.renak:
            return
        if any(n.confirmed_at is None for n in self.renak.values()) and self.nc.is_connected:
            await self.flush()                  # a NAK counts from when the server surely read it
        now, due = time.monotonic(), []
        for seq, n in list(self.renak.items()):
            if not self.ledger.awaiting_redelivery(seq, n.delivery):
                del self.renak[seq]
            elif not liveness.renak_due(now, n.confirmed_at):
                continue
            elif not nak_is_safe(now, n.sent_at, self.ack_wait(n.delivery)):
                del self.renak[seq]
                if n.blocked:
                    log.info("job seq=%d not seen again since its NAK, and not NAKed once more (%s): if it is "
                             "lost in transit it comes back after AckWait", seq, n.blocked,
                             extra={"event": "renak_skipped", "seq": seq, "why": n.blocked})
            else:
                was, n.blocked = n.blocked, unproven(n.confirmed_at or now) or ("" if self.nc.is_connected
                                                                                 else "NATS is away")
                if not n.blocked:
                    due.append(seq)
                elif n.blocked != was:
                    log.info("job seq=%d not seen again since its NAK; not NAKing it once more yet: %s", seq,
                             n.blocked, extra={"event": "renak_waiting", "seq": seq, "why": n.blocked})
        if not due:
            return
        held = fresh_view()                     # nothing awaits from here to the NAKs
        for seq in due:
            n = self.renak.pop(seq)
            if seq in held or not self.ledger.awaiting_redelivery(seq, n.delivery):
                continue
            log.warning("job seq=%d not seen again %.0fs after its NAK: NAKing it once more (is something "
                        "subscribed to '>' or '_INBOX.>'? it keeps dead pull requests alive)", seq,
                        now - n.sent_at, extra={"event": "renak", "seq": seq, "delivery": n.delivery})
            await self.nc.publish(n.reply, b"-NAK")

    async def flush(self) -> None:
        """Fence what we published (NAKs): on success, every NAK sent so far has arrived."""
        try:
            await self.nc.fence(timeout=2)
        except Exception as exc:    # timeout, disconnect: the NAKs stay unconfirmed, re-NAK waits
            log.warning("flushing NAKs to NATS failed: %s", str(exc) or type(exc).__name__)
            return
        now = time.monotonic()
        for n in self.renak.values():
            if n.confirmed_at is None:
                n.confirmed_at = now
