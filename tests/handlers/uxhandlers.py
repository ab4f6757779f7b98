"""Handlers for tests/integration/test_dlq.py, logging to $JOBS_LOG like tests/handlers/testhandlers.py."""

import os

from testhandlers import _log

from workers import Job, Reject


def reject_unless_replayed(job: Job) -> None:
    """Reject a job the first time; run it when it comes back from `supervisor dlq replay`.
    The log line's data is the payload and the job's Trace-Id header, to show it survived."""
    if "Supervisor-Replayed-From" not in job.headers:
        raise Reject(f"bad payload {job.data.decode()}")
    tagged = Job(data=job.data + b" trace=" + job.headers.get("Trace-Id", "-").encode(), subject=job.subject,
                 headers=job.headers, stream_seq=job.stream_seq, delivery=job.delivery)
    _log("start", tagged)
    _log("done", tagged)


def reject_unless_replayed_v2(job: Job) -> None:
    """`reject_unless_replayed` whose log lines say "v2:": which pool's handler ran a replay."""
    reject_unless_replayed(Job(data=b"v2:" + job.data, subject=job.subject, headers=job.headers,
                               stream_seq=job.stream_seq, delivery=job.delivery))


def always_fail(job: Job) -> None:
    raise RuntimeError(f"failing delivery {job.delivery} of seq {job.stream_seq} on purpose (pid {os.getpid()})")
