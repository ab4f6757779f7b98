"""What runs inside a worker process: the handler API, the pull/ack loop, example handlers.

    from workers import Job, Retry, Reject

    def handle(job: Job) -> None: ...        # runs in a thread, off the worker's event loop
    async def handle(job: Job) -> None: ...  # runs on the worker's event loop

Return to ack; raise Retry(delay=s) to NAK with a delay; raise Reject("why") to terminate the
job and copy it to the dead-letter subject; any other exception NAKs with workers.retry_backoff.
`class M(Middleware)` listed in workers.middleware wraps every job (workers/middleware/).

Delivery is at least once: a job can run twice (a worker died after its side effect, before its
ack). `with once(job, conn) as fresh:` makes a database side effect happen once (workers/once.py).
"""

from dataclasses import dataclass, field

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
        (unique only for the life of the stream: a recreated stream counts from 1 again)."""
        return self.msg_id if self.msg_id else f"{self.stream}:{self.stream_seq}"


class Retry(Exception):
    """NAK the job; the server redelivers it after `delay` seconds. `reason` (optional) is what
    the logs and the supervisor's ledger say about the NAK."""

    def __init__(self, delay: float = 0.0, reason: str = ""):
        super().__init__(reason or f"retry in {delay:g}s")
        self.delay = max(0.0, float(delay))


class Reject(Exception):
    """Terminate the job (+TERM) and copy it to restart.dead_letter_subject."""

    def __init__(self, reason: str = "rejected"):
        super().__init__(reason)
        self.reason = reason


__all__ = ["Job", "Retry", "Reject", "once", "Middleware", "Context", "Duplicate"]
