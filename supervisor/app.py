"""`supervisor start`: embedded server (if needed) -> connect -> provision -> supervise -> stop.

Everything that can fail on bad input fails here, before a single worker is forked: the config
(exit 2), the handler import (exit 3), NATS and the stream/consumer (exit 4).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import os
import sys
from typing import Any, Callable

import uvloop

from . import logs, natsconn, provision, reload
from .arbiter import Arbiter
from .config import Config
from .embedded import EmbeddedServer
from .config import parse_hostport
from .errors import EXIT_HALTED, ConfigError, Halted, HandlerError, SupervisorError
from .http import HttpServer
from .monitor import Monitor
from .notify import Notifier

log = logging.getLogger("supervisor")

WORKER_PING_INTERVAL = 5     # seconds; two unanswered pings and nats-py reconnects


def load_callable(spec: str, key: str) -> Callable:
    """Import MODULE:FUNCTION for workers.handler / workers.init; any failure is exit 3."""
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())       # like gunicorn: the app lives where we were started
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise HandlerError(f"{key}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise HandlerError(f"{key}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise HandlerError(f"{key}: {spec} is a {type(obj).__name__}, not callable")
    return obj


def with_servers(cfg: Config, servers: tuple[str, ...]) -> Config:
    return dataclasses.replace(cfg, nats=dataclasses.replace(cfg.nats, servers=servers))


class Supervisor:
    """Owns the pieces of one `supervisor start` run and tears them down in order."""

    def __init__(self, cfg: Config, reload_config: Callable[[], Config] | None = None):
        self.cfg = cfg
        self.reload_source = reload_config
        self.embedded: EmbeddedServer | None = None
        self.nc: Any = None
        self.arbiter: Arbiter | None = None
        self.monitor: Monitor | None = None
        self.http: HttpServer | None = None
        self.notifier = Notifier()

    def run(self) -> int:
        cfg = self.cfg
        handler = load_callable(cfg.workers.handler, "workers.handler")
        init = load_callable(cfg.workers.init, "workers.init") if cfg.workers.init else None
        if not cfg.nats.servers:
            e = cfg.embedded
            self.embedded = EmbeddedServer(e.host, e.port, e.monitor_port, e.store_dir)
            self.cfg = with_servers(cfg, (self.embedded.url,))
        natsconn.connect_kwargs(self.cfg.nats)     # secret files readable? (exit 2 before anything starts)
        if self.embedded:
            self.embedded.start(cfg.nats.startup_timeout)
        try:
            return uvloop.run(self.serve(handler, init))
        finally:
            if self.embedded:
                self.embedded.stop()

    async def serve(self, handler: Callable, init: Callable | None) -> int:
        cfg = self.cfg
        self.nc = await provision.connect_until(cfg, name=cfg.nats.name)
        tasks: list[asyncio.Task] = []
        try:
            await provision.ensure(self.nc, cfg)
            self.arbiter = Arbiter(cfg, self.nc, handler, init, self.connect_worker, self.notifier,
                                   reload_config=self.reload if self.reload_source else None)
            await self.inherit_pending()
            self.monitor = Monitor(cfg, self.nc, self.arbiter)
            if cfg.monitor.http:
                host, port = parse_hostport(cfg.monitor.http, "monitor.http")
                self.http = HttpServer(self, host, port)
                try:
                    await self.http.start()
                except OSError as exc:
                    raise ConfigError("monitor.http", f"cannot listen on {cfg.monitor.http}: {exc.strerror}") from None
            tasks.append(asyncio.ensure_future(self.monitor.run()))
            code = await self.arbiter.run()
            if code == EXIT_HALTED:
                raise Halted(self.arbiter.halt_message)
            return code
        finally:
            for task in tasks:
                task.cancel()
            if self.http:
                await self.http.close()
            await self.close()

    async def inherit_pending(self) -> None:
        """Deliveries pending before we started (a previous run NAKed them while draining) come
        back to our workers: the ledger must not call them unexplained."""
        try:
            info = await self.nc.jetstream().consumer_info(self.cfg.stream.name, self.cfg.consumer.name)
        except Exception as exc:
            log.debug("ConsumerInfo at start failed (%s): inherited redeliveries may read as unexplained", exc)
            return
        self.arbiter.ledger.inherit(info.num_ack_pending or 0, info.delivered.stream_seq or 0)

    async def reload(self) -> None:
        """SIGHUP: re-read the config; apply what can change live; keep running on the old
        config (and say why) when the new one is invalid."""
        self.notifier.reloading()
        try:
            new = self.reload_source()
            if self.embedded and not new.nats.servers:
                new = with_servers(new, self.cfg.nats.servers)
            change = reload.plan(self.cfg, new)
            cfg = change.effective
            handler = init = None
            if any(k in ("workers.handler", "workers.init") for k, _, _ in change.changed):
                handler = load_callable(cfg.workers.handler, "workers.handler")
                init = load_callable(cfg.workers.init, "workers.init") if cfg.workers.init else None
            if change.update_consumer:
                await provision.ensure_consumer(self.nc.jetstream(), cfg)
        except Exception as exc:      # whatever went wrong, the running config stays
            why = str(exc) if isinstance(exc, SupervisorError) else f"{type(exc).__name__}: {exc}"
            log.error("reload failed; still running on the previous config: %s", why)
            self.notifier.ready(self.arbiter.status_line())
            return
        for key in change.needs_restart:
            log.warning("reload: %s changed; it takes effect at the next start", key)
        for key, old, new_value in change.changed:
            if key not in change.needs_restart:
                log.info("reload: %s: %r -> %r", key, old, new_value)
        if not change.changed:
            log.info("reload: configuration unchanged")
        self.arbiter.post(lambda: self.apply_config(cfg, change, handler, init))

    def apply_config(self, cfg: Config, change: Any, handler: Callable | None, init: Callable | None) -> None:
        """In the arbiter's loop (one writer): every part takes the new config at the same moment."""
        self.cfg = cfg
        self.arbiter.apply_config(cfg, change, handler, init)
        self.monitor.apply_config(cfg)
        logs.setup(cfg.log.level, cfg.log.format)
        self.notifier.ready(self.arbiter.status_line())

    async def connect_worker(self, slot: int) -> Any:
        # A short ping interval: a half-open connection is noticed (and replaced) in seconds, not
        # nats-py's default 2 minutes; the worker's own liveness PINGs tell the parent meanwhile.
        return await natsconn.connect(self.cfg.nats, name=f"{self.cfg.nats.name} worker {slot}",
                                      max_reconnect_attempts=-1, ping_interval=WORKER_PING_INTERVAL,
                                      max_outstanding_pings=2)

    async def close(self) -> None:
        try:
            await self.nc.drain()
        except Exception as exc:
            log.warning("closing the NATS connection: %s", exc)
