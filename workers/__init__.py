"""What runs inside a worker process: the handler API, the pull/ack loop, example handlers.

    from workers import Job, Retry, Reject

    def handle(job: Job) -> None: ...        # runs in a thread, off the worker's event loop
    async def handle(job: Job) -> None: ...  # runs on the worker's event loop

Return to ack; raise Retry(delay=s) to NAK with a delay; raise Reject("why") to terminate the
job and copy it to the dead-letter subject; any other exception NAKs with workers.retry_backoff.
raise Pause(seconds, "why") when what is behind the workers is down: NAK with that delay and the
consumer paused for the whole fleet until then. `with limit("NAME"):` holds [limits.NAME].
`class M(Middleware)` listed in workers.middleware wraps every job (workers/middleware/).

Delivery is at least once: a job can run twice (a worker died after its side effect, before its
ack). `with once(job, conn) as fresh:` makes a database side effect happen once (workers/once.py).
"""

from dataclasses import dataclass, field
from typing import Any

from workers.middleware.base import Context, Duplicate, Middleware
from workers.once import once


@dataclass(frozen=True)
class Job:
    data: bytes
    subject: str
    headers: dict[str, str] = field(default_factory=dict)
    stream_seq: int = 0
    consumer_seq: int = 0
    delivery: int = 1
    msg_id: str | None = None
    stream: str = ""

    @property
    def key(self) -> str:
        """The idempotency key: the publisher's Nats-Msg-Id when it set one, else "<stream>:<seq>"
        (unique only for the life of the stream: a recreated stream counts from 1 again). A copy
        re-published for a long retry delay carries its original's (header Supervisor-Key)."""
        return self.headers.get("Supervisor-Key") or self.msg_id or f"{self.stream}:{self.stream_seq}"


class Retry(Exception):
    """NAK the job; the server redelivers it after `delay` seconds. `reason` (optional) is what
    the logs and the supervisor's ledger say about the NAK."""

    def __init__(self, delay: float = 0.0, reason: str = ""):
        super().__init__(reason or f"retry in {delay:g}s")
        self.delay = max(0.0, float(delay))


class SoftTimeout(Exception):
    """Raised inside a job that ran past workers.soft_timeout: an async handler is cancelled (it
    sees CancelledError at its await; the job's outcome is SoftTimeout), a sync handler gets it
    raised in its thread at its next Python bytecode (not inside a blocking C call such as a
    sleep or a socket read: only the hard workers.job_timeout ends those). A failure for [retry]."""

    def __init__(self, message: str = "ran past workers.soft_timeout"):
        super().__init__(message)


class Pause(Retry):
    """A downstream is down: NAK the job with a delay of `seconds`, and pause the consumer for the
    whole fleet until then (the server's consumer pause: nothing is delivered to any worker of any
    supervisor; it resumes by itself). `reason` is what the log and /status `pause_reason` say."""

    def __init__(self, seconds: float, reason: str = ""):
        super().__init__(seconds, reason or f"paused for {float(seconds):g}s")
        self.reason = reason or str(self)


def limit(name: str) -> Any:
    """`with limit("NAME"):` (a sync handler) / `async with limit("NAME"):` (an async one): hold
    the fleet-wide limit [limits.NAME] for the block (workers/middleware/limits.py)."""
    from workers.middleware.limits import limit as holder  # `import workers` stays light
    return holder(name)


class Reject(Exception):
    """Terminate the job (+TERM) and copy it to restart.dead_letter_subject."""

    def __init__(self, reason: str = "rejected"):
        super().__init__(reason)
        self.reason = reason


__all__ = ["Job", "Retry", "Reject", "SoftTimeout", "Pause", "limit", "once", "Middleware", "Context",
           "Duplicate"]
