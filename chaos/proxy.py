"""A loopback TCP proxy between NATS clients and one nats-server, that can misbehave on cue.

It reads each client's first command (CONNECT {...,"name":...}) to learn who the connection
belongs to: the supervisor's parent connects as `nats.name`, each worker as
`<nats.name> worker <slot>`. Faults then target connections by a regular expression on that
name (`^jetstream-supervisor$` is the parent alone):

    cut(pattern)     close both sides now, and close every new connection of that name
                     after its CONNECT until heal(): a partition that clients notice
    stall(pattern)   stop forwarding in both directions, sockets kept open: a half-open
                     connection nobody notices until a ping goes unanswered
    reset(pattern)   abort with an RST, once (clients reconnect through the proxy at once)
    heal(pattern)    lift cut/stall rules; stalled connections flow again
    hold(pattern, needle)   stall a connection of that name right before it forwards, to the
                     server, the next chunk holding `needle` (a worker's `-NAK`): the chunk waits
                     in the proxy; heal() delivers it late, reset() throws it away with the
                     connection (`holding(pattern)`: when each hold began). `after=True`: right
                     after forwarding it instead (a pull request reaches the server; what it
                     sends back waits in the proxy)

and can tell a test when something passed: `tap(pattern, to_server, to_client)` notes, from then
on, each time a connection of that name forwards one of those byte strings that way (a pull
request's `MSG.NEXT`, a `PING` to the server; a `PONG` back), and `tapped(pattern)` lists them.

What the server sends is read on through a stall and waits here, not in the kernel, so the proxy
knows each JetStream delivery a stall kept from its client: `late()` lists every delivery (stream
sequence and delivery number, from its `$JS.ACK` reply subject) that reached the client LATE
seconds or more after the server sent it, or never (its connection closed first). That is the
ground truth the checker needs for a job that never started and came back after AckWait: the
stall held that very delivery while its AckWait ran out (chaos/checker.py).

Runs on an asyncio loop (the chaos runner's background loop); every method is a coroutine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .facts import Late

if TYPE_CHECKING:
    from harness import NatsServer

log = logging.getLogger("chaos.proxy")
CHUNK = 65536
LATE = 1.0                  # seconds: a delivery forwarded this much after it came is noted (late())
# The reply subject of a JetStream delivery, whole (the space after it is in the same chunk):
# $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>... (9 tokens), or with a domain and an account
# hash before the stream (12; 11 from older servers), as nats-py's Msg.Metadata reads it.
ACK_REPLY = re.compile(rb"\$JS\.ACK\.[^ \r\n]+(?= )")
TAIL = 512                  # bytes kept of the last chunk: a reply subject split between two reads


def deliveries(tail: bytes, data: bytes) -> list[tuple[str, int, int]]:
    """(stream, stream seq, delivery) of each delivery whose reply subject `data` completes."""
    out = []
    seen = tail + data
    for m in ACK_REPLY.finditer(seen):
        if m.end() <= len(tail):              # whole in the chunk before: noted with it
            continue
        tokens = m.group().split(b".")
        if len(tokens) == 9:
            stream, delivered, seq = tokens[2], tokens[4], tokens[5]
        elif len(tokens) >= 11:
            stream, delivered, seq = tokens[4], tokens[6], tokens[7]
        else:
            continue
        out.append((stream.decode(), int(seq), int(delivered)))
    return out


@dataclass(eq=False)
class Conn:
    client: tuple[asyncio.StreamReader, asyncio.StreamWriter]
    server: tuple[asyncio.StreamReader, asyncio.StreamWriter]
    name: str | None = None
    flowing: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task] = field(default_factory=list)
    # What the server sent, not yet written to the client: (when read, bytes, deliveries), oldest
    # first; None once the server closed its side. `more` wakes the writer.
    down: deque[tuple[float, bytes, list[tuple[str, int, int]]] | None] = field(default_factory=deque)
    more: asyncio.Event = field(default_factory=asyncio.Event)

    def close(self, rst: bool = False) -> None:
        for _, writer in (self.client, self.server):
            if rst:
                sock = writer.get_extra_info("socket")
                if sock is not None:   # linger 0: close() sends RST instead of FIN
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            if rst:
                writer.transport.abort()
            else:
                writer.close()
        for task in self.tasks:
            task.cancel()


class Proxy:
    def __init__(self, nats: NatsServer):
        self.nats = nats
        self.upstream = ("127.0.0.1", nats.port)
        self.conns: set[Conn] = set()
        self.rules: dict[str, str] = {}       # pattern -> "cut" | "stall"
        self.taps: dict[str, tuple[tuple[bytes, ...], tuple[bytes, ...]]] = {}   # pattern -> needles noted (tap)
        self.noted: list[tuple[float, str, bytes]] = []     # (when, connection name, needle), closed ones too
        self.holds: dict[str, tuple[bytes, bool]] = {}     # pattern -> (needle, after) of a hold
        self.held: list[tuple[float, str]] = []             # (when, connection name) of each hold
        self.lates: list[Late] = []                     # deliveries forwarded late or never (late())
        self.server: asyncio.AbstractServer | None = None
        self.port = 0
        self.accepted = 0

    @property
    def url(self) -> str:
        """The server's URL (its credentials: harness.NatsServer) with the proxy's port."""
        return self.nats.url_at(self.port)

    async def start(self) -> Proxy:
        self.server = await asyncio.start_server(self.accept, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self.server:
            self.server.close()
        for conn in list(self.conns):
            conn.close()
        self.conns.clear()

    # ------------------------------------------------------------ faults

    def matching(self, pattern: str) -> list[Conn]:
        return [c for c in self.conns if c.name is not None and re.search(pattern, c.name)]

    async def cut(self, pattern: str) -> int:
        self.rules[pattern] = "cut"
        victims = self.matching(pattern)
        for conn in victims:
            self.drop(conn)
        return len(victims)

    async def stall(self, pattern: str) -> int:
        self.rules[pattern] = "stall"
        victims = self.matching(pattern)
        for conn in victims:
            conn.flowing.clear()
        return len(victims)

    async def reset(self, pattern: str) -> int:
        victims = self.matching(pattern)
        for conn in victims:
            self.drop(conn, rst=True)
        return len(victims)

    async def heal(self, pattern: str) -> None:
        self.rules.pop(pattern, None)
        for conn in self.matching(pattern):
            if self.rule_for(conn.name) is None:
                conn.flowing.set()

    async def count(self, pattern: str) -> int:
        """Connections of that name still open (a heal lets stale ones read their EOF and close)."""
        return len(self.matching(pattern))

    async def tap(self, pattern: str, to_server: tuple[bytes, ...], to_client: tuple[bytes, ...] = ()) -> None:
        self.taps[pattern] = (to_server, to_client)

    async def tapped(self, pattern: str) -> list[tuple[float, bytes]]:
        """What the connections of that name (closed ones too) forwarded of their tap's needles,
        oldest first: (time.monotonic() once written on, needle), one per occurrence."""
        return [(t, needle) for t, name, needle in self.noted if re.search(pattern, name)]

    async def late(self) -> list[Late]:
        """Every JetStream delivery forwarded to its client LATE seconds or more after the server
        sent it, or never (`out` None), connections closed since included, oldest first."""
        return sorted(self.lates, key=lambda d: d.came)

    async def waiting(self, pattern: str) -> int:
        """Deliveries the connections of that name have read from the server and not written on."""
        return sum(len(item[2]) for c in self.matching(pattern) for item in unwritten(c))

    async def hold(self, pattern: str, needle: bytes, after: bool = False) -> None:
        self.holds[pattern] = (needle, after)

    async def holding(self, pattern: str) -> list[float]:
        """When a connection of that name stalled to hold a chunk (hold), oldest first."""
        return [t for t, name in self.held if re.search(pattern, name)]

    def hold_if(self, conn: Conn, to_server: bool, data: bytes, after: bool) -> None:
        """A hold whose needle `data` carries: stall the connection before forwarding it, or
        right after (`after`, nothing awaited in between: no answer can slip through), once."""
        for pattern, (needle, when) in list(self.holds.items()):
            if to_server and when == after and conn.name is not None and re.search(pattern, conn.name) \
                    and needle in data:
                del self.holds[pattern]
                conn.flowing.clear()
                self.held.append((time.monotonic(), conn.name))

    def rule_for(self, name: str | None) -> str | None:
        for pattern, mode in self.rules.items():
            if name is not None and re.search(pattern, name):
                return mode
        return None

    def drop(self, conn: Conn, rst: bool = False) -> None:
        self.conns.discard(conn)
        self.never_forwarded(conn)          # now, not when the cancelled writer gets to run
        conn.close(rst)

    # ------------------------------------------------------------ forwarding

    async def accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            c_writer.close()                   # the server is down: so is the proxy, to the client
            return
        self.accepted += 1
        conn = Conn((c_reader, c_writer), (s_reader, s_writer))
        conn.flowing.set()
        self.conns.add(conn)
        conn.tasks = [asyncio.ensure_future(self.client_to_server(conn)),
                      asyncio.ensure_future(self.server_to_queue(conn)),
                      asyncio.ensure_future(self.queue_to_client(conn))]

    async def client_to_server(self, conn: Conn) -> None:
        """The first line a NATS client sends is CONNECT: learn the name, apply the rules."""
        reader, _ = conn.client
        _, writer = conn.server
        try:
            first = await reader.readline()
        except (ConnectionError, asyncio.LimitOverrunError, ValueError):
            first = b""
        conn.name = connect_name(first)
        mode = self.rule_for(conn.name)
        if not first or mode == "cut":
            self.drop(conn)
            return
        if mode == "stall":
            conn.flowing.clear()
        await conn.flowing.wait()
        writer.write(first)
        await self.pump(conn, reader, writer)

    async def pump(self, conn: Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tail = b""                             # the last chunk's end: a needle split between two reads
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                self.hold_if(conn, reader is conn.client[0], data, after=False)
                await conn.flowing.wait()      # a stall holds what was read; the kernel buffers the rest
                writer.write(data)
                self.hold_if(conn, reader is conn.client[0], data, after=True)
                await writer.drain()
                tail = self.note(conn, reader is conn.client[0], tail, data)
        except (ConnectionError, OSError):
            pass                               # either side went away: the other follows below
        finally:
            if conn in self.conns:
                self.drop(conn)

    async def server_to_queue(self, conn: Conn) -> None:
        """Read what the server sends as it comes, a stall or not (it waits in `conn.down`): the
        client sees exactly what it would through a stalled socket, and each delivery's arrival
        here is known."""
        reader, _ = conn.server
        tail = b""
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                conn.down.append((time.monotonic(), data, deliveries(tail, data)))
                conn.more.set()
                tail = (tail + data)[-TAIL:]
        except (ConnectionError, OSError):
            pass
        conn.down.append(None)
        conn.more.set()

    async def queue_to_client(self, conn: Conn) -> None:
        """Write on what the server sent, in order, whenever the connection flows; close both sides
        after the server's end (when it flows: a stalled client must not see the close either)."""
        _, writer = conn.client
        tail = b""
        try:
            while True:
                while not conn.down:
                    conn.more.clear()
                    await conn.more.wait()
                await conn.flowing.wait()
                item = conn.down[0]            # left in `down` until written: unwritten() sees it
                if item is None:
                    break
                came, data, found = item
                writer.write(data)             # from here it may reach the client: noted as out
                conn.down.popleft()
                self.noted_late(conn, came, found, time.monotonic())
                await writer.drain()
                tail = self.note(conn, False, tail, data)
        except (ConnectionError, OSError):
            pass
        finally:
            if conn in self.conns:
                self.drop(conn)

    def noted_late(self, conn: Conn, came: float, found: list[tuple[str, int, int]], out: float | None) -> None:
        if found and (out is None or out - came >= LATE):
            self.lates += [Late(conn.name or "?", stream, seq, d, came, out) for stream, seq, d in found]

    def never_forwarded(self, conn: Conn) -> None:
        """The connection is closing: what it still had for its client never reached it."""
        for came, _, found in unwritten(conn):
            self.noted_late(conn, came, found, None)
        conn.down.clear()

    def note(self, conn: Conn, to_server: bool, tail: bytes, data: bytes) -> bytes:
        """Note each tapped needle `data` completes (written on just now); the tail to keep."""
        name = conn.name
        tap = next((t for p, t in self.taps.items() if name is not None and re.search(p, name)), None)
        needles = () if tap is None else tap[0 if to_server else 1]
        if not needles or name is None:
            return b""
        now, seen = time.monotonic(), tail + data
        for needle in needles:
            at = seen.find(needle)
            while at >= 0:
                if at + len(needle) > len(tail):           # not noted with the chunk before
                    self.noted.append((now, name, needle))
                at = seen.find(needle, at + 1)
        keep = max(map(len, needles)) - 1
        return seen[len(seen) - keep:] if keep else b""


def unwritten(conn: Conn) -> list[tuple[float, bytes, list[tuple[str, int, int]]]]:
    """What the server sent that has not been written to the client yet, oldest first."""
    return [item for item in conn.down if item is not None]


def connect_name(line: bytes) -> str | None:
    """The `name` of a `CONNECT {json}` line, or None."""
    if not line.startswith(b"CONNECT "):
        return None
    try:
        return json.loads(line[8:]).get("name")
    except ValueError:
        return None
