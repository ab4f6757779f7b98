"""Copying a job to the dead-letter subject: a worker's Reject, and the parent's poison and
max-deliver copies, all through this one function. The copy names the consumer that gave up
on the job (`Supervisor-Dead-Letter-Consumer`): `supervisor dlq replay` sends it back to that
consumer's pool alone (supervisor/cli/dlq.py)."""

from __future__ import annotations

import logging
from typing import Any

from workers import Job
from workers.middleware.copies import owner

dead_log = logging.getLogger("supervisor.dead_letter")   # worker Rejects, poison jobs, max deliveries

DLQ_HEADER = "Supervisor-Dead-Letter-"
# Headers the server acts on when a client publishes them, so a copy must not carry them: a job a
# message schedule fired has Nats-Scheduler and Nats-Schedule-Next, which a client may publish
# only to purge that schedule (anything else the server refuses: the copy failed, and a Reject
# became a NAK for ever). The schedule that fired the job is kept under our own name.
SERVER_ACTS_ON = ("Nats-Msg-Id", "Nats-Scheduler", "Nats-Schedule-Next", "Nats-TTL", "Nats-Rollup")


async def dead_letter(nc: Any, cfg: Any, job: Job, reason: str, extra: dict[str, str] | None = None) -> None:
    """Copy a job to restart.dead_letter_subject with headers that say where it came from and why.

    With a dead-letter stream the copy is confirmed by a PubAck before the caller TERMs the
    original; without one it is a plain publish for whoever listens."""
    subject = cfg.restart.dead_letter_subject
    if not subject:
        return
    headers = {k: v for k, v in job.headers.items() if k not in SERVER_ACTS_ON and not k.startswith("Nats-Expected-")}
    if job.msg_id:
        headers[DLQ_HEADER + "Msg-Id"] = job.msg_id
    if job.headers.get("Nats-Scheduler"):
        headers[DLQ_HEADER + "Scheduler"] = job.headers["Nats-Scheduler"]
    headers.update({
        DLQ_HEADER + "Stream": cfg.stream.name,
        DLQ_HEADER + "Consumer": cfg.consumer.name,
        DLQ_HEADER + "Sequence": str(job.stream_seq),
        DLQ_HEADER + "Subject": job.subject,
        DLQ_HEADER + "Deliveries": str(job.delivery),
        DLQ_HEADER + "Reason": reason[:500],
    })
    headers.update(extra or {})
    # A worker that dies between this copy and its TERM copies again on redelivery: the
    # dead-letter stream's duplicate window folds the two into one. With pools, per consumer:
    # off a work queue two pools' filters may overlap, and each pool gives up on its own copy
    # of the message (the second would be folded into the first, and its pool's replay lost).
    made_by = owner(cfg)
    headers["Nats-Msg-Id"] = f"dlq-{cfg.stream.name}-{made_by}-{job.stream_seq}" if made_by \
        else f"dlq-{cfg.stream.name}-{job.stream_seq}"
    if cfg.restart.dead_letter_stream:
        await nc.jetstream().publish(subject, job.data, headers=headers, timeout=5.0)
    else:
        await nc.publish(subject, job.data, headers=headers)
    dead_log.warning("job seq=%d subject=%s dead-lettered to %s: %s", job.stream_seq, job.subject, subject, reason,
                     extra={"event": "dead_letter", "seq": job.stream_seq, "subject": job.subject, "to": subject,
                            "reason": reason})
