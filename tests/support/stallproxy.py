"""A TCP relay between clients and a nats-server, for faults a test must place exactly:
- once `armed`, it holds back what a client writes after each PING for `stall` seconds: it
  widens, deterministically, the moment between a client's PING and whatever it wrote next (the
  window the old drain's `PING, UNSUB` race lived in);
- `blackhole(port)` stops forwarding, both ways, on the connection from that client port while
  keeping both sockets open: a half-open connection, as a dead link or a stalled NAT makes."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness import NatsServer


class StallAfterPing:
    def __init__(self, server: NatsServer, stall: float):
        self.nats, self.upstream_port, self.stall = server, server.port, stall
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.armed = False
        self.holes: set[int] = set()            # client ports whose traffic goes nowhere
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> StallAfterPing:
        self.thread.start()
        self.ready.wait(10)
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._shutdown)
        self.thread.join(10)

    def _shutdown(self) -> None:
        for task in asyncio.all_tasks(self.loop):
            task.cancel()
        self.loop.call_soon(self.loop.stop)

    def blackhole(self, client_port: int) -> None:
        self.holes.add(client_port)

    @property
    def url(self) -> str:
        """The server's URL (its credentials: harness.NatsServer) with this relay's port."""
        return self.nats.url_at(self.port)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()
        server.close()
        pending = asyncio.all_tasks(self.loop)
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()

    async def _upstream(self, client: asyncio.StreamWriter) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to the server for a new client; None (the client hung up) if it is down."""
        try:
            return await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client.close()
            return None

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if (upstream := await self._upstream(writer)) is None:
            return
        up_r, up_w = upstream
        port = writer.get_extra_info("peername")[1]
        await asyncio.gather(self._pump(reader, up_w, True, port), self._pump(up_r, writer, False, port),
                             return_exceptions=True)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, stall: bool, port: int) -> None:
        try:
            while data := await src.read(65536):
                if port in self.holes:
                    continue
                if stall and self.armed and b"PING\r\n" in data:
                    cut = data.index(b"PING\r\n") + 6
                    dst.write(data[:cut])
                    await dst.drain()
                    await asyncio.sleep(self.stall)
                    data = data[cut:]
                dst.write(data)
                await dst.drain()
        finally:
            dst.close()
