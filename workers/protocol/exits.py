"""How a worker's exit reads to the parent: its exit codes, and why the parent killed it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

EXIT_DRAINED = 0
EXIT_INIT_FAILED = 3
EXIT_CONNECT_FAILED = 4
EXIT_CRASHED = 70
EXIT_ORPHANED = 71          # the supervisor and its embedded server are gone (nobody reads this one)
CHILD_EXIT_REASONS = {EXIT_INIT_FAILED: "init hook failed (or a middleware's setup)",
                      EXIT_CONNECT_FAILED: "cannot reach NATS or bind the consumer", EXIT_CRASHED: "worker crashed"}


class KillCause(enum.StrEnum):
    """Why the parent SIGKILLed a worker. The crash ledger weighs a death by this, never by text:
    the jobs running at a death are poison evidence only when they could have caused it."""
    QUIT = "quit"                       # SIGQUIT: the operator stops everything at once
    HEARTBEAT = "heartbeat"             # silent past workers.heartbeat_timeout (a job may block its loop)
    JOB_TIMEOUT = "job_timeout"         # one job ran past workers.job_timeout
    DRAIN_OVERDUE = "drain_overdue"     # still draining past its graceful_timeout

    @property
    def blames_jobs(self) -> bool:
        """QUIT and DRAIN_OVERDUE are the supervisor's own doing, not its jobs'."""
        return self in (KillCause.HEARTBEAT, KillCause.JOB_TIMEOUT)


@dataclass(frozen=True)
class Kill:
    cause: KillCause
    text: str                           # for the log, the ledger and /status
    blame: int | None = None            # the one job a JOB_TIMEOUT kill names (stream seq)
