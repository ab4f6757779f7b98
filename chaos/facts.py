"""What a chaos run knows for certain, apart from anything the supervisor says.

- `Stored`: jobs the server confirmed storing (a PubAck, or found in the stream at the end).
- `Run` records: the handlers' journal (chaos/handlers.py), one line per start and per finish.
- `Fault`: each fault the runner injected, with its time window and the worker processes it
  touched (None: all of them, e.g. a server restart), and whether it is inside the
  supervisor's control (a job it touches must never wait for AckWait).
- `Handout`: each JetStream delivery the chaos proxy (chaos/proxy.py) carried from the server to
  a client connection: the connection (its name, the process that holds it), when the server
  sent it and when it was written on to the client (or never): who was handed a delivery that
  never started, and what a stalled link held.
- `Settle`, `Pull`, `Link`: what the proxy carried the other way, from a client to the server:
  each settle of a delivery on its `$JS.ACK` reply subject (+ACK, -NAK and its delay, +WPI,
  +TERM), each pull request (`$JS.API.CONSUMER.MSG.NEXT`), and each connection with when and
  how it closed: whether the server was told to redeliver a job, and to whom it can have handed
  a delivery the proxy never read (a connection closing with a pull request outstanding).
- `Life`: each worker process's first and last sighting, from the runner's process watcher, the
  supervisor (parent pid) it was forked by, and the consumer it works for (several pools: each
  pool's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Stored:
    seq: int
    key: str
    t: float                    # monotonic time its publish was sent (or of the end-of-run scan)
    order: str = ""             # its [ordering] key (its subject's third token), "" for none


def order_key(subject: str) -> str:
    """The [ordering] key the randomized runs give a job: `jobs.chaos.<key>` (subject:3)."""
    tokens = subject.split(".")
    return tokens[2] if len(tokens) > 2 else ""


@dataclass(frozen=True)
class Rec:
    event: str                  # S (started) | D (done) | R (the handler raised on purpose: retry)
    pid: int
    seq: int
    delivery: int
    t: float                    # monotonic
    wall: float
    key: str


@dataclass
class Fault:
    kind: str                   # e.g. "worker SIGKILL", "nats-server SIGSTOP"
    t0: float
    t1: float
    pids: frozenset[int] | None = None    # the workers it touched; None = every connection
    in_control: bool = True     # AckWait waits and unexplained duplicates it causes are defects
    note: str = ""
    # For deliveries that never started (on the wire, or buffered unstarted): None = as
    # in_control. False where the README says they wait for AckWait (a worker killed while a
    # peer supervisor shares the consumer: the in-transit check needs a lone supervisor).
    unstarted_in_control: bool | None = None
    conns: frozenset[int] = frozenset()   # the proxy's connections it hit (Handout.conn): a link fault
    parent: int | None = None   # the supervisor (its parent's pid) it acted on as a whole

    def controls(self, started: bool) -> bool:
        """Is a wait this fault causes the supervisor's to prevent?"""
        if started or self.unstarted_in_control is None:
            return self.in_control
        return self.unstarted_in_control

    def touches(self, pid: int, lo: float, hi: float) -> bool:
        """Did this fault act on `pid` at some moment in [lo, hi]?"""
        return (self.pids is None or pid in self.pids) and self.t0 <= hi and self.t1 >= lo

    @property
    def routine(self) -> bool:
        """A routine operation on a supervisor (SIGHUP, scale, pause: chaos/randomized.py op)."""
        return self.kind.startswith("op: ")

    def holds(self, holder: Handout, parent: int | None, lo: float, hi: float, died: float | None = None) -> bool:
        """Did this fault act, at some moment in [lo, hi], on the process or the connection that
        was handed a delivery, or on the supervisor that process belonged to (`parent`)? A
        routine operation acts on the supervisor's living workers (a reload, a scale, a pause):
        only while the holder lived (until `died`); its SIGKILL or its link also stop what it
        does for a dead worker's jobs, to the end."""
        if self.t0 > hi or self.t1 < lo:
            return False
        if self.pids is None or holder.pid in self.pids or holder.conn in self.conns:
            return True
        if parent is None or self.parent != parent:
            return False
        return not self.routine or died is None or self.t0 <= died

    def name(self, origin: float) -> str:
        who = " (every worker)" if self.pids is None else "".join(f" (pid {p})" for p in sorted(self.pids))
        who += f" (supervisor pid {self.parent})" if self.parent is not None else ""
        who += f" (connections {', '.join(f'#{c}' for c in sorted(self.conns))})" if self.conns else ""
        return f"{self.kind}{who} at +{self.t0 - origin:.2f}s" + (f": {self.note}" if self.note else "")


@dataclass(frozen=True)
class Handout:
    """A JetStream delivery the proxy carried from the server to a client (chaos/proxy.py handouts())."""
    name: str               # the client's connection name
    stream: str
    seq: int                # stream sequence
    delivery: int           # the server's delivery count
    came: float             # time.monotonic() the proxy read it from the server
    out: float | None       # when it was written on to the client; None: never (the connection closed)
    pid: int = 0            # the process holding the client's socket (0: not known)
    conn: int = 0           # the proxy's number for the connection (0: not known)
    ppid: int = 0           # that process's parent when it connected
    consumer: str = ""

    def held(self, origin: float) -> str:
        """Who was handed it, for a verdict's text."""
        out = "never written on" if self.out is None else f"written on +{self.out - origin:.2f}s"
        return (f"handed to pid {self.pid} (connection #{self.conn} {self.name!r}) +{self.came - origin:.2f}s, "
                f"{out}")


@dataclass(frozen=True)
class Settle:
    """A settle of a JetStream delivery the proxy carried from a client to the server (chaos/proxy.py
    settles()): the delivery named by its reply subject, parsed as a hand-out's is (the parent's
    in-transit NAKs name delivery 1 whatever it was: the server applies a settle to the stream
    sequence's pending delivery, whichever)."""
    kind: str               # "+ACK" | "-NAK" | "+WPI" | "+TERM" (the payload's first word)
    stream: str
    consumer: str
    seq: int
    delivery: int
    t: float                # time.monotonic() it was written on to the server
    conn: int = 0
    pid: int = 0            # the process holding the client's socket (0: not known)
    name: str = ""
    delay: float = 0.0      # a -NAK's delay, seconds (0: none)

    def said(self, origin: float) -> str:
        delay = f" (delay {self.delay:g}s)" if self.delay else ""
        return (f"{self.kind}{delay} by pid {self.pid} (connection #{self.conn} {self.name!r}) "
                f"+{self.t - origin:.2f}s")


@dataclass(frozen=True)
class Pull:
    """A pull request the proxy carried from a client to the server (chaos/proxy.py pulls())."""
    stream: str
    consumer: str
    t: float                # when written on to the server
    conn: int
    batch: int = 1
    expires: float = 0.0    # seconds; 0: none (lives until filled, or answered at once if no_wait)
    no_wait: bool = False

    def life(self) -> float:
        """How long the server keeps it waiting at most (seconds)."""
        return self.expires if self.expires else (0.0 if self.no_wait else float("inf"))


@dataclass(frozen=True)
class Link:
    """A connection through the proxy: who was on it, and when and how it closed (chaos/proxy.py links())."""
    conn: int
    name: str
    pid: int = 0
    ppid: int = 0
    closed: float | None = None
    how: str = ""           # "cut" (a rule) | "reset" | "client" (EOF, or an error) | "server" | "proxy" (its end)


@dataclass
class Life:
    pid: int
    born: float
    died: float | None = None
    consumer: str = ""          # whose worker it is (its process title; "" until it said)
    parent: int = 0             # the supervisor's pid that had forked it (0: not seen)


def read_journal(path: Path) -> list[Rec]:
    """Every whole line of the journal (a worker killed mid-write cannot leave half a line:
    each line is one write(2) of a few dozen bytes to an O_APPEND file)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        event, pid, seq, delivery, t, wall, key = line.split(" ", 6)
        out.append(Rec(event, int(pid), int(seq), int(delivery), float(t), float(wall), key))
    return out
