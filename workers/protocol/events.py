"""The event pipe's vocabulary: what a worker tells its parent, declared once for both processes.

Rare events only (the hot path is the slot table): one JSON line each, `{"ev": kind, ...fields}`.
The worker sends them with `encode` (workers/runtime/events.py), the parent reads them with
`decode` (supervisor/parent/process.py) and dispatches on the type (parent/arbiter.py).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Ready:
    """Connected, bound to the consumer, pulling."""
    kind: ClassVar[str] = "ready"


@dataclass(frozen=True)
class Redelivered:
    """A delivery after the first reached this worker: the parent's ledger explains it."""
    kind: ClassVar[str] = "redelivered"
    seq: int
    delivery: int


@dataclass(frozen=True)
class Settled:
    """The worker acked, NAKed or terminated a job (or NAKed one its table had no room for).
    A NAK the worker published says when (`at`, the worker's monotonic clock: one clock for the
    host), with what delay, and when this delivery was held: the earliest the redelivery's
    AckWait can have started (supervisor/parent/safety/in_transit.py). 0.0: not known (table full)."""
    kind: ClassVar[str] = "settled"
    seq: int
    delivery: int
    outcome: str             # ack | nak | term | duplicate
    reason: str = ""
    at: float = 0.0
    delay: float = 0.0
    held_at: float = 0.0


@dataclass(frozen=True)
class Unsent:
    """nats-py refused the worker's ack, NAK or TERM for now: the job may come back."""
    kind: ClassVar[str] = "unsent"
    seq: int
    delivery: int
    outcome: str
    error: str


@dataclass(frozen=True)
class AcksResent:
    """Recent acks sent again after a consumer leader change (workers/runtime/reack.py)."""
    kind: ClassVar[str] = "acks_resent"
    why: str
    resent: int
    confirmed: int
    unconfirmed: tuple[int, ...] = ()


@dataclass(frozen=True)
class RecycleDue:
    """Its last job under workers.max_jobs has started: the parent starts its replacement."""
    kind: ClassVar[str] = "recycle_due"
    jobs: int


@dataclass(frozen=True)
class PauseAsked:
    """A handler raised workers.Pause: the parent pauses the consumer fleet-wide until then."""
    kind: ClassVar[str] = "pause_asked"
    seconds: float
    reason: str
    seq: int


def ledger_subject(stream: str, consumer: str) -> str:
    """Where the supervisors of one consumer share their ledgers (supervisor/parent/peers.py), and
    where an orphaned worker, whose parent can no longer announce anything, announces its own
    NAKs (workers/runtime/orphan.py): core NATS, JSON `{"origin", "naks": [[seq, why]]}` or `{"origin", "bye": 1}`;
    an orphan's also `"naked": [[seq, delivery, at, delay, held_at]], "boot": boot_id()` (its times on
    the host's monotonic clock, as in Settled) and `"fenced": 1` with its goodbye when the server
    had read every NAK it sent."""
    return f"supervisor.ledger.{stream}.{consumer}"


def boot_id() -> str:
    """This kernel's boot id ("" when unknown): processes that share it share CLOCK_MONOTONIC, so a
    time one of them sends means the same to the other."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


Event = Ready | Redelivered | Settled | Unsent | AcksResent | RecycleDue | PauseAsked
KINDS: dict[str, type[Event]] = {cls.kind: cls for cls in (Ready, Redelivered, Settled, Unsent, AcksResent, RecycleDue,
                                                           PauseAsked)}


def encode(event: Event) -> bytes:
    fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
    return json.dumps({"ev": event.kind, **fields}, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> Event:
    """One line back into its event; ValueError naming what is wrong with anything else."""
    raw: Any = json.loads(line)
    if not isinstance(raw, dict) or raw.get("ev") not in KINDS:
        raise ValueError(f"not an event: {line[:100]!r}")
    cls = KINDS[raw.pop("ev")]
    try:
        event = cls(**raw)
    except TypeError as exc:
        raise ValueError(f"{cls.kind}: {exc}") from None
    for f in dataclasses.fields(event):
        want: Any = int if f.type == "int" else str if f.type == "str" else (int, float) if f.type == "float" else None
        if want is not None and not isinstance(getattr(event, f.name), want):
            raise ValueError(f"{cls.kind}.{f.name}: expected {f.type}, got {getattr(event, f.name)!r}")
    if isinstance(event, AcksResent):
        event = dataclasses.replace(event, unconfirmed=tuple(int(s) for s in event.unconfirmed))
    return event
