"""[log context]: the job every log record belongs to while it runs (supervisor/logcontext.py).

Always on, the innermost built-in (closest to the handler), with plain hooks: they run where the
handler runs, in its handler thread (sync) or its task on the loop (async), so the contextvar
they set is the one the handler's own `logging` calls see, and no other thread or task sees it.
Tasks the handler starts copy it (their records carry the job too). With [tracing] on it also
makes the job's span current there (tracing.py `current`): the handler's own spans are its
children, and its records carry the trace_id.

Innermost, and plain hooks, so it never moves another middleware off the loop (Chain.outer
counts the outermost on-the-loop layers only). Records logged outside the handler and the
middleware inside this one (the outer middleware's, the runtime's settle lines) carry none.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from supervisor.logcontext import CURRENT, JobFields
from workers import Job
from workers.middleware.base import Context, Middleware

if TYPE_CHECKING:                        # the SDK is imported only with [tracing] on
    from workers.middleware.tracing import Tracing

# With [tracing] on: the job's span made current by before_job, for after_job to release (the
# same thread or task).
_SPAN: ContextVar[Any] = ContextVar("supervisor_job_span", default=None)


class JobLog(Middleware):
    def __init__(self, tracing: Tracing | None = None):
        self.tracing = tracing
        self.slot = 0

    def setup(self, ctx: Context) -> None:
        self.slot = ctx.slot

    def before_job(self, job: Job) -> None:
        if self.tracing is None:
            CURRENT.set(JobFields(self.slot, job.stream_seq, job.delivery, job.subject))
            return
        trace_id, attached = self.tracing.current(job)
        CURRENT.set(JobFields(self.slot, job.stream_seq, job.delivery, job.subject, trace_id))
        _SPAN.set(attached)

    def after_job(self, job: Job, outcome: str, error: BaseException | None) -> None:
        # Back to no job, which is what the handler thread's or the runner task's context held
        # before it: jobs run there one after another, never one inside another (no token to keep).
        CURRENT.set(None)
        if self.tracing is not None and (attached := _SPAN.get()) is not None:
            _SPAN.set(None)
            self.tracing.release(attached)
