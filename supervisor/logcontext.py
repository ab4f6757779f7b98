"""The job a log record belongs to: what a worker sets while a job runs and the formatters read.

The worker side sets `CURRENT` around each job (the innermost built-in middleware,
workers/middleware/joblog.py: in the job's handler thread for a sync handler, in its task for an
async one); the formatters the parent installed before forking (supervisor/logs.py) read it
when a record is formatted, which happens in the thread and context that logged it. So every
record logged while the job runs, the handler's own `logging` calls included, carries the job,
and a record logged anywhere else carries nothing: `CURRENT` is None there.

`POOL` is the pool a parent's record belongs to (several pools: parent/crew.py sets it while
one pool's step, event or task runs; "" otherwise). A worker forked inside it keeps it.

It lives in a module of its own because both sides import it and neither may import the other's
(tests/unit/test_structure.py LAYERS): it imports nothing.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import NamedTuple


class JobFields(NamedTuple):
    """A job as its log records name it (a tuple: made for every job, it costs a third of a
    frozen dataclass)."""
    worker: int              # the worker's slot
    seq: int                 # the job's stream sequence
    delivery: int
    subject: str
    trace_id: str = ""       # 32 hex digits, with [tracing] on

    def prefix(self) -> str:
        """What a text log line shows before the message: `[w2 seq=42 #1]`."""
        return f"[w{self.worker} seq={self.seq} #{self.delivery}]"

    def fields(self) -> dict[str, object]:
        """What a JSON log line carries."""
        out: dict[str, object] = {"job_seq": self.seq, "job_delivery": self.delivery, "job_subject": self.subject,
                                  "worker": self.worker}
        if self.trace_id:
            out["trace_id"] = self.trace_id
        return out


CURRENT: ContextVar[JobFields | None] = ContextVar("supervisor_job", default=None)
POOL: ContextVar[str] = ContextVar("supervisor_pool", default="")
