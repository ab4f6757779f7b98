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
                     sends back waits in the proxy). `one_way=True` (with `after`): only what the
                     server sends waits from then on, the client's own bytes flow on (a worker's NAK
                     lands, then its fence's PING and its next pull request; the PONG and the
                     redelivery wait here)

and can tell a test when something passed: `tap(pattern, to_server, to_client)` notes, from then
on, each time a connection of that name forwards one of those byte strings that way (a pull
request's `MSG.NEXT`, a `PING` to the server; a `PONG` back), and `tapped(pattern)` lists them.

What the server sends is read on through a stall and waits here, not in the kernel, so the proxy
knows each JetStream delivery it carried (stream sequence and delivery number, from its `$JS.ACK`
reply subject), when the server sent it and when it was written on to its client, or never (its
connection closed first): `handouts()`, with the connection's name and the process (pid) that
holds the client's socket, found at accept from the peer's port (/proc/net/tcp gives the socket's
inode, /proc/PID/fd the processes holding it: `socket_owner`). `late()` lists the ones that reached
their client LATE seconds or more after the server sent them, or never. That is the ground truth
the checker needs for a job that never started and came back after AckWait: who was handed that
very delivery, and whether a stall held it while its AckWait ran out (chaos/checker.py). Each
cut, stall, reset or hold notes the connections it hit (`struck(pattern, since)`: their numbers
and pids, the ones a rule closed or stalled at their CONNECT too).

The other way it reads what each client sends as NATS protocol (`Upstream`): every settle of a
delivery it carries to the server on a `$JS.ACK` reply subject (+ACK, -NAK with its delay, +WPI,
+TERM: `settles()`), every pull request (`$JS.API.CONSUMER.MSG.NEXT`, its batch and expiry:
`pulls()`), and each connection's close, when and by whom (a rule's cut, a reset, the client,
the server: `links()`). The checker reads from them whether the server was told to redeliver a
job before it came back, and which connections can have taken a delivery the proxy never read.

Runs on an asyncio loop (the chaos runner's background loop); every method is a coroutine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import re
import socket
import struct
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .facts import Handout, Link, Pull, Settle

if TYPE_CHECKING:
    from harness import NatsServer

log = logging.getLogger("chaos.proxy")
CHUNK = 65536
LATE = 1.0                  # seconds: a delivery forwarded this much after it came is noted (late())
# The reply subject of a JetStream delivery, whole (the space after it is in the same chunk):
# $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>... (9 tokens), or with a domain and an account
# hash before the stream (12; 11 from older servers), as nats-py's Msg.Metadata reads it.
# A delivery is a MSG or HMSG line whose reply-to is such a subject: a payload that names one (a
# fleet heartbeat lists its workers' held jobs' reply subjects; the parent reads it) is not.
DELIVERY = re.compile(rb"(?:^|\n)H?MSG [^ \r\n]+ [^ \r\n]+ (\$JS\.ACK\.[^ \r\n]+) ")
TAIL = 512                  # bytes kept of the last chunk: a reply subject split between two reads


@dataclass
class Sent:
    """One delivery read from the server for a connection; `out` once written on to the client."""
    conn: int
    stream: str
    consumer: str
    seq: int
    delivery: int
    came: float = 0.0
    out: float | None = None


@dataclass
class Client:
    """Who is on the other end of a connection: its CONNECT name and the process holding its
    socket; when the connection closed, and how (Link.how)."""
    conn: int
    name: str | None = None
    pid: int = 0
    ppid: int = 0
    closed: float | None = None
    how: str = ""


JS_ACK = b"$JS.ACK."
MSG_NEXT = b"$JS.API.CONSUMER.MSG.NEXT."


class Upstream:
    """What a client sends, read as NATS protocol across chunk boundaries: (subject, payload) of
    each PUB or HPUB to a `$JS.ACK.` or `$JS.API.CONSUMER.MSG.NEXT.` subject (an HPUB's payload
    without its headers); other payloads are skipped by their length, never kept."""

    def __init__(self) -> None:
        self.buf = b""
        self.body: tuple[bytes, int, int] | None = None    # (subject, header bytes, total bytes) to read
        self.skip = 0                                     # bytes of an uninteresting payload (+CRLF) to pass

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        out = []
        if self.skip:
            n = min(self.skip, len(data))
            self.skip -= n
            data = data[n:]
        buf = self.buf + data
        while buf:
            if self.body is not None:
                subject, hdr, total = self.body
                if len(buf) < total + 2:
                    break
                out.append((subject, buf[hdr:total]))
                buf, self.body = buf[total + 2:], None
                continue
            end = buf.find(b"\r\n")
            if end < 0:
                break
            line, buf = buf[:end].split(), buf[end + 2:]
            op = line[0].upper() if line else b""
            if op not in (b"PUB", b"HPUB") or len(line) < 3:
                continue
            hdr, total = (int(line[-2]), int(line[-1])) if op == b"HPUB" else (0, int(line[-1]))
            if line[1].startswith((JS_ACK, MSG_NEXT)):
                self.body = (line[1], hdr, total)
            else:
                n = min(total + 2, len(buf))
                self.skip, buf = total + 2 - n, buf[n:]
        self.buf = buf
        return out


def settle_of(subject: bytes, payload: bytes) -> tuple[str, str, str, int, int, float] | None:
    """(kind, stream, consumer, stream seq, delivery, delay in seconds) of a settle published to
    a delivery's reply subject, or None."""
    found = ack_subject(subject)
    if found is None or not payload:
        return None
    stream, consumer, seq, delivery = found
    kind, _, arg = payload.partition(b" ")
    delay = 0.0
    if kind == b"-NAK" and arg.strip():
        try:
            delay = json.loads(arg).get("delay", 0) / 1e9
        except (ValueError, AttributeError, TypeError):
            delay = 0.0                       # a Go duration string: not sent by anything here
    return kind.decode(errors="replace"), stream, consumer, seq, delivery, delay


def pull_of(subject: bytes, payload: bytes) -> tuple[str, str, int, float, bool] | None:
    """(stream, consumer, batch, expires in seconds, no_wait) of a pull request, or None."""
    tokens = subject.decode(errors="replace").split(".")
    if len(tokens) < 7:
        return None
    try:
        req = json.loads(payload) if payload.strip() else {}
    except ValueError:
        req = {}
    if not isinstance(req, dict):
        req = {}
    return (tokens[5], tokens[6], int(req.get("batch", 1)), int(req.get("expires", 0)) / 1e9,
            bool(req.get("no_wait", False)))


def deliveries(tail: bytes, data: bytes) -> list[tuple[str, str, int, int]]:
    """(stream, consumer, stream seq, delivery) of each delivery whose MSG line `data` completes."""
    out = []
    seen = tail + data
    for m in DELIVERY.finditer(seen):
        if m.end() <= len(tail):              # whole in the chunk before: noted with it
            continue
        if (parsed := ack_subject(m.group(1))) is not None:
            out.append(parsed)
    return out


def ack_subject(reply: bytes) -> tuple[str, str, int, int] | None:
    """(stream, consumer, stream seq, delivery) a `$JS.ACK` reply subject names, or None."""
    tokens = reply.split(b".")
    if len(tokens) == 9:
        stream, consumer, delivered, seq = tokens[2:6]
    elif len(tokens) >= 11:
        stream, consumer, delivered, seq = tokens[4:8]
    else:
        return None
    try:
        return stream.decode(), consumer.decode(), int(seq), int(delivered)
    except ValueError:
        return None


def socket_owner(port: int, peer_port: int) -> tuple[int, int]:
    """(pid, ppid) of the process holding the loopback TCP socket whose local port is `port` and
    whose peer's is `peer_port` ((0, 0): none found). A process forked while holding it holds it
    too until it closes it (a worker forked as its parent connects): the oldest holder is the one
    that opened it."""
    inode = socket_inode(port, peer_port)
    if not inode:
        return 0, 0
    holders = []
    link = f"socket:[{inode}]"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == link for fd in fds):
                holders.append(proc_stat(int(pid)))
        except OSError:
            continue                       # gone meanwhile, or not ours to read
    if not holders:
        return 0, 0
    _, pid, ppid = min(holders)
    return pid, ppid


def socket_inode(port: int, peer_port: int) -> int:
    want = (f":{port:04X}", f":{peer_port:04X}")
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[1].endswith(want[0]) and cols[2].endswith(want[1]) and cols[9] != "0":
                return int(cols[9])
    return 0


def proc_stat(pid: int) -> tuple[int, int, int]:
    """(start time in clock ticks since boot, pid, ppid) from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()     # the command may hold spaces and parentheses
    return int(fields[19]), pid, int(fields[1])


@dataclass(eq=False)
class Conn:
    client: tuple[asyncio.StreamReader, asyncio.StreamWriter]
    server: tuple[asyncio.StreamReader, asyncio.StreamWriter]
    who: Client
    name: str | None = None
    flowing: asyncio.Event = field(default_factory=asyncio.Event)
    down_flowing: asyncio.Event = field(default_factory=lambda: flowing())   # cleared: a one-way hold's
    tasks: list[asyncio.Task] = field(default_factory=list)
    # What the server sent, not yet written to the client: (when read, bytes, deliveries), oldest
    # first; None once the server closed its side. `more` wakes the writer.
    down: deque[tuple[float, bytes, list[Sent]] | None] = field(default_factory=deque)
    more: asyncio.Event = field(default_factory=asyncio.Event)
    upstream: Upstream = field(default_factory=Upstream)    # what the client sends, read as protocol

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


class Records:
    """What the proxy knows of its connections, and the records it keeps of what they carried."""

    def __init__(self) -> None:
        self.sent: list[Sent] = []                      # every delivery read from the server (handouts())
        self.clients: dict[int, Client] = {}            # connection number -> who is on its other end
        self.hits: list[tuple[float, str, int]] = []    # (when, pattern, connection number) a fault hit
        # Carried from clients to the server: (when, connection, what settle_of / pull_of read)
        self.settled: list[tuple[float, int, tuple[str, str, str, int, int, float]]] = []
        self.pulled: list[tuple[float, int, tuple[str, str, int, float, bool]]] = []
        self.owners: dict[int, asyncio.Future] = {}     # connection number -> its pid lookup

    async def handouts(self) -> list[Handout]:
        """Every JetStream delivery read from the server, connections closed since included, oldest
        first, with who it was for (each pid lookup done first)."""
        await self.identified(set(self.owners))
        out = []
        for s in self.sent:
            c = self.clients[s.conn]
            out.append(Handout(c.name or "?", s.stream, s.seq, s.delivery, s.came, s.out, c.pid, c.conn, c.ppid,
                               s.consumer))
        return sorted(out, key=lambda d: d.came)

    async def settles(self) -> list[Settle]:
        """Every settle of a delivery carried to the server, oldest first, with who sent it."""
        await self.identified(set(self.owners))
        return [Settle(kind, stream, consumer, seq, delivery, t, n, self.clients[n].pid, self.clients[n].name or "?",
                       delay) for t, n, (kind, stream, consumer, seq, delivery, delay) in self.settled]

    async def pulls(self) -> list[Pull]:
        """Every pull request carried to the server, oldest first."""
        return [Pull(stream, consumer, t, n, batch, expires, no_wait)
                for t, n, (stream, consumer, batch, expires, no_wait) in self.pulled]

    async def links(self) -> list[Link]:
        """Every connection accepted so far: who was on it, when and how it closed (None: open)."""
        await self.identified(set(self.owners))
        return [Link(c.conn, c.name or "?", c.pid, c.ppid, c.closed, c.how) for c in self.clients.values()]

    async def connections(self) -> list[Client]:
        """Every connection accepted so far, with who was on its other end."""
        await self.identified(set(self.owners))
        return list(self.clients.values())

    async def late(self) -> list[Handout]:
        """The deliveries forwarded to their client LATE seconds or more after the server sent
        them, or never (`out` None)."""
        return [d for d in await self.handouts() if d.out is None or d.out - d.came >= LATE]

    async def struck(self, pattern: str, since: float) -> list[Client]:
        """Who was on the connections a cut, stall, reset or hold by `pattern` hit from `since` on
        (a rule's new connections closed or stalled at their CONNECT too), each once."""
        numbers = {n for t, p, n in self.hits if p == pattern and t >= since}
        await self.identified(numbers)
        return [self.clients[n] for n in sorted(numbers)]

    async def identified(self, numbers: set[int]) -> None:
        for n in numbers:
            fut = self.owners.get(n)
            if fut is not None:
                await asyncio.wait([fut])          # never raises its error, never cancels it

    def carried(self, conn: Conn, data: bytes) -> None:
        """Note each settle and pull request `data` completes, written on to the server just now."""
        now, n = time.monotonic(), conn.who.conn
        for subject, payload in conn.upstream.feed(data):
            if subject.startswith(JS_ACK):
                if (settle := settle_of(subject, payload)) is not None:
                    self.settled.append((now, n, settle))
            elif (pull := pull_of(subject, payload)) is not None:
                self.pulled.append((now, n, pull))


class Proxy(Records):
    def __init__(self, nats: NatsServer):
        super().__init__()
        self.nats = nats
        self.upstream = ("127.0.0.1", nats.port)
        self.conns: set[Conn] = set()
        self.rules: dict[str, str] = {}       # pattern -> "cut" | "stall"
        self.taps: dict[str, tuple[tuple[bytes, ...], tuple[bytes, ...]]] = {}   # pattern -> needles noted (tap)
        self.noted: list[tuple[float, str, bytes]] = []     # (when, connection name, needle), closed ones too
        self.holds: dict[str, tuple[bytes, bool, bool]] = {}   # pattern -> (needle, after, one_way) of a hold
        self.held: list[tuple[float, str]] = []             # (when, connection name) of each hold
        self.numbers = itertools.count(1)
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
            self.closing(conn, "proxy")
            conn.close()
        self.conns.clear()

    # ------------------------------------------------------------ faults

    def matching(self, pattern: str) -> list[Conn]:
        return [c for c in self.conns if c.name is not None and re.search(pattern, c.name)]

    async def cut(self, pattern: str) -> int:
        self.rules[pattern] = "cut"
        victims = self.matching(pattern)
        self.hit(pattern, victims)
        for conn in victims:
            self.drop(conn, how="cut")
        return len(victims)

    async def stall(self, pattern: str) -> int:
        self.rules[pattern] = "stall"
        victims = self.matching(pattern)
        self.hit(pattern, victims)
        for conn in victims:
            conn.flowing.clear()
        return len(victims)

    async def reset(self, pattern: str) -> int:
        victims = self.matching(pattern)
        self.hit(pattern, victims)
        for conn in victims:
            self.drop(conn, rst=True, how="reset")
        return len(victims)

    async def heal(self, pattern: str) -> None:
        self.rules.pop(pattern, None)
        for conn in self.matching(pattern):
            conn.down_flowing.set()
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

    def hit(self, pattern: str, conns: list[Conn]) -> None:
        now = time.monotonic()
        self.hits += [(now, pattern, c.who.conn) for c in conns]

    async def waiting(self, pattern: str) -> int:
        """Deliveries the connections of that name have read from the server and not written on."""
        return sum(len(item[2]) for c in self.matching(pattern) for item in unwritten(c))

    async def hold(self, pattern: str, needle: bytes, after: bool = False, one_way: bool = False) -> None:
        self.holds[pattern] = (needle, after, one_way and after)

    async def holding(self, pattern: str) -> list[float]:
        """When a connection of that name stalled to hold a chunk (hold), oldest first."""
        return [t for t, name in self.held if re.search(pattern, name)]

    def hold_if(self, conn: Conn, to_server: bool, data: bytes, after: bool) -> None:
        """A hold whose needle `data` carries: stall the connection before forwarding it, or
        right after (`after`, nothing awaited in between: no answer can slip through), once."""
        for pattern, (needle, when, one_way) in list(self.holds.items()):
            if to_server and when == after and conn.name is not None and re.search(pattern, conn.name) \
                    and needle in data:
                del self.holds[pattern]
                self.hit(pattern, [conn])
                (conn.down_flowing if one_way else conn.flowing).clear()
                self.held.append((time.monotonic(), conn.name))

    def rule_for(self, name: str | None) -> str | None:
        rule = self.rule_of(name)
        return rule[1] if rule else None

    def rule_of(self, name: str | None) -> tuple[str, str] | None:
        """(pattern, mode) of the first rule a connection of that name falls under."""
        for pattern, mode in self.rules.items():
            if name is not None and re.search(pattern, name):
                return pattern, mode
        return None

    def drop(self, conn: Conn, rst: bool = False, how: str = "client") -> None:
        self.closing(conn, how)
        self.conns.discard(conn)
        self.never_forwarded(conn)          # now, not when the cancelled writer gets to run
        conn.close(rst)

    @staticmethod
    def closing(conn: Conn, how: str) -> None:
        """Note when and how the connection closed (the first word stands)."""
        if conn.who.closed is None:
            conn.who.closed, conn.who.how = time.monotonic(), how

    # ------------------------------------------------------------ forwarding

    async def accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            c_writer.close()                   # the server is down: so is the proxy, to the client
            return
        self.accepted += 1
        who = Client(next(self.numbers))
        self.clients[who.conn] = who
        conn = Conn((c_reader, c_writer), (s_reader, s_writer), who)
        peer = c_writer.get_extra_info("peername")     # looked up in a thread (queue_to_client waits)
        self.owners[who.conn] = asyncio.ensure_future(identify(who, peer[1] if peer else 0, self.port))
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
        conn.name = conn.who.name = connect_name(first)
        rule = self.rule_of(conn.name)
        mode = rule[1] if rule else None
        if rule:
            self.hit(rule[0], [conn])
        if not first or mode == "cut":
            self.drop(conn, how="cut" if first else "client")
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
                self.carried(conn, data)
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
                now = time.monotonic()
                found = [Sent(conn.who.conn, *d, came=now) for d in deliveries(tail, data)]
                self.sent += found
                conn.down.append((now, data, found))
                conn.more.set()
                tail = (tail + data)[-TAIL:]
        except (ConnectionError, OSError):
            pass
        conn.down.append(None)
        conn.more.set()

    async def queue_to_client(self, conn: Conn) -> None:
        """Write on what the server sent, in order, whenever the connection flows; close both sides
        after the server's end (when it flows: a stalled client must not see the close either).
        Nothing goes on before the client's pid is known: a client waits for the server's INFO
        before it sends CONNECT, so its socket is still open then (a rule's cut at CONNECT closes
        it at once)."""
        _, writer = conn.client
        tail = b""
        # asyncio.wait: a drop cancels this task, and must not cancel the lookup with it (an
        # awaited task is cancelled with its awaiter; handouts() would raise CancelledError).
        await asyncio.wait([self.owners[conn.who.conn]])
        try:
            while True:
                while not conn.down:
                    conn.more.clear()
                    await conn.more.wait()
                await conn.flowing.wait()
                await conn.down_flowing.wait()
                if not conn.flowing.is_set():
                    continue                   # stalled meanwhile: look again
                item = conn.down[0]            # left in `down` until written: unwritten() sees it
                if item is None:
                    self.closing(conn, "server")
                    break
                _, data, found = item
                writer.write(data)             # from here it may reach the client: noted as out
                conn.down.popleft()
                now = time.monotonic()
                for s in found:
                    s.out = now
                await writer.drain()
                tail = self.note(conn, False, tail, data)
        except (ConnectionError, OSError):
            pass
        finally:
            if conn in self.conns:
                self.drop(conn)

    def never_forwarded(self, conn: Conn) -> None:
        """The connection is closing: what it still had for its client never reaches it (`out`
        stays None)."""
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


async def identify(who: Client, peer_port: int, port: int) -> None:
    """The pid of the client's process, while its connection is still open (a few tries: the
    kernel lists the socket at once, the process may be mid-fork)."""
    loop = asyncio.get_running_loop()
    for _ in range(3 if peer_port else 0):
        who.pid, who.ppid = await loop.run_in_executor(None, socket_owner, peer_port, port)
        if who.pid:
            return
        await asyncio.sleep(0.01)


def flowing() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


def unwritten(conn: Conn) -> list[tuple[float, bytes, list[Sent]]]:
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
