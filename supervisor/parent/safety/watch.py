"""Watching the living: the stuck are killed, the healthy keep their jobs alive with +WPI.

Every tick the arbiter's loop hands over its living workers; their slot tables say when each last
beat, last heard from NATS, and what it holds since when. The rules are pure (liveness.py); this
room reads the tables, signals and publishes. A worker whose NATS link went quiet gets no more
+WPI (its acks could not arrive anyway): the alert and the ledger say its jobs come back after
AckWait, before they do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from supervisor.config import Config
from supervisor.core import liveness
from supervisor.core.ledger import CrashLedger
from supervisor.core.liveness import Limits
from supervisor.parent.process import WorkerProcess
from supervisor.parent.safety.deaths import Deaths
from supervisor.parent.stats import Stats
from workers.protocol import slots
from workers.protocol.exits import Kill

log = logging.getLogger("supervisor")

PING_FENCE_TIMEOUT = 1.0    # seconds a flush may take to prove a ping round reached the server


class Watch:
    def __init__(self, cfg: Config, nc: Any, ledger: CrashLedger, deaths: Deaths, stats: Stats,
                 alert: Callable[[str, str], None]):
        self.cfg, self.nc, self.ledger, self.deaths, self.stats, self.alert = cfg, nc, ledger, deaths, stats, alert
        self.stale_links: set[int] = set()                  # pids whose NATS connection looks dead
        self.pings_waiting = False                          # +WPI due while the parent is disconnected (said once)
        # +WPI rounds sent and not yet proved read by the server (a flush), by worker: their
        # NAKs with a delay wait for that proof (slots.PINGS_BEGUN).
        self.unfenced: dict[int, tuple[WorkerProcess, int]] = {}
        self.fencing: asyncio.Task | None = None

    def forget(self, pid: int) -> None:
        self.stale_links.discard(pid)

    async def inspect(self, living: list[WorkerProcess]) -> None:
        """Kill the stuck (no heartbeat, a job past job_timeout, a drain past its deadline) and
        send +WPI for the held jobs of the healthy before their AckWait runs out."""
        now, lim = time.monotonic(), Limits.of(self.cfg)
        pings: list[tuple[WorkerProcess, slots.Entry]] = []
        held: set[tuple[int, int]] = set()
        for w in living:
            entries = w.table.snapshot()
            held.update((w.pid, e.stream_seq) for e in entries)   # a dying worker's pings still date its jobs
            if w.status is not None or w.kill:
                continue
            kill = liveness.why_kill(now, lim, w.table.heartbeat(), w.started_at, entries, w.drain_deadline)
            if kill:
                self.kill(w, kill)
                continue
            pings += self.due_pings(w, entries, now)
        self.deaths.keep_pings(held)
        await self.send_pings(pings, now, living)
        self.fence_pings()

    async def send_pings(self, pings: list[tuple[WorkerProcess, slots.Entry]], now: float,
                         living: list[WorkerProcess]) -> None:
        """+WPI only while the parent is connected (R9): nats-py would buffer it during a reconnect
        (and refuse it, raising, once its buffer is full), and a buffered +WPI reaches the server
        only after the reconnect while its timer would count from now. Unsent, the job's timer keeps
        counting from the last +WPI that went out, so the next tick connected sends it at once."""
        if not pings:
            return
        if not self.nc.is_connected:
            if not self.pings_waiting:
                log.warning("NATS is away: no +WPI for %d long job(s) until it is back (their AckWait runs on)",
                            len(pings), extra={"event": "pings_waiting", "count": len(pings)})
            self.pings_waiting = True
            return
        self.pings_waiting = False
        # The round begins in every living worker's table, not only those pinged: a +WPI acts on
        # its job's current delivery, so one decided for worker A's delivery must not land after
        # worker B's NAK with a delay of the next (A NAKed it, B was handed it).
        rounds: dict[int, tuple[int, bool]] = {}
        for w in living:
            if w.pidfd >= 0:
                rounds[w.pid] = w.table.pings_begin()
                self.unfenced[w.pid] = (w, rounds[w.pid][0])
        sent = 0
        for w, e in pings:
            # A NAK of this worker on its way (this +WPI could land after it), settled since the
            # snapshot, or reaped (its table closed)? A +WPI landing after a NAK with a delay
            # would stretch the delay to a whole AckWait.
            if rounds.get(w.pid, (0, True))[1] or w.pidfd < 0 or w.table.state_of(e.index) not in liveness.UNSETTLED \
                    or w.table.held_at(e.index) != e.t_held:
                continue
            try:
                await self.nc.publish(e.reply, b"+WPI")
            except Exception as exc:     # the connection went in the meantime: the rest wait for the next tick
                log.warning("+WPI not sent: %s", str(exc) or type(exc).__name__)
                break
            self.deaths.pinged_now(w.pid, e.stream_seq, now)
            sent += 1
        self.stats.totals.pings += sent

    def fence_pings(self) -> None:
        """Prove, with a fence, that the server read the +WPI rounds sent so far, and tell each
        worker's table: its NAKs with a delay wait for that. One flush at a time, off the loop's
        path (a stalled link must not hold up reaping); a failed one is tried again next tick."""
        if self.unfenced and self.nc.is_connected and (self.fencing is None or self.fencing.done()):
            owed, self.unfenced = self.unfenced, {}
            self.fencing = asyncio.get_running_loop().create_task(self.fence(owed))

    async def fence(self, owed: dict[int, tuple[WorkerProcess, int]]) -> None:
        try:
            await self.nc.fence(timeout=PING_FENCE_TIMEOUT)   # flush() alone could overtake queued +WPIs
        except Exception:
            for pid, (w, round_) in owed.items():       # a newer round owed meanwhile covers this one
                self.unfenced.setdefault(pid, (w, round_))
            return
        for w, round_ in owed.values():
            if w.pidfd >= 0:
                w.table.set_pings_fenced(round_)

    def kill(self, w: WorkerProcess, kill: Kill) -> None:
        log.warning("killing worker %d (pid %d): %s", w.slot, w.pid, kill.text,
                    extra={"event": "worker_killed", "slot": w.slot, "worker_pid": w.pid, "reason": kill.text,
                           "cause": str(kill.cause)})
        w.kill = dataclasses.replace(kill, text=f"killed: {kill.text}")
        w.send(signal.SIGKILL)

    def due_pings(self, w: WorkerProcess, entries: list[slots.Entry], now: float) -> list:
        """+WPI for jobs a live, beating worker still holds, before their AckWait runs out.
        A worker that has stopped beating, or whose NATS connection has gone quiet, gets none:
        its jobs must be free to come back (its ack could not reach the server anyway)."""
        if not self.cfg.workers.progress_pings or not liveness.beat_fresh(now, w.table.heartbeat()):
            return []
        held = [e for e in entries if e.state in liveness.UNSETTLED and e.reply]
        if not self.link_fresh(w, held, now):
            return []
        # Due by the timer the server stores, not only the one it runs: a job that waited in the
        # stream longer than a third of AckWait gets its +WPI a second after it was held (F14).
        wall = time.time()
        return [(w, e) for e in liveness.pings_due(
            now, held, lambda e: self.deaths.stored_timer_started(w.pid, e, now, wall), self.deaths.ack_wait)]

    def link_fresh(self, w: WorkerProcess, held: list[slots.Entry], now: float) -> bool:
        """Did the worker hear from NATS lately? Say so once when it stops, and explain in advance
        the redeliveries of what it holds: the server will hand them to someone else."""
        seen = w.table.server_seen()
        quiet = now - seen
        if liveness.link_fresh(now, seen):
            if w.pid in self.stale_links:
                self.stale_links.discard(w.pid)
                log.info("worker %d (pid %d): NATS answers again", w.slot, w.pid)
            return True
        if w.pid not in self.stale_links and w.ready_at is not None:
            self.stale_links.add(w.pid)
            why = f"held by worker {w.slot} (pid {w.pid}) whose NATS connection went quiet"
            for e in held:
                self.ledger.expect(e.stream_seq, why, e.delivery)
            self.alert("stale_connection", f"worker {w.slot} (pid {w.pid}) has had no answer from NATS for "
                                           f"{quiet:.0f}s; its {len(held)} job(s) are left to AckWait")
            log.warning("worker %d (pid %d): no answer from NATS for %.0fs; no more +WPI for its %d job(s)",
                        w.slot, w.pid, quiet, len(held))
        return False
