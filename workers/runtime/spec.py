"""What the parent hands a worker across fork()."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from supervisor.config import Config
from workers import Job, Middleware
from workers.protocol.crashes import CrashBoard
from workers.protocol.slots import SlotTable
from workers.runtime.solo import SuspectBoard


@dataclass
class ChildSpec:
    """Everything a freshly forked worker needs; built by the parent before the fork."""
    slot: int
    parent_pid: int
    table: SlotTable
    events_fd: int
    cfg: Config                                # servers resolved
    handler: Callable[[Job], Any]
    init: Callable[[], Any] | None
    connect: Callable[[], Awaitable[Any]]      # returns a connected nats client
    # workers.middleware as (entry, class), imported and checked by the parent; instantiated after fork
    middleware: tuple[tuple[str, type[Middleware]], ...] = ()
    job_limit: int = 0                         # tell the parent once this many jobs started (max_jobs)
    suspects: SuspectBoard | None = None       # jobs to run alone (workers/runtime/solo.py), written by the parent
    crashes: CrashBoard | None = None          # the deaths redeliveries come back from (workers/protocol/crashes.py)
    graceful_timeout: float = 30.0             # workers.graceful_timeout as it was at fork: the parent's too
    server_dies_with_parent: bool = False      # the embedded nats-server: an orphan has nobody to settle with
    fleet_key: str = ""                        # the parent's fleet heartbeat: an orphan claims its jobs there
    keep_fds: tuple[int, ...] = ()
