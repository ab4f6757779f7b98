"""Two faults of the parent's own NATS link, placed exactly (issue 22):

- `StallOnWrite`: the first time a client writes `trigger` (say the stream-message GET the
  in-transit scan sends) once armed, that client's connection stalls, both ways, for `stall`
  seconds, then flows again: a half-open link during the scan, at the scan.
- `Refuse`: clients whose CONNECT name is `name` are cut off (their connection closed) and
  every reconnection of theirs is closed as soon as it says its name, until `allow()`. The
  client knows it is disconnected (nats-py reconnecting), unlike a stall: it buffers.

Both are tests/stallproxy.py's relay (a thread running its own loop) with another pump.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from cutproxy import CutProxy, Link
from stallproxy import StallAfterPing

if TYPE_CHECKING:
    from harness import NatsServer


class StallOnWrite(StallAfterPing):
    def __init__(self, server: NatsServer, trigger: bytes, stall: float, unless: bytes = b"\0"):
        super().__init__(server, stall)
        self.trigger, self.unless = trigger, unless    # fire on a write holding `trigger` and not `unless`
        self.fired_at: float | None = None
        self.stalled_until: dict[int, float] = {}      # client port -> when its link flows again

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, stall: bool, port: int) -> None:
        try:
            while data := await src.read(65536):
                if stall and self.armed and self.trigger in data and self.unless not in data:
                    self.armed = False
                    self.fired_at = time.monotonic()
                    self.stalled_until[port] = self.fired_at + self.stall
                wait = self.stalled_until.get(port, 0.0) - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()
        finally:
            dst.close()


class Refuse(CutProxy):
    def __init__(self, server: NatsServer):
        super().__init__(server)
        self.refused: str | None = None
        self.turned_away = 0

    def refuse(self, name: str) -> None:
        asyncio.run_coroutine_threadsafe(self._refuse(name), self.loop).result(10)

    def allow(self) -> None:
        self.refused = None

    async def _refuse(self, name: str) -> None:
        self.refused = name
        for link in [link for link in self.links if link.name == name]:
            link.close()

    async def _from_client(self, link: Link, src: asyncio.StreamReader) -> None:
        while data := await src.read(65536):
            link.learn_name(data)
            if self.refused is not None and link.name == self.refused:
                self.turned_away += 1
                link.close()
                return
            link.upstream.write(data)
            await link.upstream.drain()
