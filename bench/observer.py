"""A passive witness on the bench's own connection: every ack, NAK and in-progress ping as it
crosses the server, timestamped on the bench's clock, whoever sent it.

Acks are plain publishes to the delivery's `$JS.ACK...` reply subject, so a subscription to
`$JS.ACK.JOBS.workers.>` sees them all without touching any contender. Deliveries are not
watched this way on purpose: a wildcard subscription on `_INBOX.>` gives every dead worker's
pull request interest, and the server then hands redeliveries to the dead (see
docs/BENCHMARKS.md); the handlers' journal (bench.handlers.journal) times deliveries instead.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .natsenv import CONSUMER, STREAM

ACK_PREFIX = f"$JS.ACK.{STREAM}.{CONSUMER}."


def parse_ack_subject(subject: str) -> tuple[int, int] | None:
    """(stream seq, delivery count) from a $JS.ACK subject, v1 (9 tokens) or v2 (11+)."""
    t = subject.split(".")
    at = 4 if len(t) == 9 else 6 if len(t) >= 11 else None
    if at is None:
        return None
    try:
        return int(t[at + 1]), int(t[at])
    except ValueError:
        return None


@dataclass
class Observer:
    replies: dict[int, list[tuple[float, str, int]]] = field(default_factory=lambda: defaultdict(list))
    subs: list[Any] = field(default_factory=list)

    async def start(self, nc: Any) -> Observer:
        self.subs.append(await nc.subscribe(ACK_PREFIX + ">", cb=self._on_reply))
        await nc.flush()
        return self

    async def stop(self) -> None:
        for sub in self.subs:
            await sub.unsubscribe()

    async def _on_reply(self, msg: Any) -> None:
        parsed = parse_ack_subject(msg.subject)
        if parsed:
            kind = msg.data.split(b" ", 1)[0].decode(errors="replace") or "+ACK"   # empty payload = ack
            self.replies[parsed[0]].append((time.monotonic(), kind, parsed[1]))

    def first(self, seq: int, kind: str, min_delivery: int = 1) -> float | None:
        """When the first `kind` reply for `seq` on a delivery >= min_delivery was seen."""
        return next((t for t, k, d in self.replies.get(seq, ()) if k == kind and d >= min_delivery), None)
