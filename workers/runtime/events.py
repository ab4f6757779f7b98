"""A worker's side of its event pipe to the parent: the rare events of workers/protocol/events.py,
one JSON line each. Best effort, never blocking, never raising.

Only the parent holds the read end. A blocking write would stall the worker's loop (its acks,
its heartbeat) whenever the parent's loop is busy; a write once the parent is gone raises
BrokenPipeError (CPython ignores SIGPIPE), which used to end an orphaned worker before it had
NAKed what it held (R3). So the pipe is non-blocking: what the parent has not read yet waits in
a backlog (bounded: a parent that reads nothing for that long is not coming back soon), sent by
the next event or by `flush()` (the heartbeat calls it); a broken pipe means the parent is gone,
and the worker stops emitting.
"""

from __future__ import annotations

import logging
import os
import select
import time

from workers.protocol.events import Event, encode

log = logging.getLogger("worker")

BACKLOG_MAX = 1 << 20        # bytes kept for a parent that does not read; events beyond are dropped


class EventPipe:
    def __init__(self, fd: int, slot: int):
        self.fd = fd
        self.slot = slot
        self.backlog = bytearray()
        self.closed = False      # the parent is gone: nothing more is sent
        self.dropped = 0         # events given up because the backlog was full
        os.set_blocking(fd, False)

    def send(self, event: Event) -> None:
        if self.closed:
            return
        line = encode(event)
        if len(self.backlog) + len(line) > BACKLOG_MAX:
            if not self.dropped:
                log.warning("worker %d: the supervisor reads no events; dropping them", self.slot,
                            extra={"event": "worker_events_dropped", "slot": self.slot})
            self.dropped += 1
            return
        self.backlog += line
        self.flush()

    def flush(self) -> None:
        """Write what the pipe takes now; partial lines are fine (the parent joins them)."""
        while self.backlog and not self.closed:
            try:
                n = os.write(self.fd, self.backlog)
            except BlockingIOError:
                return           # the parent is busy: the rest goes with the next event or flush
            except OSError:      # EPIPE: the parent is gone (or the fd is): nobody to tell
                self.close()
                return
            del self.backlog[:n]

    def drain(self, timeout: float) -> None:
        """At exit: what the parent has not taken yet, waiting up to `timeout` for room (it reads
        the rest at our reap, but only what reached the pipe)."""
        deadline = time.monotonic() + timeout
        while self.backlog and not self.closed and (left := deadline - time.monotonic()) > 0:
            select.select([], [self.fd], [], left)
            self.flush()

    def close(self) -> None:
        self.closed = True
        self.backlog.clear()
