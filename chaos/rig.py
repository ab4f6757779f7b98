"""One chaos run's moving parts: real nats-servers, the real `supervisor start`, a publisher that
records every PubAck, a watcher that sees worker processes come and go, the fault log, and
the end of a run (settle, stop, check).

The runner is synchronous like tests/support/harness.py (whose NatsServer and SupervisorProc it
reuses); what has to be asynchronous (the NATS client that publishes and inspects the stream,
the TCP proxy) lives on one background asyncio loop in a thread. Every wait polls a
condition against a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import pickle
import random
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import nats
import nats.errors
import psutil
from harness import NatsServer, SupervisorProc, base_config, wait_until
from nats.js.errors import NotFoundError
from natscluster import NatsCluster

from supervisor.config import schedules as sched
from supervisor.core.ledger import HOLD_MAX
from supervisor.parent.safety.peers import SUSPECT_GRACE
from workers.runtime.deadletter import DLQ_HEADER

from .checker import SIDE_KEY, Evidence, Report, check
from .facts import Fault, Handout, Life, Rec, Stored, order_key
from .proxy import Proxy

STREAM, CONSUMER, SUBJECT, DLQ_STREAM = "JOBS", "workers", "jobs.chaos", "JOBS_DLQ"
SIDE, SIDE_SUBJECT = "b|", "jobs.b"      # with pools (chaos/randomized.py): pool b's jobs, keyed bN
ACK_WAIT = 30.0             # long: an expiry (AckWait wait) cannot be mistaken for a prompt NAK
STALLED = 10.0              # nothing in flight and nothing moving this long: the run is over
NATS_ERRORS = (nats.errors.Error, asyncio.TimeoutError, OSError)


def named_schedule(subject: str) -> bool:
    """A recurring schedule's own message (it lives in the stream); a delayed job's counts as a job."""
    kind = (sched.parse_subject(STREAM, subject) or ("", ""))[0]
    return kind in sched.NAMED_KINDS


def ledger_settled(sup: SupervisorProc) -> None:
    """Wait a while for every held job of a death to be seen back, and for every redelivery to be
    judged (one is held for a peer's word up to HOLD_MAX past its grace: F13)."""
    with contextlib.suppress(AssertionError):
        wait_until(lambda: (s := sup.try_status()) and not s["crosscheck"]["outstanding"], 10, "ledger settled")
    with contextlib.suppress(AssertionError):
        wait_until(lambda: (s := sup.try_status()) and not s["crosscheck"].get("suspects"), HOLD_MAX + 5,
                   "every redelivery judged")


def handouts(run: Run) -> list[Handout]:
    """The work queue's deliveries the proxy carried, with who each was handed to (checker.py);
    a note says how many, over how many connections, and how many of those the pid was found for."""
    if run.proxy is None:
        return []
    out = [d for d in run.bg.call(run.proxy.handouts()) if d.stream == STREAM]
    clients = run.bg.call(run.proxy.connections())
    unknown = [f"#{c.conn} {c.name!r}" for c in clients if not c.pid]
    run.notes.append(f"proxy: {len(out)} deliveries of {STREAM} carried over {len(clients)} connections; "
                     f"pid not found for {len(unknown)}{': ' + ', '.join(unknown[:6]) if unknown else ''}")
    return out


def kept(ev: Evidence, name: str) -> Evidence:
    """With CHAOS_KEEP_EVIDENCE=DIR, the run's evidence pickled to DIR/NAME.pickle: judge it again
    later (checker.check) as the checker changes."""
    if keep := os.environ.get("CHAOS_KEEP_EVIDENCE"):
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"{name}.pickle").write_bytes(pickle.dumps(ev))
    return ev


def carried_up(run: Run) -> dict:
    """What the proxy carried from the clients to the server (the work queue's settles and pull
    requests) and every connection's close, as Evidence's keyword arguments (checker.py)."""
    if run.proxy is None:
        return {}
    settles = [s for s in run.bg.call(run.proxy.settles()) if s.stream == STREAM]
    pulls = [p for p in run.bg.call(run.proxy.pulls()) if p.stream == STREAM]
    links = run.bg.call(run.proxy.links())
    kinds = Counter(s.kind for s in settles)
    run.notes.append(f"proxy: carried to the server {', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}, "
                     f"{len(pulls)} pull requests; closes: "
                     f"{', '.join(f'{n} by {h}' for h, n in sorted(Counter(k.how for k in links if k.closed).items()))}")
    return {"settles": settles, "pulls": pulls, "links": links}


def named_before_kill(run: Run, sup: SupervisorProc) -> None:
    """What a supervisor about to be SIGKILLed names as left to AckWait by the kill (its /status
    now): jobs its ledger left to AckWait, NAKs it holds back or has not confirmed (they die with
    it), and dead workers whose in-transit check has not run (what was on their wire waits for
    AckWait now, and no one else can name it: `died` on the rig's clock, the supervisor's host's)."""
    status = sup.try_status()
    read_at = time.monotonic()
    cc = status["crosscheck"] if status else {}
    run.left_to_ack_wait += cc.get("left_to_ack_wait", []) + [
        {**o, "waits": f"{o['waits']} when the supervisor was SIGKILLed"} for o in cc.get("naks_in_doubt", [])]
    run.in_transit_unchecked += [{**u, "died": read_at - u["age_s"]} for u in cc.get("in_transit_unchecked", [])]
    for u in cc.get("in_transit_unchecked", []):
        run.notes.append(f"{run.at(read_at)}: before its SIGKILL the supervisor named the in-transit check of "
                          f"worker pid {u['pid']} (died {run.at(read_at - u['age_s'])}) as not run: seq "
                          f"{u['after_seq']}<..<={u['up_to_seq']}, {u['credits']} credit(s), waiting for: {u['why']}")


def copies_for_later(journal: list[Rec], published: dict[int, Stored]) -> dict[int, Stored]:
    """[retry]'s copies for later (retry.republish_after: a long delay re-publishes the job as a
    new message, its key kept): a sequence the publisher did not store that runs a key an
    earlier sequence of which ended a run asking for a retry (a delayed job's firing is the
    first sequence of its key to run: no earlier one asked). Each counts as stored from its
    first start (it exists from its due time; the server fires it then)."""
    asked: dict[str, int] = {}                  # key -> the lowest seq whose run ended asking for a retry
    first: dict[int, Rec] = {}
    for r in sorted(journal, key=lambda r: r.t):
        first.setdefault(r.seq, r)
        if r.event == "R" and r.key != "tick":
            asked[r.key] = min(asked.get(r.key, r.seq), r.seq)
    return {seq: Stored(seq, r.key, r.t) for seq, r in first.items()
            if seq not in published and r.key in asked and asked[r.key] < seq}


class Background:
    """An asyncio loop in a thread, for the runner's NATS client, publisher and proxy."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="chaos-bg", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class ChaosNats(NatsServer):
    """tests/support/harness.py's nats-server, plus the faults: SIGKILL, SIGSTOP/SIGCONT, restart on
    the same ports and store."""

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


class JournalTail:
    """The journal read incrementally: whole lines only, so a poll never sees half a line."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.rest = b""
        self.recs: list[Rec] = []
        self.done: set[int] = set()
        self.open: dict[tuple[int, int, int], Rec] = {}     # (pid, seq, delivery) started, not done
        self.lock = threading.Lock()         # faults play in threads (chaos/randomized.py)

    def poll(self) -> list[Rec]:
        with self.lock:
            return self._poll()

    def started_not_done(self) -> list[Rec]:
        with self.lock:
            self._poll()
            return list(self.open.values())

    def _poll(self) -> list[Rec]:
        if not self.path.exists():
            return self.recs
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        for line in lines:
            event, pid, seq, delivery, t, wall, key = line.decode().split(" ", 6)
            rec = Rec(event, int(pid), int(seq), int(delivery), float(t), float(wall), key)
            self.recs.append(rec)
            if event == "S":
                self.open[(rec.pid, rec.seq, rec.delivery)] = rec
            else:
                self.open.pop((rec.pid, rec.seq, rec.delivery), None)
                if event == "D":
                    self.done.add(rec.seq)
        return self.recs


class Watcher(threading.Thread):
    """Polls the supervisors' children: when each worker pid appeared and when it was reaped, which
    supervisor forked it (its parent's pid: an orphan keeps the one it had), and whose consumer it
    works for (its process title: `supervisor: worker 0 [JOBS/workers-a]`)."""

    def __init__(self, sups: list[SupervisorProc]):
        super().__init__(name="chaos-watcher", daemon=True)
        self.sups = sups
        self.lives: dict[int, Life] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.005):
            now = time.monotonic()
            seen: dict[int, int] = {}
            for sup in list(self.sups):
                if sup.proc is not None and sup.proc.poll() is None:
                    seen.update(dict.fromkeys(sup.worker_pids(), sup.proc.pid))
            for pid, parent in seen.items():
                life = self.lives.setdefault(pid, Life(pid, now, parent=parent))
                if not life.consumer:
                    life.consumer = consumer_of(pid)
            for life in self.lives.values():
                if life.died is None and life.pid not in seen:
                    life.died = now

    def alive(self, pid: int) -> bool:
        life = self.lives.get(pid)
        return life is not None and life.died is None


def consumer_of(pid: int) -> str:
    """The consumer in a worker's process title; "" until it has set one (just forked)."""
    try:
        title = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""
    m = re.match(r"supervisor: worker \S+ \[[^/\]]+/([^\]]+)\]", title)
    return m.group(1) if m else ""


class Publisher:
    """Publishes `KEY:WHAT` jobs at a steady rate, each with a Nats-Msg-Id so a retry after a
    lost PubAck (server down, partition) stores it once; records every PubAck's sequence."""

    def __init__(self, run: Run):
        self.run = run
        self.stored: dict[int, Stored] = {}
        self.delayed: dict[str, Stored] = {}          # key -> its schedule's seq, when it is due
        self.schedules_from = self.schedules_until = 0.0   # while [schedules.tick] could fire (monotonic)
        self.next = 0
        self.failures = 0
        self.futures: list[Any] = []
        self.finished_at = 0.0
        self.subject_of: Callable[[int], str] = lambda i: SUBJECT   # job i's subject ([ordering]: its key's)

    def start(self, count: int, rate: float, what: Callable[[int], str] | str, window: int = 1) -> Any:
        make = what if callable(what) else (lambda i: what)
        first, self.next = self.next, self.next + count
        fut = self.run.bg.spawn(self.pump(range(first, first + count), rate, make, window))
        self.futures.append(fut)
        return fut

    async def pump(self, indices: range, rate: float, make: Callable[[int], str], window: int) -> None:
        """At `rate` jobs/s, with up to `window` PubAcks awaited at once (1: one after the other)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        slots = asyncio.Semaphore(window)
        tasks = []

        async def one(i: int) -> None:
            try:
                await self.publish(i, make(i))
            finally:
                slots.release()
        for n, i in enumerate(indices):
            delay = start + n / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.gather(*tasks)
        self.finished_at = time.monotonic()

    async def publish(self, i: int, what: str) -> None:
        # `jN=ACTIONS`: publish job N's key again (its Nats-Msg-Id too), as a publisher retrying
        # after the stream's duplicate window does; the idempotency guard must skip it.
        delay = 0.0
        if what.startswith("~"):          # `~SECONDS~ACTIONS`: published as a delayed job (a message schedule)
            _, seconds, what = what.split("~", 2)
            delay = float(seconds)
        side = what.startswith(SIDE)      # `b|ACTIONS`: a job of the second pool, on its own subject
        what = what[len(SIDE):] if side else what
        key, again, rest = what.partition("=")
        key, what = (key, rest) if again else (f"{SIDE_KEY if side else 'j'}{i}", what)
        js = self.run.nc.jetstream()
        target = SIDE_SUBJECT if side else self.subject_of(i)
        while True:
            sent = time.monotonic()       # the job exists from here on at the earliest: a PubAck read
            subject, headers = target, {"Nats-Msg-Id": f"chaos-{key}"}
            if delay:
                due = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=delay)
                subject = sched.delayed_subject(STREAM, f"chaos-{key}")
                headers.update({sched.PATTERN: sched.at_pattern(due), sched.TARGET: target})
            try:                          # late on a busy box must not make a drain look later than it
                ack = await js.publish(subject, f"{key}:{what}".encode(), timeout=2.0, headers=headers)
            except NATS_ERRORS:
                self.failures += 1        # server down or unreachable: the same id again shortly
                await asyncio.sleep(0.25)
                continue
            if delay:
                self.delayed[key] = Stored(ack.seq, key, sent + delay, order_key(target))
            else:
                self.stored[ack.seq] = Stored(ack.seq, key, sent, order_key(target))
            return

    async def end_schedules(self) -> None:
        """The load is over: a recurring schedule stops here, or it would store jobs after the
        supervisors stop (not lost: never meant to run). A start may add it back: faults are over."""
        with contextlib.suppress(*NATS_ERRORS):
            await self.run.nc.jetstream().purge_stream(STREAM, subject=f"{sched.space(STREAM)}.config.>")
        self.schedules_until = time.monotonic()

    def ticks_beyond(self, ticks: int) -> int:
        """Firings of [schedules.tick] beyond one per period while it could exist: from the first
        supervisor's start (none could make it before) to its removal (none fires after)."""
        every = self.tick().get("every")
        if not every or not self.schedules_from or not self.schedules_until:
            return 0
        return max(0, ticks - int((self.schedules_until - self.schedules_from) / every + 1))

    def tick(self) -> dict:
        """[schedules.tick] as the first supervisor was given it ({} without one)."""
        return self.run.sups[0].config.get("schedules", {}).get("tick", {}) if self.run and self.run.sups else {}

    def fired(self, journal: list[Rec], notes: list[str], origin: float) -> dict[int, Stored]:
        """The jobs the server stored for schedules, by their seq in the journal: each delayed job
        (stored when due; one never seen run is its schedule's seq, so the checker finds it lost or
        still in the stream) and each tick of [schedules.tick] (stored by its first start). A
        sequence the publisher stored itself is no firing: a delayed job's key published again
        (`jN=`, on its own subject and so its own [ordering] key: seed 940) keeps its own record.
        A tick on `jobs.chaos.tick` (pools with keys) is of [ordering] key `tick`: seed 1050, the
        ticks parked behind one held in a stalled link were taken for unordered jobs kept 26 s."""
        seen: dict[str, set[int]] = {}
        first: dict[int, float] = {}
        for r in journal:
            if r.seq not in self.stored:
                seen.setdefault(r.key, set()).add(r.seq)
            first[r.seq] = min(first.get(r.seq, r.t), r.t)
        out = {}
        for key, s in self.delayed.items():
            for seq in seen.get(key, {s.seq}):
                out[seq] = Stored(seq, key, s.t, s.order)
        ticks = sorted(first[seq] for seq in seen.get("tick", ()))
        tick_key = order_key(self.tick().get("subject", ""))
        for seq in seen.get("tick", ()):
            out[seq] = Stored(seq, "tick", first[seq], tick_key)
        if ticks:
            notes.append(f"[schedules.tick]: {len(ticks)} firings, first started +{ticks[0] - origin:.1f}s, "
                         f"last +{ticks[-1] - origin:.1f}s; beyond one per period: {self.ticks_beyond(len(ticks))}")
        return out

    def wait(self, timeout: float) -> None:
        for fut in self.futures:
            fut.result(timeout)


class Run:
    def __init__(self, name: str, workdir: Path, quick: bool, ack_wait: float = ACK_WAIT):
        self.name = name
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.quick = quick
        self.ack_wait = ack_wait
        self.origin = time.monotonic()
        self.rng = random.Random()                   # the scenario's choices; seeded by run_scenario
        self.bg = Background()
        self.journal = self.dir / "journal.log"
        self.tail = JournalTail(self.journal)
        self.faults: list[Fault] = []
        self.servers: list[Any] = []
        self.sups: list[SupervisorProc] = []
        self.watcher = Watcher(self.sups)
        self.watcher.start()
        self.publisher = Publisher(self)
        self.pools: dict[str, str] = {}      # with pools: "main" and "side" -> their consumers (chaos/randomized.py)
        self.proxy: Proxy | None = None
        self.nc: Any = None
        self.healthz: list[float] = []
        self.exit_codes: list[int] = []             # of every supervisor we stopped (-9: had to kill it)
        self.stopped: set[int] = set()               # supervisors stopped on purpose (by index)
        self.drains: list[tuple[float, float]] = []  # each stop: from its SIGTERM to its exit
        self.sup_died = 0
        self.undo: list[Callable[[], None]] = []            # cleanups beyond processes, run last-first
        self.after_settle: list[Callable[[], None]] = []    # faults only known after the fact
        self.status: dict | None = None
        self.notes: list[str] = []                   # what the run saw that the verdicts do not say
        self.left_to_ack_wait: list[dict] = []       # what SIGKILLed supervisors' ledgers had named (checker.py)
        self.in_transit_unchecked: list[dict] = []   # their deaths whose in-transit check had not run (named_before_kill)

    def pick(self, quick: Any, full: Any) -> Any:
        return quick if self.quick else full

    def at(self, t: float | None = None) -> str:
        return f"+{(t or time.monotonic()) - self.origin:.2f}s"

    # ------------------------------------------------------------ servers and clients

    def start_server(self, store: Path | None = None) -> ChaosNats:
        server = ChaosNats(store or self.dir / f"store{len(self.servers)}")
        self.servers.append(server)
        return server.start()

    def start_cluster(self) -> NatsCluster:
        cluster = NatsCluster(self.dir / "cluster")
        self.servers.extend(cluster.nodes)
        return cluster.start()

    def connect(self, urls: list[str]) -> None:
        """The runner's own NATS client (publishing, stream and consumer state); reconnects forever."""
        async def quiet(*_: Any) -> None:
            return None
        self.nc = self.bg.call(nats.connect(urls, max_reconnect_attempts=-1, reconnect_time_wait=0.25,
                                            error_cb=quiet, disconnected_cb=quiet, reconnected_cb=quiet,
                                            connect_timeout=2))

    def start_proxy(self, server: ChaosNats) -> Proxy:
        self.proxy = self.bg.call(Proxy(server).start())
        return self.proxy

    def start_supervisor(self, servers: list[str], env: dict[str, str] | None = None, ready: bool = True,
                         **sections: dict) -> SupervisorProc:
        sub = self.dir / f"sup{len(self.sups)}"
        sub.mkdir()
        defaults = {"nats": {"servers": servers, "startup_timeout": 30.0},   # > a drawn link fault (seed 607)
                    "workers": {"count": 4, "handler": "chaos.handlers:journal", "graceful_timeout": 10.0},
                    "consumer": {"ack_wait": self.ack_wait},
                    "restart": {"poison_after_crashes": 100}}
        cfg = base_config(None, sub)
        for section, values in [*defaults.items(), *sections.items()]:
            cfg.setdefault(section, {}).update(values)
        sup = SupervisorProc(sub, cfg, env={"CHAOS_JOURNAL": str(self.journal), **(env or {})})
        self.publisher.schedules_from = self.publisher.schedules_from or time.monotonic()
        self.sups.append(sup)
        sup.start()
        if ready:
            self.wait_ready(sup)
        return sup

    def wait_ready(self, sup: SupervisorProc | None = None, timeout: float = 90.0) -> None:
        """Every configured worker ready; fails at once if the supervisor has exited."""
        sup = sup or self.sup
        n = sup.config["workers"]["count"]

        def ready() -> bool:
            if sup.proc.poll() is not None:
                raise AssertionError(f"the supervisor exited ({sup.proc.returncode}) instead of getting {n} workers ready")
            s = sup.try_status()
            return bool(s) and s["workers"]["alive"] == n and sum(w["state"] == "ready" for w in s["workers"]["list"]) == n
        wait_until(ready, timeout, f"{n} ready workers")

    @property
    def sup(self) -> SupervisorProc:
        return self.sups[-1]

    # ------------------------------------------------------------ load and observation

    def load(self, count: int, rate: float, what: Callable[[int], str] | str = "0.05", window: int = 1) -> Any:
        return self.publisher.start(count, rate, what, window)

    def running(self, sup: SupervisorProc | None = None) -> list[Rec]:
        """Journal runs started and not finished by a live worker of `sup` (default: the current)."""
        pids = (sup or self.sup).worker_pids()
        return [r for r in self.tail.started_not_done() if r.pid in pids]

    def wait_running(self, what: str = "a job in flight", timeout: float = 60.0) -> list[Rec]:
        return wait_until(self.running, timeout, what, interval=0.005)

    def done_count(self) -> int:
        self.tail.poll()
        return len(self.tail.done)

    async def queue_state(self) -> tuple[int, int, int] | None:
        """(messages in the stream, pending, ack pending), or None while the server does not answer."""
        js = self.nc.jetstream()
        try:
            si = await js.stream_info(STREAM, subjects_filter=">")
            cis = [await js.consumer_info(STREAM, name, timeout=2) for name in (self.pools.values() or [CONSUMER])]
        except NATS_ERRORS:
            return None
        waiting = sum(n for subj, n in (si.state.subjects or {}).items() if not named_schedule(subj))
        return waiting, sum(ci.num_pending or 0 for ci in cis), sum(ci.num_ack_pending or 0 for ci in cis)

    # ------------------------------------------------------------ faults

    def fault(self, kind: str, t0: float, t1: float | None = None, pids: set[int] | None = None, **more: Any) -> Fault:
        """Log a fault (`more`: Fault's in_control, note, unstarted_in_control, parent)."""
        f = Fault(kind, t0, t0 if t1 is None else t1, None if pids is None else frozenset(pids), **more)
        self.faults.append(f)
        return f

    def signal_worker(self, pid: int, sig: int, kind: str, note: str = "", death_within: float = 60.0) -> Fault:
        """Signal a worker and wait until its supervisor reaped it; the fault spans both moments."""
        f = self.fault(kind, time.monotonic(), pids={pid}, note=note)
        os.kill(pid, sig)
        wait_until(lambda: not self.watcher.alive(pid), death_within, f"worker {pid} reaped after {kind}")
        f.t1 = self.watcher.lives[pid].died or time.monotonic()
        return f

    def measure_healthz(self, since: float, timeout: float = 60.0) -> float:
        """Seconds from `since` (a recovery) until /healthz answers 200."""
        def ok() -> bool:
            try:
                with urllib.request.urlopen(f"http://{self.sup.http}/healthz", timeout=2) as r:
                    return r.status == 200
            except (OSError, urllib.error.HTTPError):
                return False
        wait_until(ok, timeout, "/healthz 200 after recovery", interval=0.05)
        took = time.monotonic() - since
        self.healthz.append(took)
        return took

    def stop_supervisor(self, sup: SupervisorProc, timeout: float = 90.0) -> int | None:
        """SIGTERM and wait for the exit; a supervisor that had already died is counted."""
        self.stopped.add(self.sups.index(sup))
        t0 = time.monotonic()
        if sup.proc.poll() is not None:
            self.sup_died += 1
            self.exit_codes.append(sup.proc.returncode)
            self.drains.append((t0, t0))
            return sup.proc.returncode
        sup.signal(signal.SIGTERM)
        try:
            code = sup.proc.wait(timeout)
        except subprocess.TimeoutExpired:        # still running: killed, counted as a bad exit
            code = None
            sup.cleanup()
        self.drains.append((t0, time.monotonic()))
        self.exit_codes.append(code if code is not None else -9)
        return code

    # ------------------------------------------------------------ the end of a run

    def settle(self) -> None:
        """Wait until every stored job is done and acked, or until long enough after the last fault
        that any job waiting for AckWait has come back (so it counts as a wait, not as lost).
        Stop early when nothing can change any more: no supervisor left, or nothing ack pending
        (so no AckWait timer runs) and nothing moved for STALLED seconds."""
        self.publisher.wait(timeout=600)
        self.bg.call(self.publisher.end_schedules())
        last = max([self.publisher.finished_at, *(f.t1 for f in self.faults)])
        deadline = last + 1.5 * self.ack_wait + 10.0
        seen, moved = None, time.monotonic()
        while time.monotonic() < deadline:
            self.tail.poll()
            state = self.bg.call(self.queue_state())
            if state == (0, 0, 0):           # a work queue with nothing stored: everything is acked
                return
            if not any(s.proc.poll() is None for s in self.sups):
                return                               # nobody left to run the rest
            now = (len(self.tail.recs), state)
            if now != seen:
                seen, moved = now, time.monotonic()
            elif state is not None and state[2] == 0 and time.monotonic() - moved > STALLED:
                self.notes.append(f"stalled: {state[0]} message(s) in the stream, {state[1]} pending, none in flight, "
                                  f"nothing done for {STALLED:g}s")
                return
            time.sleep(0.1)

    def finish(self) -> Report:
        self.settle()
        for hook in self.after_settle:
            hook()
        statuses = [self.ledger_status(s) for s in self.sups if s.proc.poll() is None]
        self.status = statuses[-1] if statuses else None
        for i, s in enumerate(self.sups):
            if i not in self.stopped:
                self.stop_supervisor(s)
        unacked, dead = self.bg.call(self.unacked()), self.bg.call(self.dead_letters())
        stored = {**self.publisher.stored, **self.publisher.fired(self.tail.poll(), self.notes, self.origin)}
        ticks = self.publisher.ticks_beyond(sum(s.key == "tick" for s in stored.values()))
        stored.update(copies := copies_for_later(self.tail.poll(), self.publisher.stored))  # no firing of a delayed job
        ev = Evidence(ticks_extra=ticks, stored=stored, journal=self.tail.poll(), faults=self.faults, ack_wait=self.ack_wait,
                      origin=self.origin, lives=dict(self.watcher.lives), unacked=unacked, dead_lettered=dead,
                      status=self.status, statuses=[s for s in statuses if s], copies=set(copies), drains=self.drains,
                      sup_died=self.sup_died, bad_exits=sum(c != 0 for c in self.exit_codes), handouts=handouts(self),
                      healthz_s=max(self.healthz) if self.healthz else None, pools=dict(self.pools), **carried_up(self),
                      left_to_ack_wait=self.left_to_ack_wait, in_transit_unchecked=self.in_transit_unchecked)
        return check(kept(ev, self.name))

    def ledger_status(self, sup: SupervisorProc) -> dict | None:
        """/status once the supervisor has had its grace to explain the last redelivery."""
        recs = self.tail.poll()
        last = max((r.t for r in recs if r.event == "S" and r.delivery > 1), default=0.0)
        ready_at = last + SUSPECT_GRACE + 2 * 0.25 + 0.5         # the grace, then two monitor polls
        wait_until(lambda: time.monotonic() >= ready_at, SUSPECT_GRACE + 5, "the ledger's grace")
        ledger_settled(sup)
        return sup.try_status()

    async def unacked(self) -> list[int]:
        """Stored jobs still in the work-queue stream (never acked); adds any the publisher never
        got a PubAck for but the stream holds."""
        js = self.nc.jetstream()
        try:
            info = await js.stream_info(STREAM)
        except NATS_ERRORS:
            return sorted(self.publisher.stored)     # cannot tell: everything is in doubt
        if not info.state.messages:
            return []
        with contextlib.suppress(*NATS_ERRORS):
            ci = await js.consumer_info(STREAM, CONSUMER, timeout=2)
            self.notes.append(f"at the end: {info.state.messages} message(s) in the stream; consumer pending "
                              f"{ci.num_pending}, ack pending {ci.num_ack_pending}, redelivered {ci.num_redelivered}, "
                              f"ack floor stream seq {ci.ack_floor.stream_seq}")
        left = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                msg = await js.get_msg(STREAM, seq)
            except NotFoundError:
                continue
            if named_schedule(msg.subject):
                continue                  # [schedules.tick] stays in the stream by design
            left.append(seq)
            key = (msg.data or b"").decode(errors="replace").partition(":")[0]
            self.publisher.stored.setdefault(seq, Stored(seq, key, self.origin, order_key(msg.subject or "")))
        return left

    async def dead_letters(self) -> list[int]:
        """Stream sequences of the jobs copied to the dead-letter stream (workers/runtime/worker.py headers)."""
        js = self.nc.jetstream()
        try:
            info = await js.stream_info(DLQ_STREAM)
        except NATS_ERRORS:
            return []                                # no dead-letter stream: nothing was dead-lettered
        seqs = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1 if info.state.messages else 0):
            with contextlib.suppress(NotFoundError):
                msg = await js.get_msg(DLQ_STREAM, seq)
                seqs.append(int((msg.headers or {}).get(DLQ_HEADER + "Sequence", 0)))
        return seqs

    def close(self) -> None:
        self.watcher.stopped.set()
        for sup in self.sups:
            sup.cleanup()
        if self.proxy is not None:
            with contextlib.suppress(Exception):
                self.bg.call(self.proxy.close(), timeout=10)
        if self.nc is not None:
            with contextlib.suppress(Exception):
                self.bg.call(self.nc.close(), timeout=10)
        for server in self.servers:
            server.stop()
        for undo in reversed(self.undo):
            undo()
        self.bg.close()
        self.watcher.join(5)

    def keep_logs(self, dest: Path) -> None:
        """Copy the journal and every supervisor log to `dest` (for a failed run)."""
        dest.mkdir(parents=True, exist_ok=True)
        if self.journal.exists():
            shutil.copy(self.journal, dest / "journal.log")
        for i, sup in enumerate(self.sups):
            if sup.log_path.exists():
                shutil.copy(sup.log_path, dest / f"supervisor{i}.log")
