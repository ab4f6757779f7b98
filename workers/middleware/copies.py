"""[retry]'s long delays, the side a redelivery sees: a job whose copy for later is stored runs
only as that copy.

The copy is stored before the original's ack (workers/runtime/later.py: publish, then ack, so a
crash can never lose the job). A worker that dies between the two, or whose ack is refused, or
whose drain gives the job up while the publish was under way, leaves both: the original comes
back (at once: the parent NAKs a dead worker's jobs), and if its rerun succeeded the copy would
still fire later and run the job a second time, as a new sequence no ledger links to the first.
So a redelivery (delivery > 1) first looks for its copy's schedule: stored and not yet fired, the
original is acked unrun here (a Duplicate: counted as one, not against max_jobs) and the copy
runs when due. Not found, or not readable: the job runs (a rerun, never a loss). Left: a copy that
already fired before the original came back (a supervisor down longer than the delay) still
runs beside it; with [idempotency] on, the guard folds the two by the key the copy carries.

With [pools.*] a copy is its pool's: its Msg-Id names the pool's consumer, and it carries that
name (OWNER_HEADER). Off a work queue two pools' filters may overlap (each consumer gets every
message), and the copy, stored to the job's own subject, reaches every such pool: only the pool
that re-published it runs it; the others ack it unrun (they ran the job in their own right).
So does a dead letter `supervisor dlq replay` sends back (it names the consumer that gave up on
it). That is `NotOurs`, in the chain off a work queue only: on a work queue a message reaches
one consumer, so one that reaches us is ours to run whatever it names (its pool renamed or gone).
"""

from __future__ import annotations

import logging
from typing import Any

import nats.js.errors

from supervisor.config import Config
from supervisor.config import schedules as sched
from workers import Job
from workers.middleware.base import Context, Duplicate, Middleware

log = logging.getLogger("worker")


OWNER_HEADER = "Supervisor-Consumer"       # the consumer whose pool runs it: a copy's (with [pools.*]), a replay's


def owner(cfg: Config) -> str:
    """Whose copies a worker makes and runs: its pool's consumer with [pools.*], else "" (none
    named: copies as they always were)."""
    return cfg.consumer.name if cfg.pools else ""


def msg_id(job: Job, made_by: str = "") -> str:
    """The Nats-Msg-Id of the copy that replaces `job` (keyed by its sequence, not its attempt: a
    second copy of one original is the same message; with pools, the same pool's)."""
    return f"retry-{job.stream}-{made_by}-{job.stream_seq}" if made_by else f"retry-{job.stream}-{job.stream_seq}"


class NotOurs(Middleware):
    """Off a work queue: a message another consumer's pool put on the stream for itself (a copy
    for later, a replayed dead letter) is acked unrun here; it runs in that pool."""

    def __init__(self, cfg: Config):
        self.consumer = cfg.consumer.name

    def before_job(self, job: Job) -> None:
        made_by = job.headers.get(OWNER_HEADER)
        if made_by is not None and made_by != self.consumer:
            raise Duplicate(f"put on the stream for consumer {made_by} (a copy for later, or a dead letter "
                            "replayed): it runs there")


class CopyWaiting(Middleware):
    def __init__(self, cfg: Config):
        self.stream = cfg.stream.name
        self.owner = owner(cfg)
        # The chain calls before_job for deliveries after the first only: nothing to look at on a
        # first (another pool's copy on a first delivery is NotOurs', in the chain off a work queue).
        self.redeliveries_only = True
        self.js: Any = None

    def setup(self, ctx: Context) -> None:
        self.js = ctx.nc.jetstream()

    async def before_job(self, job: Job) -> None:
        if job.delivery == 1:
            return
        subject = sched.delayed_subject(job.stream, msg_id(job, self.owner))
        try:
            await self.js.get_last_msg(self.stream, subject)
        except nats.js.errors.NotFoundError:
            return                                # no copy waits: this delivery is the job
        except Exception as exc:
            log.warning("seq=%d: cannot tell whether its copy for later is stored (%s); running it",
                        job.stream_seq, str(exc) or type(exc).__name__)
            return
        log.info("seq=%d delivery %d: its copy for later is stored (%s): acked unrun, the copy runs when due",
                 job.stream_seq, job.delivery, subject,
                 extra={"event": "copy_waiting", "seq": job.stream_seq, "delivery": job.delivery})
        raise Duplicate(f"its copy for later is stored ({subject})")
