"""The dashboard's memory: the last `monitor.lag_window` of ConsumerInfo samples, for `GET /history`.

The monitor adds one point per poll (the parent's loop is the one writer); the HTTP handler only
reads. A failed poll adds a gap, so the chart breaks its lines instead of drawing across an
outage. Crash moments are not copied here: the crash ledger already keeps the last
`ledger.HISTORY` deaths with their monotonic time, and `as_dict` picks those inside the window.

Every point has a sequence number, so a page that already holds the history asks only for what
is newer (`/history?after=SEQ`): a refresh costs the parent the new points, not the whole window
(600 points at a 0.1 s interval take ~3 ms to encode; 3600 take ~20 ms, too long to stall the
loop four times a second).

Memory is bounded twice: by time (points older than the window are dropped as new ones come)
and by count, at most `ceil(lag_window / interval) + 2` points and never more than MAX_POINTS
(3600: one hour at 1 s, six minutes at 0.1 s). A point is a small frozen dataclass (~150
bytes), so the ring stays well under a megabyte whatever the config says.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MAX_POINTS = 3600


@dataclass(frozen=True, slots=True)
class Point:
    seq: int                        # 1, 2, ... for the life of the process
    t: float                        # monotonic seconds when the poll returned (or failed)
    pending: int | None             # None in every number: the poll failed
    ack_pending: int | None
    ack_floor: int | None           # consumer sequence, as in the seed post
    delivered: int | None           # consumer sequence: counts redeliveries too
    redelivered: int | None
    lag: str                        # the lag state right after this poll


def capacity(window: float, interval: float) -> int:
    """Points the ring keeps: the window's worth of polls, two spare, at most MAX_POINTS."""
    polls = math.ceil(window / interval) if interval > 0 else MAX_POINTS
    return max(2, min(MAX_POINTS, polls + 2))


class History:
    def __init__(self, window: float, interval: float):
        self.window, self.interval = float(window), float(interval)
        self._points: deque[Point] = deque(maxlen=capacity(window, interval))
        self.last_seq = 0

    def __len__(self) -> int:
        return len(self._points)

    @property
    def capacity(self) -> int:
        return self._points.maxlen or 0

    def resize(self, window: float, interval: float) -> None:
        """A reload changed the window or the interval: keep what fits, newest first."""
        self.window, self.interval = float(window), float(interval)
        self._points = deque(self._points, maxlen=capacity(window, interval))
        if self._points:
            self._trim(self._points[-1].t)

    def add(self, t: float, consumer: dict[str, Any], lag: str) -> None:
        self._append(t, consumer["num_pending"], consumer["num_ack_pending"], consumer["ack_floor_consumer_seq"],
                     consumer["delivered_consumer_seq"], consumer["num_redelivered"], lag)

    def gap(self, t: float, lag: str) -> None:
        self._append(t, None, None, None, None, None, lag)

    def _append(self, t: float, *values: Any) -> None:
        if self._points and t < self._points[-1].t:
            return                  # a monotonic clock never goes back: a late answer, drop it
        self.last_seq += 1
        self._points.append(Point(self.last_seq, t, *values))
        self._trim(t)

    def _trim(self, newest: float) -> None:
        while self._points and self._points[0].t < newest - self.window:
            self._points.popleft()

    def points(self, now: float) -> list[Point]:
        return [p for p in self._points if p.t >= now - self.window]

    def as_dict(self, now: float, wall: float, deaths: Iterable[Any] = (), after: int = 0) -> dict[str, Any]:
        """The /history JSON: the points in the window newer than `after` (a seq), and every
        crash in the window. `now` is monotonic, `wall` the same instant in Unix time: each point
        and crash gets its age (what the page draws with) and its wall-clock time `t` (for people
        and scripts)."""
        def when(t: float) -> dict[str, float]:
            return {"t": round(wall - (now - t), 3), "age_s": round(now - t, 3)}

        samples = [{"seq": p.seq, **when(p.t), "pending": p.pending, "ack_pending": p.ack_pending,
                    "ack_floor": p.ack_floor, "delivered": p.delivered, "redelivered": p.redelivered, "lag": p.lag}
                   for p in self.points(now) if p.seq > after]
        crashes = [{**when(d.t), "slot": d.slot, "pid": d.pid, "cause": d.cause, "held": [h.seq for h in d.held]}
                   for d in deaths if now - self.window <= d.t <= now and d.crash]
        return {"now": round(wall, 3), "interval_s": self.interval, "window_s": self.window,
                "capacity": self.capacity, "last_seq": self.last_seq, "samples": samples, "crashes": crashes}
