"""`supervisor start`: embedded server (if needed) -> connect -> provision -> supervise -> stop.

Everything that can fail on bad input fails here, before a single worker is forked: the config
(exit 2), the handler, init and middleware imports (exit 3), NATS and the stream/consumer (exit 4).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import os
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import setproctitle
import uvloop

import supervisor.config.pools as pool_rules
from supervisor import logs
from supervisor.config import Config, parse_hostport, reload, with_servers
from supervisor.config.pools import effective
from supervisor.errors import EXIT_HALTED, ConfigError, Halted, HandlerError, SupervisorError
from supervisor.nats import connect as natsconn
from supervisor.nats import provision, schedules
from supervisor.nats.embedded import EmbeddedServer
from supervisor.observe.http import STOPPING, HttpServer
from supervisor.observe.snapshot import Snapshot
from supervisor.observe.status import title
from supervisor.parent import snapshots
from supervisor.parent.arbiter import Arbiter
from supervisor.parent.crew import Code, Crew
from supervisor.parent.systemd import Notifier
from supervisor.parent.tasks.fleet import Fleet
from supervisor.parent.tasks.monitor import LimitsReading, Monitor
from workers import Middleware
from workers.middleware.chain import around_mismatch
from workers.middleware.retries import check_names, split_name

log = logging.getLogger("supervisor")

# Seconds between nats-py's PINGs on the parent's and each worker's connection; two unanswered
# and it reconnects: a half-open link is noticed in about 10-15 s, not nats-py's default 4 min.
PING_INTERVAL = 5
TITLE_INTERVAL = 0.5         # how often the parent's process title is brought up to date
CODE_KEYS = ("workers.handler", "workers.init", "workers.middleware", "tracing.enabled")   # a reload re-imports for these
# What `start` says when there is no handler: the key, what to write, and an example to try.
NO_HANDLER = ("not set; `supervisor start` needs the function that runs each job: pass --handler "
              "myjobs:handle, or write handler = \"myjobs:handle\" under [workers] in the config "
              "(workers.examples:sleep_job to try things out)")


def require_handler(cfg: Config, key: str = "workers.handler") -> None:
    if not cfg.workers.handler:
        raise ConfigError(key, NO_HANDLER if key == "workers.handler" else
                          "not set, and [workers] sets none for it either; " + NO_HANDLER.split("; ", 1)[1])


def pool_key(cfg: Config, pool: str, name: str) -> str:
    """What an error about a pool's `name` key ("handler") names: `pools.NAME.handler` when the
    pool sets it (or has to), else the [workers] key it inherits."""
    if cfg.pools and (getattr(cfg.pools[pool], name) is not None or not getattr(cfg.workers, name)):
        return f"pools.{pool}.{name}"
    return f"workers.{name}"


def load_code(cfg: Config, pool: str) -> Code:
    """A pool's handler, init and middleware, imported and checked in the parent before any fork
    (exit 2 without a handler, 3 when one cannot be imported), its errors naming its keys."""
    eff = effective(cfg, pool)
    require_handler(eff, pool_key(cfg, pool, "handler"))
    handler = load_callable(eff.workers.handler, pool_key(cfg, pool, "handler"))
    init = load_callable(eff.workers.init, pool_key(cfg, pool, "init")) if eff.workers.init else None
    return handler, init, load_middleware(eff, handler, pool_key(cfg, pool, "middleware"))


def load_callable(spec: str, key: str) -> Callable:
    """Import MODULE:FUNCTION for workers.handler / workers.init; any failure is exit 3."""
    obj = load_object(spec, key)
    if not callable(obj):
        raise HandlerError(f"{key}: {spec} is a {type(obj).__name__}, not callable")
    return obj


Middlewares = tuple[tuple[str, type[Middleware]], ...]


def load_middleware(cfg: Config, handler: Callable, key: str = "workers.middleware") -> Middlewares:
    """Import and check each workers.middleware entry: a workers.Middleware subclass that can be
    made with no arguments, whose `around` suits the handler's kind; anything else is exit 3.
    With [tracing] on, its SDK and exporter are imported here too, before any fork (no exporter
    starts: workers/middleware/tracing.py preload)."""
    if cfg.tracing.enabled:
        from workers.middleware import tracing
        tracing.preload()
    out = []
    entries = key
    for k, spec in enumerate(cfg.workers.middleware):
        key = f"{entries}[{k}]"
        cls = load_object(spec, key)
        if not (isinstance(cls, type) and issubclass(cls, Middleware)):
            raise HandlerError(f"{key}: {spec} is a {type(cls).__name__}, not a subclass of workers.Middleware")
        try:
            inspect.signature(cls).bind()
        except TypeError as exc:
            raise HandlerError(f"{key}: {spec} cannot be made with no arguments ({exc}); a worker makes it so") from None
        if why := around_mismatch(cls, inspect.iscoroutinefunction(handler)):
            raise HandlerError(f"{key}: {spec}: {why}")
        out.append((spec, cls))
    return tuple(out)


def check_retry_rules(cfg: Config) -> None:
    """Every exception named in [[retry.rules]] `on` resolves, its module imported here, before any
    fork (workers find it in sys.modules); else exit 2 naming the rule."""
    for k, rule in enumerate(cfg.retry.rules):
        for module_name in {split_name(name)[0] for name in rule.on} - {""}:
            try:
                importlib.import_module(module_name)
            except Exception as exc:
                raise ConfigError(f"retry.rules[{k}].on", f"cannot import {module_name!r}: {type(exc).__name__}: {exc}"
                                  ) from None
    if problem := check_names(cfg.retry.rules):
        raise ConfigError(*problem)


def load_object(spec: str, key: str) -> Any:
    """Import MODULE:ATTR; any failure is exit 3 naming the key."""
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())       # like gunicorn: the app lives where we were started
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        where = user_frame(exc, module_name)
        raise HandlerError(f"{key}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
                           + (f" (at {where})" if where else "")) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise HandlerError(f"{key}: module {module_name!r} has no attribute {attr!r}") from None


def user_frame(exc: BaseException, module_name: str) -> str:
    """`path:line: code` of the innermost frame of the user's code in an import failure.

    The user's code is what is neither Python's nor an installed library's nor ours; when the
    handler's package is itself installed (site-packages), its own frames. A SyntaxError is
    raised by the compiler, so it carries the place itself. "" when no frame qualifies."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{_shown_path(exc.filename)}:{exc.lineno}"
    frames = list(traceback.walk_tb(exc.__traceback__))
    libraries = tuple(p + os.sep for p in {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib",
                                                                             "platlib")} if p)
    ours = tuple(os.path.dirname(sys.modules[n].__file__ or "") + os.sep for n in ("supervisor", "workers")
                 if n in sys.modules)
    top = module_name.split(".")[0]

    def outside(frame: Any) -> bool:
        name = frame.f_code.co_filename
        return not name.startswith("<") and not name.startswith(libraries) and not name.startswith(ours)

    def in_package(frame: Any) -> bool:
        name = frame.f_globals.get("__name__", "")
        return name == top or name.startswith(top + ".")

    chosen = [f for f in frames if outside(f[0])] or [f for f in frames if in_package(f[0])]
    if not chosen:
        return ""
    frame, line = chosen[-1]
    code = (traceback.FrameSummary(frame.f_code.co_filename, line, frame.f_code.co_name).line or "").strip()
    return f"{_shown_path(frame.f_code.co_filename)}:{line}" + (f": {code[:80]}" if code else "")


def _shown_path(path: str) -> str:
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def overruled(new: Config, from_config: Config, pins: Mapping[str, str]) -> list[tuple[str, str, Any, Any]]:
    """(key, flag, value kept, value the file/environment now gives) for each key a command-line
    flag pins while the reloaded config says otherwise: a SIGHUP cannot change those."""
    out = []
    for dotted, flag in pins.items():
        section, name = dotted.split(".")
        kept, said = getattr(getattr(new, section), name), getattr(getattr(from_config, section), name)
        if kept != said:
            out.append((dotted, flag, kept, said))
    return out


def set_only(value: Any) -> Any:
    """A whole [pools.NAME] entry as the log shows it: the keys it sets (unset ones are inherited)."""
    return {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value


class Supervisor:
    """Owns the pieces of one `supervisor start` run and tears them down in order. Long because
    each pool's parts are made here too (its consumer, handler, crew, monitor), at start and when
    a reload adds one; each step is a few lines handing the work to the room that does it."""

    def __init__(self, cfg: Config, reload_config: Callable[[], Config] | None = None,
                 file_config: Callable[[], Config] | None = None, pins: Mapping[str, str] | None = None,
                 only: Sequence[str] = ()):
        self.cfg = cfg
        self.reload_source = reload_config
        # The config without command-line flags, and the keys the flags pin (key -> flag): a
        # reload says which edits of the file the flags overrule.
        self.file_source = file_config
        self.pins = dict(pins or {})
        self.only = tuple(only)                      # `start --pool NAME ...`: run only these pools
        self.embedded: EmbeddedServer | None = None
        self.nc: Any = None
        self.arbiter: Arbiter | None = None
        self.fleet: Fleet | None = None
        self.http: HttpServer | None = None
        self.notifier = Notifier()
        self.limits = LimitsReading()                # [limits.NAME] in use: one reading for every pool
        self.schedules: dict[str, Any] = {}          # what the last reconcile did (/status schedules)

    def run(self) -> int:
        cfg = self.cfg
        pools = pool_rules.select(cfg, self.only)
        self.set_title("starting")
        codes = {name: load_code(cfg, name) for name in pools}
        check_retry_rules(cfg)
        if not cfg.nats.servers:
            e = cfg.embedded
            self.embedded = EmbeddedServer(e.host, e.port, e.monitor_port, e.store_dir)
            self.cfg = with_servers(cfg, (self.embedded.url,))
        natsconn.connect_kwargs(self.cfg.nats)     # secret files readable? (exit 2 before anything starts)
        if self.embedded:
            self.embedded.start(cfg.nats.startup_timeout)
        try:
            return uvloop.run(self.serve(codes))
        finally:
            if self.embedded:
                self.embedded.stop()

    async def serve(self, codes: Mapping[str, Code]) -> int:
        cfg = self.cfg
        started = time.monotonic()
        self.nc = await provision.connect_until(cfg, name=cfg.nats.name, ping_interval=PING_INTERVAL,
                                                max_outstanding_pings=2)
        tasks: list[asyncio.Task] = []
        try:
            pools = {name: (effective(cfg, name), code) for name, code in codes.items()}
            await provision.ensure_until(self.nc, cfg, [pool_cfg for pool_cfg, _ in pools.values()], started)
            await self.apply_schedules(cfg)
            self.arbiter = arbiter = Arbiter(cfg, self.nc, pools, self.connect_worker, self.notifier,
                                             reload_config=self.reload if self.reload_source else None,
                                             server_dies_with_parent=self.embedded is not None)
            for crew in arbiter.crews.values():
                await self.inherit_pending(crew)
                self.watch(crew)
            self.fleet = Fleet(cfg, self.nc, arbiter, self.snapshot)
            for crew in arbiter.crews.values():
                crew.monitor.fleet = self.fleet
            arbiter.fleet_key = self.fleet.key          # before the first fork (arbiter.run)
            if cfg.monitor.http:
                host, port = parse_hostport(cfg.monitor.http, "monitor.http")
                self.http = HttpServer(self, host, port)
                try:
                    await self.http.start()
                except OSError as exc:
                    raise ConfigError("monitor.http", f"cannot listen on {cfg.monitor.http}: {exc.strerror}") from None
            for crew in arbiter.crews.values():
                self.start_monitor(crew)
            tasks.append(asyncio.ensure_future(self.keep_title()))
            tasks.append(asyncio.ensure_future(self.fleet.run()))
            code = await arbiter.run()
            if code == EXIT_HALTED:
                raise Halted(arbiter.halt_message)
            return code
        finally:
            for task in tasks:
                task.cancel()
            for crew in self.arbiter.every_crew() if self.arbiter else ():
                for task in crew.tasks:
                    task.cancel()
            self.set_title("stopping")
            if self.fleet:
                await self.fleet.close()
            if self.http:
                await self.http.close()
            await self.close()

    def watch(self, crew: Crew) -> None:
        """A pool's monitor: its consumer's numbers, lag and advisories (parent/tasks/monitor.py)."""
        arbiter = self.parts()[0]
        crew.monitor = crew.autoscale.monitor = Monitor(crew.cfg, self.nc, crew, on_polled=self.notify_status,
                                                        limits=self.limits, reads_limits=lambda: arbiter.lead is crew)

    def start_monitor(self, crew: Crew) -> None:
        with crew.context():            # its log lines name its pool
            crew.tasks.append(asyncio.ensure_future(crew.monitor.run()))

    def notify_status(self) -> None:
        """systemd's STATUS= after a poll: the workers ready, and each pool's queue."""
        arbiter = self.parts()[0]
        now = time.monotonic()
        crews = [c for c in arbiter.crews.values() if c.monitor]
        if len(crews) == 1:
            line = f"{arbiter.status_line()}; {crews[0].monitor.status_line(now)}"
        else:
            line = f"{arbiter.status_line()}; " + "; ".join(
                f"{c.name} {c.pool.ready_count()}/{c.pool.target}, {c.monitor.status_line(now).replace('; ', ', ')}"
                for c in crews)
        self.notifier.status(line)

    async def apply_schedules(self, cfg: Config) -> None:
        """Make the server's config-made schedules the config's (nats/schedules.py). A stream or
        server that cannot hold them is a logged refusal and a /status alert, never the end of
        the run: the jobs already queued still need their workers."""
        try:
            done = await schedules.reconcile(self.nc, cfg)
        except ConfigError as exc:
            log.error("[schedules] refused: %s", exc, extra={"event": "schedules_refused", "reason": str(exc)})
            self.schedules = {"allowed": False, "refused": str(exc)}
            return
        except Exception as exc:          # NATS away or slow: say so; a SIGHUP tries again
            why = str(exc) if isinstance(exc, SupervisorError) else f"{type(exc).__name__}: {exc}"
            log.error("cannot make the server's schedules match [schedules]: %s", why,
                      extra={"event": "schedules_failed", "reason": why})
            self.schedules = {"allowed": None, "error": why}
            return
        self.schedules = done
        for verb in ("added", "changed", "removed"):
            for name in done.get(verb, ()):
                log.info("schedule %s %s (config)", name, verb, extra={"event": f"schedule_{verb}", "schedule": name})
        for name in done.get("shadowed", ()):
            log.warning("schedule %s is in the config and was also made by `schedule add`: both fire; "
                        "`supervisor schedule rm %s` removes the other one", name, name,
                        extra={"event": "schedule_shadowed", "schedule": name})

    def parts(self) -> tuple[Arbiter, Fleet | None]:
        """What serve() made; the reload and the title task run only once it exists."""
        assert self.arbiter, "serve() has not made its parts yet"
        return self.arbiter, self.fleet

    async def inherit_pending(self, crew: Crew) -> None:
        """Deliveries pending before we started (a previous run NAKed them while draining) come
        back to our workers: the ledger must not call them unexplained."""
        asked = time.monotonic()
        try:
            info = await self.nc.jetstream().consumer_info(crew.cfg.stream.name, crew.cfg.consumer.name)
        except Exception as exc:
            log.debug("ConsumerInfo at start failed (%s): inherited redeliveries may read as unexplained", exc)
            return
        crew.ledger.inherit(info.num_ack_pending or 0, info.delivered.stream_seq or 0)
        # Whatever was delivered before now is no in-transit candidate later (in_transit.py): a
        # previous run's Retry(delay) NAKs stay pending, unheld, and must keep their delay (R12).
        crew.in_transit.observed(asked, time.monotonic(), info.delivered.stream_seq or 0, info.num_waiting or 0,
                                    info.delivered.consumer_seq or 0, bool(getattr(info, "paused", False)))

    async def reload(self) -> None:
        """SIGHUP: re-read the config; apply what can change live, pool by pool (a pool added to
        the file starts, one removed drains and leaves); keep running on the old config (and say
        why) when the new one is invalid."""
        arbiter = self.parts()[0]
        assert self.reload_source is not None, "SIGHUP is only wired with a config source"
        self.notifier.reloading()
        added: list[Crew] = []
        try:
            new = self.reload_source()
            pinned = overruled(new, self.file_source(), self.pins) if self.file_source and self.pins else []
            if self.embedded and not new.nats.servers:
                new = with_servers(new, self.cfg.nats.servers)
            change = reload.plan(self.cfg, new)
            cfg = change.effective
            pools = reload.pools_plan(self.cfg, cfg, list(arbiter.crews), list(pool_rules.select(cfg, self.only)))
            check_retry_rules(cfg)
            codes = {}                   # pool -> (handler, init, middleware) when one of them changed
            for name, p in pools.kept.items():
                require_handler(p.effective, pool_key(cfg, name, "handler"))
                if any(k in CODE_KEYS for k, _, _ in p.changed):
                    codes[name] = load_code(cfg, name)
                if p.update_consumer or any(k == "ordering.key" for k, _, _ in p.changed):
                    await provision.ensure_queue(self.nc.jetstream(), p.effective)   # [ordering]'s checks too
            for name in pools.added:
                added.append(await self.new_crew(arbiter, cfg, name))
            if cfg.idempotency.enabled and not self.cfg.idempotency.enabled:    # the new workers need the bucket
                await provision.ensure_idempotency(self.nc.jetstream(), cfg)
            if any(k.startswith("schedules") for k, _, _ in change.changed) or "error" in self.schedules:
                await self.apply_schedules(cfg)
        except Exception as exc:      # whatever went wrong, the running config stays
            for crew in added:        # made for nothing: its peers heard its hello
                for task in crew.tasks:
                    task.cancel()
                await crew.peers.close()
            why = str(exc) if isinstance(exc, SupervisorError) else f"{type(exc).__name__}: {exc}"
            log.error("reload failed; still running on the previous config: %s", why,
                      extra={"event": "reload_failed", "reason": why})
            self.notifier.ready(arbiter.status_line())
            return
        for key, flag, kept, said in pinned:
            log.warning("reload: %s stays %r (set by %s); the config now says %r", key, kept, flag, said)
        for key in change.needs_restart:
            log.warning("reload: %s changed; it takes effect at the next start", key,
                        extra={"event": "reload_needs_restart", "key": key})
        for key, old, new_value in change.changed:
            if key not in change.needs_restart:
                old, new_value = set_only(old), set_only(new_value)
                log.info("reload: %s: %r -> %r", key, old, new_value,
                         extra={"event": "reload_applied", "key": key, "old": old, "new": new_value})
        if not change.changed:
            log.info("reload: configuration unchanged", extra={"event": "reload_unchanged"})
        arbiter.post(lambda: self.apply_config(cfg, pools, codes, added))

    async def new_crew(self, arbiter: Arbiter, cfg: Config, name: str) -> Crew:
        """A pool a reload adds: its consumer ensured, its crew and monitor made and watching; the
        loop adopts it with the rest of the new config."""
        pool_cfg = effective(cfg, name)
        code = load_code(cfg, name)
        await provision.ensure_queue(self.nc.jetstream(), pool_cfg)
        crew = arbiter.crew(name, pool_cfg, code)
        with crew.context():
            await crew.peers.start()
        await self.inherit_pending(crew)
        self.watch(crew)
        crew.monitor.fleet = self.fleet
        self.start_monitor(crew)
        return crew

    def apply_config(self, cfg: Config, pools: Any, codes: Mapping[str, Code | None], added: list[Crew]) -> None:
        """In the arbiter's loop (one writer): every part takes the new config at the same moment."""
        self.cfg = cfg
        arbiter, fleet = self.parts()
        arbiter.apply_config(cfg, pools, codes, added)
        for name, plan in pools.kept.items():
            arbiter.crews[name].monitor.apply_config(plan.effective)
        if fleet:
            fleet.apply_config(cfg)
        logs.setup(cfg.log.level, cfg.log.format)
        self.notifier.ready(arbiter.status_line())

    # ------------------------------------------------------------ the process title in `ps`

    def set_title(self, state: str) -> None:
        consumers = [effective(self.cfg, name).consumer.name for name in pool_rules.select(self.cfg, self.only)]
        setproctitle.setproctitle(f"supervisor: parent [{self.cfg.stream.name}/{','.join(consumers)}] {state}")

    async def keep_title(self) -> None:
        """`supervisor: parent [JOBS/workers] 4/4 ready` in ps/top, kept current (a snapshot every
        TITLE_INTERVAL; the arbiter is not disturbed)."""
        shown = ""
        while True:
            state = self.title()
            if state != shown:
                self.set_title(state)
                shown = state
            await asyncio.sleep(TITLE_INTERVAL)

    def title(self) -> str:
        arbiter = self.parts()[0]
        return title(*snapshots.headcount(arbiter), arbiter.state)

    # ------------------------------------------------------------ what the HTTP endpoint may ask (http.Commands)

    def snapshot(self) -> Snapshot:
        arbiter, fleet = self.parts()
        return snapshots.take(arbiter, fleet, self.nc, self.embedded is not None, self.schedules)

    def history(self, after: int, pool: str | None = None) -> dict[str, Any] | None:
        """/history of a pool (the first without `pool`); None while not monitoring yet."""
        if self.arbiter is None:
            return None
        crew = self.arbiter.crews.get(pool) if pool is not None else self.arbiter.lead
        if crew is None or crew.monitor is None:
            return None
        body = crew.monitor.history.as_dict(time.monotonic(), time.time(), crew.ledger.deaths, after)
        body["pid"] = os.getpid()           # a restarted supervisor numbers its samples anew
        body["pool"], body["pools"] = crew.name, list(self.arbiter.crews)
        return body

    def pools(self) -> tuple[str, ...]:
        return tuple(self.arbiter.crews) if self.arbiter else ()

    def scale(self, n: int, source: str, pool: str | None = None) -> str | None:
        """Ask the loop for n workers in a pool; None when it will, else why not (at once)."""
        arbiter = self.parts()[0]
        if arbiter.stopping:
            return STOPPING
        crew, refused = arbiter.scalable(pool)
        if crew is None:
            return refused
        arbiter.post(lambda: arbiter.scale(n, source, crew.name))       # the loop applies it
        return None

    async def connect_worker(self, who: str) -> Any:
        # The worker's own liveness PINGs tell the parent sooner (slot table SERVER_SEEN).
        return await natsconn.connect(self.cfg.nats, name=f"{self.cfg.nats.name} worker {who}",
                                      max_reconnect_attempts=-1, ping_interval=PING_INTERVAL,
                                      max_outstanding_pings=2)

    async def close(self) -> None:
        try:
            await self.nc.drain()
        except Exception as exc:
            log.warning("closing the NATS connection: %s", exc)
