"""The crash board: which worker death a redelivered job comes back from, for its next span.

A worker that dies cannot say so on the job's next delivery: the parent NAKs the job (a NAK
carries no headers), and the job's next span is made in another worker. The parent knows
(its ledger records each death with the jobs the dead worker held), so it writes one entry per
held job on this board, anonymous shared memory made before the first fork that every worker
inherits, *before* its NAKs bring the jobs back (supervisor/parent/deaths.py). A worker with
[tracing] on reads the entry of a job whose delivery is above 1 (one read, no syscall, no
round trip) and names the death on that delivery's span (workers/middleware/tracing.py).

Direct-mapped, like a cache: a job's entry is `seq % capacity`, so a read is one slot, and a
later death's job in the same slot replaces the older one (the board names recent crashes; every
death is in /status). Each slot carries a version word bumped before and after a write (odd
while writing), so a reader racing the parent sees either a whole entry or none.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

CAPACITY = 4096          # slots: jobs held at recent deaths
CAUSE_BYTES = 80         # a death's cause, cut to this (UTF-8)
# version, stream seq, delivery held at the death, death id, slot, pid, wall time, cause length, cause
LAYOUT = struct.Struct(f"<qqqqqqdq{CAUSE_BYTES}s")


@dataclass(frozen=True)
class Crash:
    seq: int
    delivery: int            # the delivery the dead worker held
    death: int               # the ledger's death id (/status "deaths")
    slot: int
    pid: int
    at: float                # wall-clock time of the death (time.time())
    cause: str


class CrashBoard:
    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self.mm = mmap.mmap(-1, LAYOUT.size * capacity)

    def post(self, crash: Crash) -> None:
        """In the parent (one writer: its loop): put one job a dead worker held on the board."""
        at = LAYOUT.size * (crash.seq % self.capacity)
        version = struct.unpack_from("<q", self.mm, at)[0]
        struct.pack_into("<q", self.mm, at, version + 1)          # odd: being written
        cause = crash.cause.encode()[:CAUSE_BYTES]
        LAYOUT.pack_into(self.mm, at, version + 1, crash.seq, crash.delivery, crash.death, crash.slot, crash.pid,
                         crash.at, len(cause), cause)
        struct.pack_into("<q", self.mm, at, version + 2)          # even: whole

    def lookup(self, seq: int) -> Crash | None:
        """In a worker: the death that held job `seq` most recently, if it is on the board."""
        at = LAYOUT.size * (seq % self.capacity)
        version, got, delivery, death, slot, pid, t, n, cause = LAYOUT.unpack_from(self.mm, at)
        if version % 2 or got != seq or struct.unpack_from("<q", self.mm, at)[0] != version:
            return None
        return Crash(got, delivery, death, slot, pid, t, cause[:n].decode(errors="replace"))
