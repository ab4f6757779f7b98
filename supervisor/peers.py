"""Ledgers shared between supervisors on one consumer.

With a supervisor per host against one cluster, a job that host A NAKs (its dead worker held
it, or its handler failed) may be redelivered to a worker on host B. B's ledger would call that
redelivery unexplained. So every supervisor announces the NAKs it knows of on
`supervisor.ledger.<stream>.<consumer>` (core NATS, a few small messages per crash) and takes
its peers' announcements as expectations. A death is announced before its NAKs are sent, and a
redelivery nothing explains stays a suspect for SUSPECT_GRACE before it counts.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from typing import Any

log = logging.getLogger("supervisor.peers")

SUSPECT_GRACE = 2.0     # seconds a peer has to explain a redelivery before it counts as unexplained
CHUNK = 500             # NAKs per announcement


class Peers:
    def __init__(self, nc: Any, stream: str, consumer: str, ledger: Any):
        self.nc = nc
        self.ledger = ledger
        self.subject = f"supervisor.ledger.{stream}.{consumer}"
        self.origin = f"{socket.gethostname()}/{os.getpid()}"
        self.outbox: list[tuple[int, str]] = []
        self.warned = False

    async def start(self) -> None:
        try:
            await self.nc.subscribe(self.subject, cb=self.on_message)
        except Exception as exc:
            log.warning("cannot subscribe to %s (%s): redeliveries caused by other supervisors will read as "
                        "unexplained", self.subject, exc)

    def announce(self, seq: int, why: str) -> None:
        self.outbox.append((seq, why))

    async def flush(self) -> None:
        if not self.outbox or not self.nc.is_connected:
            return
        batch, self.outbox = self.outbox, []
        try:
            for i in range(0, len(batch), CHUNK):
                body = {"origin": self.origin, "naks": batch[i:i + CHUNK]}
                await self.nc.publish(self.subject, json.dumps(body, separators=(",", ":")).encode())
        except Exception as exc:
            if not self.warned:
                log.warning("cannot announce NAKs on %s: %s", self.subject, exc)
                self.warned = True

    async def on_message(self, msg: Any) -> None:
        try:
            body = json.loads(msg.data)
            origin, naks = str(body["origin"]), [(int(seq), str(why)) for seq, why in body["naks"]]
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring a malformed ledger message on %s: %r", self.subject, msg.data[:100])
            return
        if origin == self.origin:
            return
        for seq, why in naks:
            if self.ledger.expect(seq, f"{why} (on {origin})"):
                log.info("job seq=%d, redelivered here a moment ago, is explained: %s (on %s)", seq, why, origin)
