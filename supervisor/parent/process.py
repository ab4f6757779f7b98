"""One forked worker, as the parent sees it: pid, pidfd, event pipe, slot table. Mechanism only;
what to do about a worker (restart it, kill it, recycle it) is the arbiter's business.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import signal
import time
from collections.abc import Callable

from workers.protocol import slots
from workers.protocol.events import Event, decode
from workers.protocol.exits import Kill
from workers.protocol.slots import SlotTable
from workers.runtime.spec import ChildSpec
from workers.runtime.worker import child_main

log = logging.getLogger("supervisor.process")

ALL_SIGNALS = set(signal.Signals)


class WorkerState(enum.StrEnum):
    """A worker's life as the parent sees it (the values are what /status and /metrics show)."""
    STARTING = "starting"        # forked, not ready yet
    READY = "ready"              # connected and pulling
    DRAINING = "draining"        # told to stop or retire: finishing what it holds
    DEAD = "dead"                # exited, not yet reaped


class WorkerProcess:
    def __init__(self, slot: int, table: SlotTable):
        self.slot = slot
        self.table = table
        self.pid = 0
        self.pidfd = -1
        self.events_fd = -1
        self.state = WorkerState.STARTING
        self.started_at = time.monotonic()
        self.ready_at: float | None = None
        self.retiring = False            # asked to drain for good (scale down, recycle, stop)
        self.kill: Kill | None = None    # why the arbiter killed it (a job_timeout kill names its job)
        self.drain_deadline: float | None = None
        self.job_limit = 0               # recycle after this many jobs (0 = never)
        self.graceful_timeout = 0.0      # the one it was forked with (it reads the key at fork)
        self.limit_names: tuple[str, ...] = ()   # its table's per-limit blocks, in this order ([limits.NAME])
        self.recycle_reason = ""         # why it is due for replacement (max_jobs, RSS, a config roll)
        self.last_job_started = False    # it started its max_jobs-th job and will take no other
        self.status: int | None = None   # wait status once reaped
        self._buf = b""

    def spawn(self, loop: asyncio.AbstractEventLoop, make_spec: Callable[[WorkerProcess, int], ChildSpec],
              on_exit: Callable[[WorkerProcess], None], on_events: Callable[[WorkerProcess], None]) -> None:
        """Fork the worker. Signals stay blocked across fork(), so none can run a parent handler in
        the child before it has installed its own."""
        read_fd, write_fd = os.pipe()      # OSError (EMFILE) here: nothing to undo
        spec = make_spec(self, write_fd)
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, ALL_SIGNALS)
        try:
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                child_main(spec)           # never returns
        except OSError:                    # EAGAIN (TasksMax, RLIMIT_NPROC), ENOMEM: no child
            os.close(read_fd)
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            os.close(write_fd)
        self.pid, self.events_fd = pid, read_fd
        os.set_blocking(read_fd, False)
        try:
            self.pidfd = os.pidfd_open(pid)
        except OSError:                    # EMFILE: a child we could not watch must not live on
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            self.status = 0
            raise
        loop.add_reader(self.pidfd, on_exit, self)
        loop.add_reader(read_fd, on_events, self)

    def send(self, sig: int) -> bool:
        """Signal through the pidfd: never hits a recycled pid."""
        if self.pidfd < 0 or self.status is not None:
            return False
        try:
            signal.pidfd_send_signal(self.pidfd, sig)
            return True
        except ProcessLookupError:
            return False

    def reap(self) -> bool:
        """Collect the exit status if the process has exited."""
        if self.status is not None:
            return True
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = self.pid, 255 << 8
        if pid == 0:
            return False
        self.status = status
        self.state = WorkerState.DEAD
        return True

    def read_events(self) -> list[Event]:
        """Whole JSON lines the worker wrote; partial lines wait for the rest."""
        chunks = []
        while True:
            try:
                chunk = os.read(self.events_fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        data = self._buf + b"".join(chunks)
        *lines, self._buf = data.split(b"\n")
        events = []
        for line in lines:
            try:
                events.append(decode(line))
            except ValueError as exc:
                log.warning("worker %d sent a malformed event: %s", self.slot, exc)
        return events

    def close(self, loop: asyncio.AbstractEventLoop) -> None:
        for fd in (self.pidfd, self.events_fd):
            if fd >= 0:
                loop.remove_reader(fd)
                os.close(fd)
        self.pidfd = self.events_fd = -1
        self.table.close()

    def describe_exit(self) -> str:
        """'exit code 3' or 'signal SIGKILL (perhaps out of memory?)', gunicorn style."""
        status = self.status or 0
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            hint = " (perhaps out of memory?)" if sig == signal.SIGKILL and not self.kill else ""
            return f"signal {name}{hint}"
        return f"exit code {os.WEXITSTATUS(status)}"

    def signalled_by(self) -> int | None:
        status = self.status or 0
        return os.WTERMSIG(status) if os.WIFSIGNALED(status) else None

    @property
    def jobs_finished(self) -> int:
        """Handlers that ran to an outcome (ack, NAK or TERM), from the worker's own counters."""
        t = self.table
        return t.header(slots.ACKED_N) + t.header(slots.NAKED_N) + t.header(slots.TERMED_N)

    def exit_code(self) -> int | None:
        status = self.status or 0
        return os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
