"""A TCP relay between NATS clients and a nats-server that can cut some clients off for a while:
`cut(name_part, seconds)` drops everything the matching clients (by the `name` in their CONNECT)
write for `seconds` (what the server sends them still arrives), then closes their connections,
so they reconnect through the relay. Acks a client sends meanwhile are lost for sure, and the
client cannot know: the way an ack dies with a connection, made deterministic.
`refuse(name_part)` ... `admit()` keeps the matching clients disconnected (reconnecting) instead:
what they publish meanwhile waits in nats-py's reconnect buffer."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

from stallproxy import StallAfterPing

if TYPE_CHECKING:
    from harness import NatsServer


class Link:
    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter):
        self.client, self.upstream = client, upstream
        self.name = ""
        self.head = b""              # the client's first bytes, until its CONNECT line is read
        self.cut = False

    def learn_name(self, data: bytes) -> None:
        if self.name or len(self.head) > 65536:
            return
        self.head += data
        for line in self.head.split(b"\r\n"):
            if line.startswith(b"CONNECT "):
                self.name = json.loads(line[8:]).get("name", "") or "?"

    def close(self) -> None:
        self.client.close()
        self.upstream.close()


class CutProxy(StallAfterPing):
    """stallproxy's relay (thread, loop, start, stop, url) with this fault instead."""

    def __init__(self, server: NatsServer):
        super().__init__(server, stall=0.0)
        self.links: list[Link] = []
        self.dropped = b""           # what the cut clients wrote, for the test to inspect
        self.refusing = ""           # clients named *this* are hung up on, reconnects included (refuse)

    def cut(self, name_part: str, seconds: float) -> list[str]:
        """Blocks for `seconds`; returns the names of the connections it cut."""
        names = self.hold(name_part)
        time.sleep(seconds)          # how long the clients talk into the void: the point of the tool
        self.release(name_part)
        return names

    def hold(self, name_part: str) -> list[str]:
        """From now on drop what the matching connections write (until `release`); their names."""
        names = asyncio.run_coroutine_threadsafe(self._mark(name_part, True), self.loop).result(10)
        assert names, f"no connection named *{name_part}* to cut"
        return names

    def release(self, name_part: str) -> None:
        """Close the held connections (their clients reconnect through the relay)."""
        asyncio.run_coroutine_threadsafe(self._mark(name_part, False), self.loop).result(10)

    def refuse(self, name_part: str) -> list[str]:
        """Hang up on the matching clients now, and on each of their reconnects (once its CONNECT
        names it) until `admit()`: they stay disconnected, reconnecting, for as long as the test
        needs. Returns the names of the connections it closed."""
        return asyncio.run_coroutine_threadsafe(self._refuse(name_part), self.loop).result(10)

    def admit(self) -> None:
        self.refusing = ""

    async def _refuse(self, name_part: str) -> list[str]:
        self.refusing = name_part
        hit = [link for link in self.links if name_part in link.name]
        for link in hit:
            link.close()
            self.links.remove(link)
        return [link.name for link in hit]

    async def _mark(self, name_part: str, cut: bool) -> list[str]:
        hit = [link for link in self.links if name_part in link.name and link.cut != cut]
        for link in hit:
            link.cut = cut
            if not cut:
                link.close()
                self.links.remove(link)
        return [link.name for link in hit]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if (upstream := await self._upstream(writer)) is None:
            return
        up_r, up_w = upstream
        link = Link(writer, up_w)
        self.links.append(link)
        await asyncio.gather(self._from_client(link, reader), self._to_client(link, up_r), return_exceptions=True)
        link.close()
        if link in self.links:
            self.links.remove(link)

    async def _from_client(self, link: Link, src: asyncio.StreamReader) -> None:
        while data := await src.read(65536):
            link.learn_name(data)
            if self.refusing and self.refusing in link.name:
                link.close()
                return
            if link.cut:
                self.dropped += data
                continue
            link.upstream.write(data)
            await link.upstream.drain()

    async def _to_client(self, link: Link, src: asyncio.StreamReader) -> None:
        while data := await src.read(65536):
            link.client.write(data)
            await link.client.drain()
