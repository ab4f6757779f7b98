"""What a supervisor said on its consumer's ledger subject, and which of its peers' words it missed.

The ledger subject (supervisor/parent/safety/peers.py) is core NATS: a message published into a
link that is then cut, or that stalls until the client gives up on it and reconnects, is gone,
and a supervisor whose own link is down hears nothing its peers say meanwhile. Each supervisor
therefore numbers what it says (a hello says the last number it sent), keeps it a while
(`Said`), and says it again when a peer asks; a peer tracks the numbers it heard from each
origin (`Heard`), finds the ones it missed, asks for them until they come or it gives up, and
takes each number once (a message said again reaches every peer). Pure bookkeeping, a clock
passed in (F13 in docs/RELIABILITY.md).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

KEEP = 120.0            # seconds we keep what we said, for a peer whose link lost it ...
KEEP_LIMIT = 20_000     # ... at most this many messages
ASK_EVERY = 1.0         # a peer's missing messages are asked for again this often ...
ASK_TRIES = 10          # ... this many times; then they count as lost for good
MISSING_LIMIT = 5_000   # missing numbers remembered per peer (a larger gap: its newest ones)


class Said:
    """Our numbered messages, kept for KEEP seconds (at most KEEP_LIMIT of them)."""

    def __init__(self, keep: float = KEEP, limit: int = KEEP_LIMIT):
        self.last = 0
        self.keep_s, self.limit = keep, limit
        self._kept: OrderedDict[int, tuple[float, bytes]] = OrderedDict()

    def number(self) -> int:
        self.last += 1
        return self.last

    def keep(self, n: int, now: float, data: bytes) -> None:
        self._kept[n] = (now, data)
        self._prune(now)

    def again(self, numbers: list[int], now: float) -> list[bytes]:
        """What we said under `numbers` and still keep, in order (the rest is gone for good)."""
        self._prune(now)
        return [self._kept[n][1] for n in sorted(set(numbers)) if n in self._kept]

    def _prune(self, now: float) -> None:
        while self._kept and (len(self._kept) > self.limit or now - next(iter(self._kept.values()))[0] > self.keep_s):
            self._kept.popitem(last=False)


@dataclass
class Gaps:
    """One peer's numbers: the highest heard, those missing (-> when first missed), our asks."""
    high: int
    missing: dict[int, float] = field(default_factory=dict)
    asked_at: float = -math.inf
    tries: int = 0


class Heard:
    def __init__(self) -> None:
        self.peers: dict[str, Gaps] = {}
        self.lost = 0                   # numbers given up on: a link fault lost them for good

    def take(self, origin: str, n: int, now: float, again: bool = False) -> bool:
        """A message numbered `n` from `origin`: False when it was taken already, or is an old
        word said `again` for another peer before we had heard `origin` at all."""
        gaps = self.peers.get(origin)
        if gaps is None:                # first word from it: what it said before is not ours to miss
            if not again:
                self.peers[origin] = Gaps(n)
            return not again
        if n <= gaps.high:
            return gaps.missing.pop(n, None) is not None
        self._missed(gaps, range(gaps.high + 1, n), now)
        gaps.high = n
        return True

    def told_last(self, origin: str, last: int, now: float) -> None:
        """A hello: `origin` had said everything up to `last` when it sent it."""
        gaps = self.peers.get(origin)
        if gaps is None:
            self.peers[origin] = Gaps(last)
        elif last > gaps.high:
            self._missed(gaps, range(gaps.high + 1, last + 1), now)
            gaps.high = last

    def _missed(self, gaps: Gaps, numbers: range, now: float) -> None:
        if not gaps.missing:
            gaps.asked_at, gaps.tries = -math.inf, 0      # a new gap: ask at once
        for n in numbers[-MISSING_LIMIT:]:
            gaps.missing[n] = now
        while len(gaps.missing) > MISSING_LIMIT:
            gaps.missing.pop(next(iter(gaps.missing)))
            self.lost += 1

    def to_ask(self, now: float) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """(what to ask each peer for now, what we give up on now: lost for good)."""
        asks: dict[str, list[int]] = {}
        given_up: dict[str, list[int]] = {}
        for origin, gaps in self.peers.items():
            if not gaps.missing or now - gaps.asked_at < ASK_EVERY:
                continue
            if gaps.tries >= ASK_TRIES:
                given_up[origin] = sorted(gaps.missing)
                self.lost += len(gaps.missing)
                gaps.missing.clear()
                continue
            gaps.asked_at, gaps.tries = now, gaps.tries + 1
            asks[origin] = sorted(gaps.missing)
        return asks, given_up

    def gone(self, origin: str) -> list[int]:
        """`origin` said goodbye (it keeps nothing any more): its missing numbers are lost."""
        gaps = self.peers.get(origin)
        if gaps is None or not gaps.missing:
            return []
        lost = sorted(gaps.missing)
        self.lost += len(lost)
        gaps.missing.clear()
        return lost

    def missing(self) -> int:
        return sum(len(g.missing) for g in self.peers.values())
