"""Lag analysis: ConsumerInfo samples in, one of unknown | ok | growing | stuck out.

Pure and deterministic: no I/O, no asyncio, no clock reads. The monitor polls ConsumerInfo every
``monitor.interval`` seconds, hands each answer to :meth:`LagAnalyzer.add` (or calls
:meth:`LagAnalyzer.poll_failed`), and asks :meth:`LagAnalyzer.report` for ``/status``,
``/healthz`` and the state-change log. Every time is a monotonic float passed in by the caller.

The rules are the seed post's "A few things to watch":

- Alert on NumPending growing over time, not on a single high value. A burst (0 -> 38 in one
  poll, then draining at ~4/s) is normal; a steadily rising line is the problem. So ``growing``
  needs a least-squares rise across the whole window *with the latest burst step taken out*, and
  the recent part of the window still rising (see :func:`remove_latest_step`).
- A flat AckFloor while work waits means workers are stuck or crashing. ``stuck`` = there is work
  and neither the ack floor nor our own ack counter moved for longer than AckWait, and no live,
  heart-beating worker is legitimately busy with a long job.

Choices, and why:

- Stuck is tracked with one timestamp (when acks last moved, or there was no work, or a worker
  showed legitimate progress), not from the sample history, so it sees further back than
  ``lag_window`` when AckWait is longer than the window.
- Values are fitted as offsets from the first sample (exact int subtraction first), so consumer
  sequences near 2**63 don't lose their low digits in float.
- A consumer sequence going backwards means the consumer was deleted and recreated: the history
  describes another consumer, so it is dropped rather than fitted as a negative drain.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import median

# --- thresholds -------------------------------------------------------------------------------

#: The newest good sample is stale (state ``unknown``) after this many poll intervals ...
STALE_POLLS = 3
#: ... but never sooner than this: with a 0.1 s interval, one slow ConsumerInfo round trip (a
#: leader election takes longer) must not flip the state.
STALE_MIN_S = 2.0

#: The "recent" part of the window is its last quarter (15 s of the default 60 s), capped at
#: RECENT_MAX_S: long enough to average out per-poll noise, short enough that a stopped
#: publisher shows within seconds even with a long window (120 s would otherwise wait 30 s).
RECENT_FRACTION = 0.25
RECENT_MAX_S = 15.0
#: No fit is trusted on fewer polls than this (the recent part never holds fewer).
MIN_FIT_SAMPLES = 5

#: A per-poll rise is a burst step when it beats the typical per-poll change by STEP_K times the
#: noise, and is itself that large. The noise is the smaller of two robust estimates, as each is
#: fooled where the other is not: the median deviation from the typical change (inflated once a
#: burst splits the window into two regimes, idle 0/poll then draining -4/poll) and the median
#: change between consecutive per-poll changes (smooth within each regime, but with only three
#: changes the step itself is half of them). 5 keeps a steady +2/s climb with +-2 noise
#: (per-poll changes -2..+6, noise ~2) step-free, while the seed's 0 -> 38 jump is far out.
STEP_K = 5.0
#: Floor of that deviation, in jobs: on a perfectly flat series a +1 wobble is not a step.
STEP_MIN_SCALE = 1.0

#: Entering ``growing`` takes all of: the window's fitted rise (slope x span, latest burst step
#: removed) is at least GROW_MIN_RISE jobs, since a handful of jobs is not a backlog ...
GROW_MIN_RISE = 10.0
#: ... that slope is GROW_MIN_T standard errors above zero, so noise around a flat level
#: (p ~ 0.1 % per tick for Gaussian noise) does not get there ...
GROW_MIN_T = 3.0
#: ... and the recent part still rises: at GROW_RECENT_RATIO of the window's slope or more, and
#: GROW_RECENT_T standard errors above zero. A rise that already stopped (a plateau, or draining
#: after the publisher quit) is history, not an alert; at 3 standard errors the noise on a
#: plateau can't talk the state back into ``growing``. When the recent part holds a burst step
#: the t test is waived: batches every few seconds make its slope swing with their phase (large
#: stderr) though each batch is inflow, and the window's step-free trend already vouches for
#: the rise (a lone burst never gets past it).
GROW_RECENT_RATIO = 0.5
GROW_RECENT_T = 3.0
#: Leaving ``growing`` takes evidence that the rise stopped: the recent slope plus one standard
#: error falls below GROW_EXIT_RATIO of the window's slope (or the window's slope is gone).
#: Entering on a significant rise but leaving only on a significant lack of one is the
#: hysteresis: a slow leak hovering near a bar doesn't flap the state (and the log), a batch
#: publisher (large stderr) stays ``growing``, and a plain fall (small stderr) leaves it within
#: seconds of the publisher stopping.
GROW_EXIT_RATIO = 0.25

#: Net drains below this (jobs/s) count as "not draining": eta None rather than ~forever.
MIN_NET_DRAIN = 1e-9

STATES = ("unknown", "ok", "growing", "stuck")


@dataclass(frozen=True)
class Sample:
    t: float  # monotonic seconds when the poll returned
    num_pending: int  # not yet delivered
    num_ack_pending: int  # delivered, not acked (in flight)
    num_redelivered: int
    delivered_consumer_seq: int  # counts every delivery, redeliveries too
    ack_floor_consumer_seq: int
    local_acked: int  # jobs acked by this supervisor's workers since it started
    progress_alive: bool  # a live, heart-beating worker runs a job within its job_timeout
    progress_at: float | None = None  # that worker's last heartbeat (monotonic); None: use t
    paused: bool = False  # the consumer is paused on purpose (its PauseUntil): nothing is delivered

    @property
    def work(self) -> int:
        """Jobs not finished yet: waiting plus in flight."""
        return self.num_pending + self.num_ack_pending

    @property
    def finished(self) -> int:
        """Moves by one per finished delivery (ack, nak or term), never by a new delivery.

        Unlike the ack floor it keeps moving while one long job pins the floor.
        """
        return self.delivered_consumer_seq - self.num_ack_pending


@dataclass(frozen=True)
class LagReport:
    state: str  # "unknown" | "ok" | "growing" | "stuck"
    pending_slope_per_s: float | None  # trend of num_pending over the window, burst step removed
    drain_rate_per_s: float | None  # jobs finished per second, recently
    eta_s: float | None  # until pending + ack_pending reaches 0; 0.0 when empty; None: not draining
    reason: str  # one human line explaining the state

    def as_dict(self) -> dict:
        return {
            "state": self.state,
            "pending_slope_per_s": _rounded(self.pending_slope_per_s, 2),
            "drain_rate_per_s": _rounded(self.drain_rate_per_s, 2),
            "eta_s": _rounded(self.eta_s, 1),
            "reason": self.reason,
        }


def _rounded(x: float | None, digits: int) -> float | None:
    # JSON has no inf/nan; a number we can't show is as good as unknown.
    if x is None or not math.isfinite(x):
        return None
    return round(x, digits) + 0.0  # + 0.0 turns -0.0 into 0.0


# --- least squares and burst steps ------------------------------------------------------------


@dataclass(frozen=True)
class Fit:
    """A least-squares line through (t, y): y per second, with the slope's standard error."""

    slope: float
    stderr: float  # inf with only two points: no residuals to estimate noise from
    n: int
    span: float  # seconds from the first to the last point

    @property
    def rise(self) -> float:
        return self.slope * self.span

    @property
    def t_stat(self) -> float:
        if self.stderr > 0.0:
            return self.slope / self.stderr
        # A perfect line: infinitely significant unless it is flat.
        return math.copysign(math.inf, self.slope) if self.slope else 0.0


def fit_line(ts: Sequence[float], ys: Sequence[float]) -> Fit | None:
    """Ordinary least squares; None when there is no time to fit over (n < 2 or one instant)."""
    n = len(ts)
    if n < 2:
        return None
    mx, my = sum(ts) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in ts)
    if sxx <= 0.0:
        return None  # all samples at one instant: a slope would divide by zero
    slope = sum((x - mx) * (y - my) for x, y in zip(ts, ys)) / sxx
    stderr = math.inf
    if n > 2:
        ssr = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(ts, ys))
        stderr = math.sqrt(ssr / (n - 2) / sxx)
    return Fit(slope, stderr, n, ts[-1] - ts[0])


def series(
    samples: Sequence[Sample], key: Callable[[Sample], int]
) -> tuple[list[float], list[float]]:
    """(t, value) relative to the first sample; ints subtract exactly before becoming floats."""
    t0, v0 = samples[0].t, key(samples[0])
    return [s.t - t0 for s in samples], [float(key(s) - v0) for s in samples]


def step_jumps(ts: Sequence[float], ys: Sequence[float]) -> list[float]:
    """Per sample, the excess rise *into* it when that rise is a burst step, else 0.0.

    "Typical" is the median per-second change over the series, so a fast steady publisher (every
    poll +96) has no steps, only a trend. Needs three changes or more, so that a step can be
    neither its own median nor its own noise.
    """
    jumps = [0.0] * len(ys)
    if len(ys) < 4:
        return jumps
    dts = [b - a for a, b in zip(ts, ts[1:])]
    dys = [b - a for a, b in zip(ys, ys[1:])]
    rates = [dy / dt for dy, dt in zip(dys, dts) if dt > 0.0]
    typical = median(rates) if rates else 0.0
    excess = [dy - typical * dt for dy, dt in zip(dys, dts)]
    noise = min(median(abs(e) for e in excess), median(abs(b - a) for a, b in zip(dys, dys[1:])))
    limit = STEP_K * max(noise, STEP_MIN_SCALE)
    for i, (dy, ex) in enumerate(zip(dys, excess), start=1):
        # An upward jump in absolute terms too: after a fast drain, a flat 0 beats the typical
        # -8/poll but is the queue being empty, not a burst.
        if dy > limit and ex > limit:
            jumps[i] = ex
    return jumps


def latest_step(jumps: Sequence[float]) -> range:
    """Indices of the latest run of consecutive steps (a burst caught across two polls is one)."""
    end = len(jumps)
    while end > 0 and jumps[end - 1] <= 0.0:
        end -= 1
    start = end
    while start > 0 and jumps[start - 1] > 0.0:
        start -= 1
    return range(start, end)


def remove_latest_step(ys: Sequence[float], jumps: Sequence[float]) -> list[float]:
    """ys with the latest burst's excess subtracted from it onwards.

    Why remove one step rather than fit only after it, or remove all of them: keeping the
    samples before the burst keeps the whole window in the trend (a burst on top of a real climb
    still reads as growing), and removing only the latest keeps a publisher that sends a batch
    every 10 s faster than the workers drain it from looking like an endless series of drains.
    """
    run = latest_step(jumps)
    out, offset = [], 0.0
    for i, y in enumerate(ys):
        if i in run:
            offset += jumps[i]
        out.append(y - offset)
    return out


def trend(samples: Sequence[Sample], key: Callable[[Sample], int]) -> Fit | None:
    """Least-squares trend of key(sample) with the latest burst step taken out."""
    if len(samples) < 2:
        return None
    ts, ys = series(samples, key)
    return fit_line(ts, remove_latest_step(ys, step_jumps(ts, ys)))


def since_latest_step(samples: Sequence[Sample]) -> Sequence[Sample]:
    """The samples from the latest burst step in work on: the current drain regime."""
    if len(samples) < 2:
        return samples
    ts, ys = series(samples, lambda s: s.work)
    run = latest_step(step_jumps(ts, ys))
    # run[-1] is the first sample at the new level; fit from there (it is where the drain starts).
    return samples[run[-1]:] if run else samples


@dataclass(frozen=True)
class Trends:
    """Everything fitted from the sample history; recomputed once per good sample."""

    pending: Fit | None  # num_pending over the window, latest step removed
    recent: Fit | None  # num_pending over the recent part, as is (see GROW_RECENT_T)
    recent_bursty: bool  # the recent part holds a burst step
    drain: Fit | None  # finished counter since the latest step (recent part)
    work: Fit | None  # pending + in flight since the latest step (recent part)

    def starts_growing(self, min_span: float) -> bool:
        p, r = self.pending, self.recent
        if p is None or r is None or p.n < MIN_FIT_SAMPLES or r.n < MIN_FIT_SAMPLES:
            return False
        return (
            p.span >= min_span
            and p.rise >= GROW_MIN_RISE
            and p.t_stat >= GROW_MIN_T
            and r.slope >= GROW_RECENT_RATIO * p.slope
            and (r.t_stat >= GROW_RECENT_T or self.recent_bursty)
        )

    def keeps_growing(self) -> bool:
        p, r = self.pending, self.recent
        if p is None or r is None or p.slope <= 0.0:
            return False
        return r.slope + r.stderr > GROW_EXIT_RATIO * p.slope


# --- the analyzer -----------------------------------------------------------------------------


class LagAnalyzer:
    """Feeds on one ConsumerInfo sample per poll; reports the lag state at any time."""

    def __init__(self, window: float, ack_wait: float, interval: float = 1.0):
        self.window = float(window)
        self.ack_wait = float(ack_wait)
        self.interval = float(interval)
        self.stale_after = max(STALE_POLLS * self.interval, STALE_MIN_S)
        # The recent part never spans fewer than MIN_FIT_SAMPLES polls, nor more than the window.
        floor = (MIN_FIT_SAMPLES - 1) * self.interval
        wanted = min(self.window * RECENT_FRACTION, RECENT_MAX_S)
        self.recent_span = min(max(wanted, floor), self.window)
        self._samples: deque[Sample] = deque()
        self._last: Sample | None = None  # newest good sample, survives a history reset
        self._stall_since: float | None = None  # start of the current "work but no acks" stretch
        self._trends = Trends(None, None, False, None, None)
        self._growing = False  # hysteresis memory, updated per sample so report() stays pure
        self._failed_polls = 0  # since the newest good sample
        self._last_error = ""
        self._reported = "unknown"  # for transition()

    @property
    def samples(self) -> tuple[Sample, ...]:
        return tuple(self._samples)

    def add(self, s: Sample) -> None:
        prev = self._last
        if prev is not None and s.t < prev.t:
            return  # a monotonic clock can't go back: an answer that lost a race, ignore it
        if prev is not None and _consumer_reset(prev, s):
            self._samples.clear()
            self._growing = False
            prev = None
        self._track_stall(prev, s)
        self._last, self._failed_polls, self._last_error = s, 0, ""
        self._samples.append(s)
        self._trim(s.t)
        self._trends = self._fit()
        self._growing = self._trends.keeps_growing() if self._growing else (
            self._trends.starts_growing(self.recent_span)
        )

    def poll_failed(self, t: float, error: str = "") -> None:
        """A poll failed (server down, consumer missing). The state turns unknown once the
        newest good sample is older than stale_after; until then one blip changes nothing.
        `error` (one line, no secrets) goes into the unknown state's reason."""
        if self._last is not None and t < self._last.t:
            return  # it failed before an answer we already have: that answer stands
        self._failed_polls += 1
        self._last_error = error

    def report(self, now: float) -> LagReport:
        if len(self._samples) < 2:
            return LagReport("unknown", None, None, None,
                             f"waiting for ConsumerInfo ({len(self._samples)} of 2 samples)")
        last = self._samples[-1]
        if now - last.t > self.stale_after:
            return LagReport("unknown", None, None, None, self._stale_reason(now - last.t))
        slope, rate, eta = self._numbers(last)
        stalled = self._stalled_for(last)
        if stalled is not None:
            return LagReport("stuck", slope, rate, eta, self._stuck_reason(last, stalled))
        if self._growing:
            return LagReport("growing", slope, rate, eta, self._growing_reason())
        return LagReport("ok", slope, rate, eta, _ok_reason(last, rate, eta))

    def transition(self, now: float) -> tuple[str, str] | None:
        """(old, new) when the state changed since the previous call, else None: log once."""
        state = self.report(now).state
        old, self._reported = self._reported, state
        return None if old == state else (old, state)

    # -- internals ---------------------------------------------------------------------------

    def _track_stall(self, prev: Sample | None, s: Sample) -> None:
        # The stall clock restarts whenever acks move (the floor, or ours: the floor can stand
        # still behind one long job while other jobs are acked), when there is no work (nothing
        # to ack is not a stall), and while a live worker shows legitimate progress on a long
        # job: like +WPI resets the server's AckWait timer, that progress resets ours. Progress
        # dates from the worker's last heartbeat, not from when we noticed it: a worker that
        # stopped beating a moment ago has been idle since its last beat.
        moved = prev is None or (
            s.ack_floor_consumer_seq != prev.ack_floor_consumer_seq
            or s.local_acked != prev.local_acked
        )
        # A paused consumer delivers nothing on purpose (workers.Pause, `supervisor pause`):
        # waiting work is not a stall, and a pause longer than AckWait is not `stuck`.
        if moved or s.work == 0 or s.paused:
            self._stall_since = s.t
        elif s.progress_alive:
            beat = s.t if s.progress_at is None else min(s.progress_at, s.t)
            self._stall_since = max(self._stall_since or beat, beat)

    def _stalled_for(self, last: Sample) -> float | None:
        """Seconds nothing has been acked with work waiting, when longer than AckWait."""
        if self._stall_since is None or last.work == 0 or last.progress_alive:
            return None
        # Measured to the newest sample: that is as far as we know nothing was acked.
        stalled = last.t - self._stall_since
        return stalled if stalled > self.ack_wait else None

    def _trim(self, newest: float) -> None:
        # Keep two samples whatever the window, so a window shorter than the poll interval
        # still yields a state instead of "unknown" forever.
        while len(self._samples) > 2 and self._samples[0].t < newest - self.window:
            self._samples.popleft()

    def _fit(self) -> Trends:
        window = list(self._samples)
        newest = window[-1].t
        recent = [s for s in window if s.t >= newest - self.recent_span]
        if len(recent) < MIN_FIT_SAMPLES:  # irregular polls: fall back to the last few
            recent = window[-MIN_FIT_SAMPLES:]
        regime = since_latest_step(recent)
        ts, ys = series(recent, lambda s: s.num_pending)
        return Trends(
            pending=trend(window, lambda s: s.num_pending),
            # The recent part is fitted as is: a lone burst is already kept out by the window's
            # step-free trend, and removing the latest of two batches from 15 s would hide a
            # batch publisher that outpaces the workers.
            recent=fit_line(ts, ys),
            recent_bursty=bool(latest_step(step_jumps(ts, ys))),
            drain=fit_line(*series(regime, lambda s: s.finished)) if len(regime) > 1 else None,
            work=fit_line(*series(regime, lambda s: s.work)) if len(regime) > 1 else None,
        )

    def _numbers(self, last: Sample) -> tuple[float | None, float | None, float | None]:
        tr = self._trends
        slope = tr.pending.slope if tr.pending else None
        # The finished counter only moves forward; a negative fit is noise, not un-finishing.
        rate = max(tr.drain.slope, 0.0) if tr.drain else None
        if last.work == 0:
            return slope, rate, 0.0
        net = -tr.work.slope if tr.work else 0.0
        return slope, rate, (last.work / net if net > MIN_NET_DRAIN else None)

    def _stale_reason(self, age: float) -> str:
        text = f"no ConsumerInfo for {age:.1f} s"
        if self._failed_polls:
            text += f" ({self._failed_polls} failed polls"
            text += f": {self._last_error})" if self._last_error else ")"
        return text

    def _stuck_reason(self, last: Sample, stalled: float) -> str:
        return (
            f"{last.num_ack_pending} in flight, {last.num_pending} waiting, nothing acked for "
            f"{stalled:.0f} s (AckWait {self.ack_wait:g} s)"
        )

    def _growing_reason(self) -> str:
        first, last, fit = self._samples[0], self._samples[-1], self._trends.pending
        assert fit is not None, "growing is only decided from a fitted trend"
        return (
            f"pending rose {first.num_pending} -> {last.num_pending} over "
            f"{last.t - first.t:.0f} s ({fit.slope:+.1f}/s)"
        )


def _consumer_reset(prev: Sample, s: Sample) -> bool:
    # Consumer sequences only grow for the life of a consumer; going back means a new consumer.
    return (
        s.delivered_consumer_seq < prev.delivered_consumer_seq
        or s.ack_floor_consumer_seq < prev.ack_floor_consumer_seq
    )


def _ok_reason(last: Sample, rate: float | None, eta: float | None) -> str:
    if last.work == 0:
        return "queue empty"
    parts = [f"{last.num_pending} waiting", f"{last.num_ack_pending} in flight"]
    if rate is not None:
        parts.append(f"finishing {rate:.1f}/s")
    parts.append(f"empty in ~{eta:.0f} s" if eta is not None else "not draining")
    return ", ".join(parts)
