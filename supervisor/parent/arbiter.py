"""The parent: one thread, one asyncio loop, forking and watching the workers of every pool.

The loop reads like gunicorn's arbiter:

    restore the worker count -> sleep until woken -> apply what was queued (signals, worker
    events, a reloaded config, monitor readings) -> reap the dead (NAK what they held, write the
    ledger) -> send NAKs a disconnection held back -> inspect the living (heartbeats, job
    timeouts, in-progress pings, drain deadlines) -> recycle -> halt on a boot crash loop ->
    audit (peers, re-NAK, in-transit reconciliation)

Each step runs for every pool in turn (`each`): a pool ([pools.NAME], or the one `default` pool)
is a Crew (crew.py) holding every room that belongs to one consumer. One writer: signal
handlers, pidfd readers, event-pipe readers, the reload task and the monitors only queue work
(`post`) and set `wakeup`; the loop applies it. The work itself is done in rooms the loop calls
in turn: pool.py (which worker runs in which slot; fork, retire, recycle, restart delays),
deaths.py (the NATS side of a death: NAK, quarantine, held-back NAKs, re-NAK), watch.py (kill the
stuck, +WPI for the healthy), stats.py (counters for /status and /metrics). What to do is decided
by pure pieces with a clock passed in: policy.py, liveness.py, ledger.py, lag.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any

from supervisor.config import Config
from supervisor.core import liveness
from supervisor.core.autoscale import share
from supervisor.core.liveness import DRAIN_MARGIN, Limits
from supervisor.errors import EXIT_HALTED, EXIT_OK
from supervisor.observe.http import STOPPING
from supervisor.parent.crew import Code, Crew
from supervisor.parent.loopsteps import PAUSE, LoopSteps
from supervisor.parent.process import WorkerProcess
from supervisor.parent.systemd import Notifier
from workers.protocol.exits import Kill, KillCause

log = logging.getLogger("supervisor")

SIGNALS = {signal.SIGTERM: "stop", signal.SIGINT: "interrupt", signal.SIGQUIT: "quit", signal.SIGHUP: "reload",
           signal.SIGTTIN: "increment", signal.SIGTTOU: "decrement"}
REAP_RETRY = 0.05           # a pidfd said "exited" but waitpid did not agree yet: look again this soon
EXIT_NAK_WAIT = 10.0        # at exit, wait this long at most for NATS to send NAKs held back for the last deaths
EXIT_POLL = 0.05            # ... looking this often whether it is back


class Arbiter:
    """The loop and its queues. Long because it is the one place every input arrives (signals,
    posted work, the dead) and every stop, scale, halt and reload begins; each handler is a few
    lines that hand the work to a pool's crew (crew.py) and its rooms."""

    def __init__(self, cfg: Config, nc: Any, pools: Mapping[str, tuple[Config, Code]],
                 connect_worker: Callable[[str], Any], notifier: Notifier | None = None,
                 reload_config: Callable[[], Any] | None = None, server_dies_with_parent: bool = False):
        self.cfg = cfg
        self.server_dies_with_parent = server_dies_with_parent   # the embedded server: workers' orphan rule
        self.fleet_key = ""              # our fleet heartbeat's key (set by supervisor.py): an orphan claims there
        self.nc = nc
        self.connect_worker = connect_worker
        self.notifier = notifier
        self.reload_config = reload_config
        self.reloading = self.reload_again = False         # a reload under way; a SIGHUP came meanwhile
        self.alerts: collections.deque = collections.deque(maxlen=50)
        self.steps = LoopSteps(self.alert)
        self.signals: collections.deque[int] = collections.deque()
        self.posted: collections.deque[Callable[[], Any]] = collections.deque()
        self.tasks: set[asyncio.Task] = set()
        self.wakeup = asyncio.Event()
        self.state = "starting"
        self.stopping: str | None = None                  # None | "drain" | "quit"
        self.exit_code = EXIT_OK
        self.halt_message = ""
        self.started = time.monotonic()
        self.ever_all_ready = False
        self.loop = asyncio.get_running_loop()          # made inside it: pidfd readers and signals live there
        self.crews: dict[str, Crew] = {}                # the pools, in the config's order ...
        self.departing: list[Crew] = []                 # ... and those a reload took out, until their last worker exits
        for name, (pool_cfg, code) in pools.items():
            self.adopt(self.crew(name, pool_cfg, code))

    def crew(self, name: str, pool_cfg: Config, code: Code) -> Crew:
        """A pool's crew (not yet run: `adopt` it on the loop). With [pools.*] its name is on its
        log lines, alerts and metrics; without, there is one pool and nothing changes. Asked of
        the config the pool runs in (a reload makes its new pools before the loop takes it)."""
        return Crew(name, pool_cfg, code, self, label=name if pool_cfg.pools else "")

    def adopt(self, crew: Crew) -> None:
        self.crews[crew.name] = crew

    @property
    def lead(self) -> Crew:
        """The first pool: the one the fleet's shared samples and /history follow."""
        return next(iter(self.crews.values()))

    # ================================================================ the loop

    async def run(self) -> int:
        for sig in SIGNALS:
            self.loop.add_signal_handler(sig, self.queue_signal, sig)
        for crew in self.crews.values():
            with crew.context():
                await crew.peers.start()
                log.info("supervising %d worker(s) on %s/%s, handler %s", crew.pool.target, crew.cfg.stream.name,
                         crew.cfg.consumer.name, crew.cfg.workers.handler)
        self.check_all_ready()                 # workers.count = 0 is ready at once
        while not await self.tick():
            pass
        with self.steps.guard("held_back_naks"):
            await self.send_last_naks()
        for sig in SIGNALS:
            self.loop.remove_signal_handler(sig)
        for task in self.tasks:
            task.cancel()
        self.state = "stopping"
        for crew in self.every_crew():
            await crew.peers.goodbye()         # every worker has exited: we hold nothing now
        return self.exit_code

    async def tick(self) -> bool:
        """One pass of the loop, each step isolated (loopsteps.py), for every pool: a step that
        raises is logged, counted and alerted, and the others (and the other pools') still run.
        True once a stop has no worker left."""
        step, each = self.steps.guard, self.each
        if not self.stopping:
            await each("restore_count", lambda c: c.pool.restore_count(time.monotonic()))
        await self.sleep()
        with step("signals"):
            self.dispatch_signals()
        with step("posted"):
            self.apply_posted()
        await each("reap", Crew.reap, guarded=False)           # each part of a reap is guarded in it
        self.drop_departed()
        if self.stopping and not self.living():
            return True
        await each("held_back_naks", lambda c: c.deaths.send_held_back())
        await each("nats_back", lambda c: c.pool.nats_back(time.monotonic()) if self.nc and self.nc.is_connected
                   else None)
        await each("inspect", lambda c: c.watch.inspect(c.living()))
        with step("watchdog"):
            if self.ever_all_ready and self.notifier and self.ready_count() > 0:
                self.notifier.watchdog()     # only while a worker serves: systemd restarts a pool that cannot
        await each("spread", lambda c: c.stats.share_spread())     # pull sizing: the pool's spread of job times
        await each("recycle", lambda c: c.pool.recycle(bool(self.stopping)))
        await each("autoscale", lambda c: c.autoscale.tick(time.monotonic()))
        with step("autoscale"):
            self.share_budget()
        await each("boot_halt", self.check_boot_failures)
        await each("audit", Crew.audit, guarded=False)         # likewise
        return False

    async def each(self, step: str, act: Callable[[Crew], Any], guarded: bool = True) -> None:
        """Run a step for every pool, each run guarded on its own and logged as that pool's."""
        for crew in self.every_crew():
            with crew.context(), (self.steps.guard(step, crew.label) if guarded else contextlib.nullcontext()):
                result = act(crew)
                if inspect.isawaitable(result):
                    await result

    async def send_last_naks(self) -> None:
        """A stop ends when the last worker is reaped, but NAKs held back for workers that died
        while NATS was away must not die with the process (their jobs would wait for AckWait):
        wait for NATS, at most EXIT_NAK_WAIT and only while one of them is still safe to send,
        then send them. Any signal (a second Ctrl-C, SIGQUIT) ends the wait."""
        deaths = [c.deaths for c in self.every_crew()]
        held = sum(len(d.held_back) for d in deaths)
        until = min(time.monotonic() + EXIT_NAK_WAIT, max((d.held_back_useful_until() for d in deaths), default=0.0))
        if held and not self.nc.is_connected and time.monotonic() < until:
            log.warning("stopping: waiting up to %.0fs for NATS to send %d NAK(s) held back for dead workers",
                        until - time.monotonic(), held, extra={"event": "exit_waiting_for_nats", "count": held})
            if self.notifier:
                self.notifier.extend_timeout(EXIT_NAK_WAIT + DRAIN_MARGIN)
            while not self.nc.is_connected and not self.nc.is_closed and not self.signals \
                    and time.monotonic() < until:
                self.wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wakeup.wait(), EXIT_POLL)
        for crew in self.every_crew():
            with crew.context():
                d = crew.deaths
                await d.send_held_back()
                if d.held_back:
                    log.warning("stopping with %d NAK(s) unsent (NATS away): seq %s come back after AckWait",
                                len(d.held_back), ", ".join(str(o.seq) for o in d.held_back),
                                extra={"event": "held_back_dropped", "seqs": [o.seq for o in d.held_back]})

    async def sleep(self) -> None:
        timeout = min(liveness.inspect_every(Limits.of(c.cfg)) for c in self.crews.values()) if self.crews else 0.5
        with self.steps.guard("sleep"):
            timeout = self.sleep_timeout(timeout)
        if self.steps.new_tick():          # a step failed: whatever wants us back at once may be its doing
            timeout = max(timeout, PAUSE)
        try:
            await asyncio.wait_for(self.wakeup.wait(), max(0.0, timeout))
        except TimeoutError:
            pass
        self.wakeup.clear()

    def sleep_timeout(self, timeout: float) -> float:
        now = time.monotonic()
        for crew in self.every_crew():
            due = crew.pool.next_restart()
            if due is not None and not self.stopping:
                timeout = min(timeout, due - now)
            if crew.dead:
                timeout = min(timeout, REAP_RETRY)
            timeout = min(timeout, crew.autoscale.due_in(now))
        return timeout

    def every_crew(self) -> list[Crew]:
        """The pools the config holds, then those draining after a reload took them out."""
        return [*self.crews.values(), *self.departing]

    def living(self) -> list[WorkerProcess]:
        return [w for crew in self.every_crew() for w in crew.living()]

    def ready_count(self) -> int:
        return sum(c.pool.ready_count() for c in self.crews.values())

    def post(self, work: Callable[[], Any], wake: bool = True) -> None:
        """Queue a change of state for the loop to apply (the one-writer rule); `wake`: at once,
        not at its next tick."""
        self.posted.append(work)
        if wake:
            self.wakeup.set()

    def apply_posted(self) -> None:
        while self.posted:
            work = self.posted.popleft()
            with self.steps.guard("posted"):   # one bad closure neither stops the rest nor comes back
                work()

    def spawn_task(self, coro: Any) -> None:
        """A background task the loop keeps a reference to (and cancels at the end)."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # ================================================================ signals

    def queue_signal(self, sig: int) -> None:
        self.signals.append(sig)
        self.wakeup.set()

    def dispatch_signals(self) -> None:
        while self.signals:
            sig = self.signals.popleft()
            log.info("received %s", signal.Signals(sig).name, extra={"event": "signal", "signal": signal.Signals(sig).name})
            with self.steps.guard("signals"):  # the next signal is still handled
                getattr(self, "on_" + SIGNALS[signal.Signals(sig)])()

    def on_stop(self) -> None:
        if not self.stopping:
            self.begin_stop("drain")

    def on_interrupt(self) -> None:
        if self.stopping:                      # a second Ctrl-C: stop now
            self.on_quit()
        else:
            self.begin_stop("drain")

    def on_quit(self) -> None:
        self.begin_stop("quit")

    def on_increment(self) -> None:
        """SIGTTIN: one more worker in every pool (a halted one waits for its SIGHUP)."""
        for crew in self.running():
            self.scale(crew.pool.target + 1, "SIGTTIN", crew.name)

    def on_decrement(self) -> None:
        """SIGTTOU: one fewer in every pool."""
        for crew in self.running():
            self.scale(max(0, crew.pool.target - 1), "SIGTTOU", crew.name)

    def running(self) -> list[Crew]:
        return [c for c in self.crews.values() if not c.halted]     # a pool a reload took out is in departing

    def on_reload(self) -> None:
        if self.reload_config is None or self.stopping:
            log.warning("reload: nothing to re-read" if not self.stopping else "reload ignored while stopping")
            return
        if self.reloading:          # one at a time: each plans against the pools running when it starts,
            self.reload_again = True    # so two at once would both start a pool added to the file
            return
        self.reloading = True
        self.spawn_task(self.reload_once())

    async def reload_once(self) -> None:
        assert self.reload_config is not None, "on_reload starts it only with a config source"
        try:
            await self.reload_config()          # it posts apply_config back to the loop ...
        finally:
            self.post(self.reloaded)            # ... and this after it

    def reloaded(self) -> None:
        """A reload is applied (or failed): a SIGHUP that came meanwhile reloads now."""
        self.reloading = False
        if self.reload_again:
            self.reload_again = False
            self.on_reload()

    def apply_config(self, cfg: Config, change: Any, codes: Mapping[str, Code | None], added: list[Crew]) -> None:
        """Take a reloaded config (config/reload.py pools_plan): each pool that runs on takes its
        own new effective config; a pool gone from the file (or moved to another consumer) drains
        and leaves; a new one starts."""
        self.cfg = cfg
        for name in change.removed:
            crew = self.crews.pop(name)
            with crew.context():
                self.depart(crew)
        for name, plan in change.kept.items():
            crew = self.crews[name]
            with crew.context():
                crew.apply_config(plan.effective, plan, codes.get(name))
        for crew in added:
            log.info("pool %s starts (reload): %d worker(s) on %s/%s, handler %s", crew.name, crew.pool.target,
                     crew.cfg.stream.name, crew.cfg.consumer.name, crew.cfg.workers.handler,
                     extra={"event": "pool_added", "pool": crew.name})
            self.adopt(crew)
        self.wakeup.set()

    def depart(self, crew: Crew) -> None:
        """A reload took the pool out: its workers retire; once the last has exited and what its
        dead left is done (Crew.finished), it is dropped."""
        log.info("pool %s leaves (reload): retiring its %d worker(s)", crew.name, len(crew.living()),
                 extra={"event": "pool_removed", "pool": crew.name})
        crew.empty("its pool left the config")
        self.departing.append(crew)

    def drop_departed(self) -> None:
        for crew in [c for c in self.departing if c.finished()]:
            self.departing.remove(crew)
            for task in crew.tasks:
                task.cancel()
            self.spawn_task(crew.peers.close())

    def begin_stop(self, mode: str) -> None:
        self.stopping = mode
        self.state = "draining" if mode == "drain" else "stopping"
        # Each worker drains under the graceful_timeout it was forked with (a SIGHUP may have changed the key).
        grace = max([w.graceful_timeout for w in self.living()], default=self.cfg.workers.graceful_timeout)
        if self.notifier:
            self.notifier.stopping()
            if mode == "drain":    # ask systemd for the drain's worth of time, whatever TimeoutStopSec says
                self.notifier.extend_timeout(grace + 2 * DRAIN_MARGIN)
        log.info("%s %d worker(s)%s", "draining" if mode == "drain" else "killing", len(self.living()),
                 f" (graceful_timeout {grace:g}s)" if mode == "drain" else "",
                 extra={"event": "stop_begun", "mode": mode, "workers": len(self.living())})
        for crew in self.every_crew():
            for w in crew.living():
                if mode == "quit":
                    w.kill = Kill(KillCause.QUIT, "SIGQUIT: stop at once")
                    w.send(signal.SIGKILL)
                else:              # retiring ones too: a shutdown NAKs what they have not started
                    crew.pool.drain(w, signal.SIGTERM)

    def scale(self, n: int, source: str, pool: str | None = None) -> str | None:
        """Set a pool's worker count (`pool` None: the one pool there is). Any source but the
        autoscaler is a person, whose count autoscaling then leaves alone for a while (scaler.py).
        None when done, else why not."""
        if self.stopping:
            return STOPPING
        crew, refused = self.scalable(pool)
        if crew is None:
            return refused
        with crew.context():
            if source != "autoscale":
                crew.autoscale.manual(n, source, self.over_budget(crew, n))
            log.info("scaling from %d to %d worker(s)", crew.pool.target, n,
                     extra={"event": "scaling", "from": crew.pool.target, "to": n, "source": source,
                            **({"pool": crew.name} if crew.label else {})})
        crew.pool.target = n
        self.wakeup.set()
        return None

    def over_budget(self, crew: Crew, n: int) -> int:
        """By how many workers the pools would be over `[autoscale] budget` with `crew` at `n`
        (0 without a budget): a count set by hand is kept past it, and says so (scaler.py manual)."""
        budget = self.cfg.autoscale.budget if self.cfg.autoscale.enabled else 0
        if not budget:
            return 0
        return n + sum(c.pool.target for c in self.running() if c is not crew) - budget

    def scalable(self, pool: str | None) -> tuple[Crew | None, str]:
        """The pool a scale is for, or why there is none to scale."""
        if pool is None and len(self.crews) > 1:
            return None, f"several pools run here ({', '.join(self.crews)}): name one (pool=NAME, --pool NAME)"
        crew = self.crews.get(pool) if pool is not None else self.lead
        if crew is None:
            return None, f"no pool {pool!r} runs here (pools: {', '.join(self.crews)})"
        if crew.halted:
            return None, f"pool {crew.name} halted ({crew.halted}); fix it and reload (SIGHUP) to start it again"
        return crew, ""

    def share_budget(self) -> None:
        """[autoscale] budget: each pool's share of the workers of all pools together, for its
        autoscaler's next decision (core/autoscale.py share: a worker goes where it does the most
        work). Without a budget there is no share: each pool scales between min and max alone."""
        budget = self.cfg.autoscale.budget if self.cfg.autoscale.enabled else 0
        crews = self.running()
        if not budget:
            for crew in crews:
                crew.autoscale.share(None, "")
            return
        shares = share(budget, [c.autoscale.claim(c.name) for c in crews])
        for crew in crews:              # the cuts now, the growth at each pool's next decision: never over
            with crew.context():
                crew.autoscale.share(*shares[crew.name])

    # ================================================================ readiness and halts

    def check_all_ready(self) -> None:
        """The first time every worker of every pool is ready: state running, READY=1 to systemd."""
        if not self.ever_all_ready and not self.stopping and \
                all(c.pool.ready_count() >= c.pool.target for c in self.crews.values()):
            self.ever_all_ready = True
            self.state = "running"
            if self.notifier:
                self.notifier.ready(self.status_line())

    def check_boot_failures(self, crew: Crew) -> None:
        """Workers of a pool keep dying before they are ready: that pool halts, and the others run
        on (/status, the log and an alert say so). When it was the last pool running, the
        supervisor stops: exit 5."""
        if not crew.boot_halt_due() or self.stopping:
            return
        why = crew.halt_message()
        others = [c for c in self.running() if c is not crew]
        if others:
            text = f"pool {crew.name} halted: {why}; the other pools run on ({', '.join(c.name for c in others)})"
            log.error(text, extra={"event": "pool_halted", "pool": crew.name, "deaths": crew.restarts.boot.count})
            crew.alert("halted", text)
            crew.halt(why)
            return
        message = f"halting: {why}"
        if crew.label:          # [pools.*]: name each, this one last
            halts = [f"pool {c.name}: {c.halted}" for c in self.crews.values() if c.halted]
            message = "halting: every pool has halted: " + "; ".join([*halts, f"pool {crew.name}: {why}"])
        log.error(message, extra={"event": "halting", "deaths": crew.restarts.boot.count})
        crew.halted = why
        self.halt_message = message
        crew.alert("halted", message)
        self.exit_code = EXIT_HALTED
        self.begin_stop("drain")

    # ================================================================ helpers

    def alert(self, kind: str, message: str, pool: str = "") -> None:
        self.alerts.append({"kind": kind, "message": message, "t": time.time(), "pool": pool})

    def status_line(self) -> str:
        return f"{self.ready_count()}/{sum(c.pool.target for c in self.crews.values())} workers ready"
