"""The KV layout of fleet-wide limits ([limits.NAME]) and pauses, read by both sides: the workers
take and give back slots (workers/middleware/limits.py), the parent releases a dead worker's
and reports what is in use (supervisor/nats/limits.py). Pure, and imports nothing of ours.

One bucket (`fleet.limits_bucket`, history 1, per-message TTLs allowed) holds, per limit NAME:

    NAME.c.K   K = 0 .. concurrency-1: a concurrency slot. Absent = free. Taken by a write that
               expects the key to have no message ("expected last subject sequence 0"), with a
               Nats-TTL of LEASE_TTL; renewed every RENEW_EVERY by a write that expects our own
               revision; given back by purging the key up to our revision (a purge of "sequence
               < ours + 1" cannot remove a later holder's lease), so the key is absent again.
    NAME.r.K   K = 0 .. keys-1 (rate_window): a start. Taken like a slot, with a Nats-TTL of the
               window's seconds, and never given back: the server removes it when the window has
               passed. Each key can be taken at most once per window, so no window of that many
               seconds holds more than `keys` starts: rate x seconds.
    pause.STREAM.CONSUMER   why the consumer is paused (JSON), beside the server's own pause.

Who holds a slot is in its value (`holder_value`): the host, the supervisor's pid and the
worker's, so a parent can find and release the slots of a worker that died (it knows every death
at once); the TTL frees those of a host that died with its parent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LEASE_TTL = 10            # seconds a slot outlives its holder's last renewal: longer than a KV leader election
RENEW_EVERY = 2.0         # a held slot is renewed this often (4 chances before its TTL runs out)
MAX_WINDOW = 60           # a rate's window is at most this many seconds (see rate_window)


def slot_key(name: str, k: int) -> str:
    return f"{name}.c.{k}"


def rate_key(name: str, k: int) -> str:
    return f"{name}.r.{k}"


def freed_subject(bucket: str, name: str) -> str:
    """Core NATS: a holder that gives a slot back says so here (its index as the payload), so
    waiting workers try it at once instead of at their next poll."""
    return f"_SUPERVISOR.limits.{bucket}.{name}.freed"


def wanted_subject(bucket: str, name: str) -> str:
    """Core NATS: a worker that found the limit full says so here while it waits (its holder's
    nonce as the payload), so holders elsewhere give each slot back to the fleet when its job
    ends instead of passing it to a job of their own."""
    return f"_SUPERVISOR.limits.{bucket}.{name}.wanted"


def words_subject(bucket: str) -> str:
    """Both words of every limit of the bucket, for one subscription."""
    return f"_SUPERVISOR.limits.{bucket}.*.*"


def pause_key(stream: str, consumer: str) -> str:
    return f"pause.{stream}.{consumer}"


def rate_window(rate: float) -> tuple[int, int]:
    """(keys, seconds): `keys` starts per `seconds`, the shortest whole window (Nats-TTL counts
    whole seconds) in which `rate` makes a whole number of starts: 10/s is (10, 1), 2.5/s is
    (5, 2), 0.1/s is (1, 10). A rate no window up to MAX_WINDOW makes whole is rounded down
    there (never above the rate)."""
    for seconds in range(1, MAX_WINDOW + 1):
        keys = rate * seconds
        if keys >= 1 and abs(keys - round(keys)) < 1e-6:
            return round(keys), seconds
    if rate * MAX_WINDOW >= 1:
        return math.floor(rate * MAX_WINDOW), MAX_WINDOW
    return 1, math.ceil(1 / rate)


@dataclass(frozen=True)
class Holder:
    """Who holds a slot: enough for a parent to tell its own dead worker's slots from any other."""
    host: str
    parent: int               # the supervisor's pid
    pid: int                  # the worker's
    nonce: str                # this worker process's run (a pid can come back)

    def value(self, job: int = 0) -> bytes:
        return f"slot host={self.host} parent={self.parent} pid={self.pid} nonce={self.nonce} job={job}".encode()

    @staticmethod
    def parse(value: bytes) -> Holder | None:
        fields = dict(f.split("=", 1) for f in value.decode(errors="replace").split()[1:] if "=" in f)
        try:
            return Holder(fields["host"], int(fields["parent"]), int(fields["pid"]), fields["nonce"])
        except (KeyError, ValueError):
            return None


def parse_key(key: str) -> tuple[str, str, int] | None:
    """(NAME, "c" | "r", K) for a slot or rate key, else None."""
    name, _, rest = key.rpartition(".")
    name, _, kind = name.rpartition(".")
    if kind not in ("c", "r") or not name or not rest.isdigit():
        return None
    return name, kind, int(rest)
