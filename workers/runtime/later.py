"""A long retry delay as a scheduled re-publish (nats-server 2.12+ message schedules, ADR-51).

A NAK with a 10-minute delay keeps the job ack-pending all that time: it holds a slot of
consumer.max_ack_pending (nats-server#6093: a consumer whose slots are all held by NAKed jobs
delivers nothing else). A delay longer than retry.republish_after is instead a copy of the job
stored now as a one-shot schedule (`@at` its due time, target: the job's own subject), then an
ack of the original. The server publishes the copy when it is due, and any worker of any
supervisor on the stream runs it: a restart in between changes nothing.

    subject      _sched.<STREAM>.at.<token of the Msg-Id>  (supervisor/config/schedules.py's
                 delayed_subject: the space the stream captures and no work consumer delivers)
    Nats-Msg-Id  retry-<STREAM>-<seq of the message it replaces>
    Supervisor-Attempts  the attempts spent so far, so [retry]'s count goes on
    Supervisor-Key       the idempotency key stays the original's (the fired copy has a sequence
                         of its own, and the server strips the schedule's Nats-Msg-Id from it)

The worker dies between the copy's PubAck and the original's ack: the parent NAKs the original,
it runs again (attempt n+1), fails again and is re-published again. Keyed by the original's
stream sequence, not by its attempt, that second copy has the first one's Nats-Msg-Id and its
subject: inside the stream's duplicate window the server drops it (PubAck duplicate: logged,
event `republish_deduped`), and the original is acked. Past the window, the same subject still
makes it one schedule while the first copy waits (a schedule is the latest message on its
subject), so a second run needs both: the first copy already fired, and the window over. The
window must therefore outlast the longest gap between the two re-publishes: the original coming
back (at once when the parent NAKs a dead worker's jobs; consumer.ack_wait when the whole
supervisor died, plus however long none runs), its next run (up to workers.job_timeout) and
the publish. `Later.usable` warns when stream.duplicate_window is shorter than ack_wait +
job_timeout. Where the stream cannot hold schedules the caller NAKs with the delay, as before.
And when the original's rerun succeeds instead of failing again, its copy must not run as well:
a redelivery whose copy is still stored is acked unrun (workers/middleware/copies.py).
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from supervisor.config import Config
from supervisor.config import schedules as sched
from supervisor.config.subjects import subject_matches
from workers import Job
from workers.middleware.copies import OWNER_HEADER, msg_id, owner
from workers.middleware.retries import ATTEMPTS_HEADER

log = logging.getLogger("worker")

KEY_HEADER = "Supervisor-Key"              # the job's idempotency key (workers.Job.key reads it first)
REASON_HEADER = "Supervisor-Retry-Reason"
PUBLISH_TIMEOUT = 5.0


def copy_of(job: Job, attempt: int, reason: str, due: dt.datetime, made_by: str = "") -> sched.ScheduleMsg:
    """The schedule: the job's data and its own headers (Nats-* are the server's, as for any
    schedule: a job a schedule fired carries Nats-Scheduler, which a client may not publish),
    plus the attempts spent, the key and why."""
    own = {k: v for k, v in job.headers.items() if not k.lower().startswith("nats-")}
    ours = {ATTEMPTS_HEADER: str(attempt), KEY_HEADER: job.key, REASON_HEADER: " ".join(reason.split())[:200],
            **({OWNER_HEADER: made_by} if made_by else {})}
    return sched.ScheduleMsg(sched.delayed_subject(job.stream, msg_id(job, made_by)), sched.at_pattern(due), job.subject,
                             job.data, tuple(sorted({**own, **ours}.items())))


async def republish_later(nc: Any, cfg: Config, job: Job, delay: float, attempt: int, reason: str) -> None:
    """Store the job again as a schedule due `delay` seconds from now (this worker's clock), with
    the attempts it has spent; raises when the stream does not take it (the caller NAKs instead).
    The original is the caller's to ack once this returned: its PubAck means the copy is stored
    (or was already: the same Msg-Id inside the duplicate window)."""
    due, made_by = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=delay), owner(cfg)
    copy, copy_id = copy_of(job, attempt, reason, due, made_by), msg_id(job, made_by)
    ack = await nc.jetstream().publish(copy.subject, copy.data, timeout=PUBLISH_TIMEOUT,
                                       headers={**copy.publish_headers(), "Nats-Msg-Id": copy_id})
    if getattr(ack, "duplicate", False):
        log.warning("seq=%d was re-published for later already (%s, an earlier delivery whose ack did not land): "
                    "the stream dropped this copy", job.stream_seq, copy_id,
                    extra={"event": "republish_deduped", "seq": job.stream_seq, "msg_id": copy_id})


async def why_not(nc: Any, cfg: Config) -> str | None:
    """Why this stream cannot hold the copies, or None when it can: schedules allowed, their
    subject space captured, and the work consumer not delivering it (a worker would take the
    copy for a job at once, and its ack would delete the schedule)."""
    if not cfg.stream.allow_schedules:
        return "stream.allow_schedules is false"
    js = nc.jetstream()
    stream = (await js.stream_info(cfg.stream.name)).config
    if not stream.allow_msg_schedules:
        return f"stream {cfg.stream.name} does not allow message schedules"
    if sched.space_filter(cfg.stream.name) not in (stream.subjects or ()):
        return f"stream {cfg.stream.name} does not capture {sched.space_filter(cfg.stream.name)}"
    consumer = (await js.consumer_info(cfg.stream.name, cfg.consumer.name)).config
    filters = consumer.filter_subjects or ([consumer.filter_subject] if consumer.filter_subject else [])
    probe = sched.delayed_subject(cfg.stream.name, "probe")
    if not filters or any(subject_matches(f, probe) for f in filters):
        return f"consumer {cfg.consumer.name} would deliver {sched.space_filter(cfg.stream.name)} as jobs"
    warn_window(cfg, stream.duplicate_window or 0.0)
    return None


def warn_window(cfg: Config, window: float) -> None:
    """A window shorter than the gap a dead worker's re-publish can have (the module's docstring)."""
    gap = cfg.consumer.ack_wait + cfg.workers.job_timeout
    if window < gap:
        log.warning("stream %s's duplicate window (%gs) is shorter than consumer.ack_wait + workers.job_timeout (%gs): "
                    "a job whose worker died between its re-publish for later and its ack may be re-published twice",
                    cfg.stream.name, window, gap, extra={"event": "republish_window_short", "window": window, "gap": gap})


class Later:
    """One worker's long delays: the stream is asked once whether it can hold the copies."""

    def __init__(self, cfg: Config, slot: int):
        self.cfg, self.slot = cfg, slot
        self.refusal: str | None = None
        self.checked = False

    def wanted(self, delay: float) -> bool:
        """A copy for later is a new message, stored after the jobs of its key that came since: with
        [ordering] it would run after them, so every delay stays a NAK (its key waits for it)."""
        after = self.cfg.retry.republish_after
        return bool(after) and delay > after and not (self.checked and self.refusal) and not self.cfg.ordering.key

    async def usable(self, nc: Any) -> bool:
        if not self.checked:
            try:
                self.refusal = await why_not(nc, self.cfg)
            except Exception as exc:              # asked again at the next long delay
                log.warning("worker %d: cannot tell whether stream %s holds message schedules (%s); NAKing "
                            "with the delay instead", self.slot, self.cfg.stream.name, str(exc) or type(exc).__name__)
                return False
            self.checked = True
            if self.refusal:
                log.warning("worker %d: retry.republish_after: long delays stay NAKs (each holds an ack-pending "
                            "slot while it waits): %s", self.slot, self.refusal,
                            extra={"event": "republish_unusable", "reason": self.refusal})
        return self.refusal is None
