"""How many messages a worker asks for: pull sizing learnt from the work itself (issue 11).

A worker wants its handlers never to wait for a message, and to hold nothing else: a pulled job
that has not started ages against AckWait, and sits where no idle worker can take it. So it
keeps `concurrency` jobs running plus a buffer (the prefetch) just deep enough to last while its
next pull request makes one round trip:

    prefetch = concurrency x DEPTH x refill time / job time

where the refill time is the pull round trip, and for sync handlers two of them plus the handler
threads' outcome batching for jobs shorter than it (their finished jobs reach the loop in batches, and each hand-over
between a thread and the loop waits for the GIL as a round trip does: the measured round trip
includes that wait).

It asks again once half of its buffer is free (or a handler, when it buffers nothing), so a
buffer of DEPTH round trips still holds about one round trip of jobs when the next request
leaves. The prefetch is rounded: a worker buffers a job once a round trip is a quarter of a job
or more (without it, its handler would sit idle a fifth of the time or more). Short jobs get a
deep buffer and large pulls, hence few requests (no-op jobs: hundreds per request); slow jobs get
none (0.2 s jobs with a 1 ms round trip: prefetch 0, each worker asks for a job only when a
handler is free).

The mean is not enough when job times vary. A buffered job waits for a handler to free, i.e. for
the rest of the job running when it came: E[T^2] / 2 E[T] on average (the residual; a moment
taken at random falls in a long job more often than its share of the count says). With 10 ms
jobs and one of 2 s among every 200, the mean is 20 ms but the residual 0.5 s: a short job that
joins a buffer waits behind the long one while another worker may be free. So while the stream
has no backlog, the worker buffers only while the residual, shared among its handlers, is within
what the buffer is sized to hide (concurrency x DEPTH round trips); beyond it, it takes only
what it can start now, and each job goes to whichever worker has a handler free. Not taking is
preferred to handing a buffered job back: a NAK spends a delivery attempt. For uniform jobs the
threshold is the formula's own (prefetch >= 1 when a job is at most 2 x DEPTH round trips, and
their residual is half a job), so they are sized as before. With a backlog (the last BACKLOG_RUN
messages each said more were pending: one alone may be a burst that other workers' requests are
about to take) the buffer is kept whatever the spread: every free handler then finds work at
once, a job waits in the stream if not in a buffer, and the buffer saves round trips.
The residual is averaged over about SPREAD_JOBS recent jobs (a count, not a time: it outlasts
the gaps between a worker's long jobs), and starts over with a new burst after IDLE_STALE. Each
worker shares its sums in its slot table and the parent hands back the fleet's residual
(supervisor/parent/stats.py share_spread): the worse of the two counts, so a worker that has not
met a long job yet learns from those that have, within a tick of the parent's loop.
Until the fleet has seen KNOWN_JOBS recent jobs the spread is unknown, and unknown counts as
wide: without a backlog a worker takes only what it can start now. The first long job is
otherwise met by a worker with a buffer open: its pull request, still live at the server, fills
with short jobs that then wait behind it (the fairness scenario's warm-up: 2-3 short jobs of
1,000 waited 2 s behind a 2 s job, before any long job had finished). What that costs is a pull
request per job for the first few hundred jobs of a stream without a backlog.

Both figures are measured, not configured: the job time is the handler's own duration (an
average that takes a slower job into account at once and forgets it slowly, since hoarding
costs more than a short wait), and the round trip is the worst of the last RTT_SAMPLES PING/PONGs
and pull requests answered from a backlog (it includes the loop and GIL latency of a busy
machine, which is what the buffer must hide). The bounds:
  - `workers.batch` caps each request, and BUFFER_REQUESTS of them the prefetch (one batch of
    no-op jobs lasts less than a round trip on a busy box: the buffer must hold several);
  - a fair share of `consumer.max_ack_pending` (divided by `workers.count`): one worker never
    takes what the server would let its peers have, however small that is (at least one job);
  - a round trip counts at most RTT_CAP, so the buffer never holds more than DEPTH x RTT_CAP of
    work per handler, whatever the network;
  - after IDLE_STALE seconds without a message the job time is stale (the next burst may be of
    another kind): the worker asks only for `concurrency` until a job of the new burst finishes.
What a worker may have on the wire when it dies (its credits) is at most its capacity, and
`concurrency` once it has been idle IDLE_STALE seconds.

With [ordering] a buffered job is a cost, not a saving: it waits for a handler while every later
job of its key waits for it, and a job of another key, free to start, waits behind this worker's
busy handler while another worker's is free (a key's long job, or a poison's deaths, held up
other keys while the look ahead beyond the handlers was room any job could fill). So jobs ready
to start are buffered by the rules above, bar the backlog's (`ordered_size`: none while the
spread is wide or not known, backlog or not; a deep buffer for uniform short jobs), and a job
that turns out to wait for its key's turn (parked, workers/runtime/ordering.py) takes no handler
and no buffer: the worker asks again, past it, while fewer than `lookahead` are parked. Outcomes
go back to the loop at once (`batching` 0).

Jobs parked for a limit ([limits], workers/middleware/limits.py) are counted two ways. One that
waits for a full limit takes no handler and no place in the buffer (`limit_waiting`): a free
handler asks for work, so jobs that need no limit keep flowing past it. While any wait, the
worker asks only for what its free handlers can start (no buffer: a buffered job could wait
too, and jobs that wait then spread over the fleet by its handlers, not by who buffered most),
and only while fewer than its allowance wait: WAIT_ROUNDS rounds of its handlers, or its
capacity if that is more (so a pull alone never stops a worker). Past that it asks for nothing
until one starts: more would only be work it cannot start, held from workers that could. And a
pulled job not yet at its turn to take its limits (`held`: they are taken only for a job a
handler can start soon) stops the asking altogether until it is, or it would be overtaken by
every refill. With [ordering] both rules hold within `ordered_size` as well.

Pure: no clock is read here, every time is passed in.
"""

from __future__ import annotations

from collections import deque

DEPTH = 2.0            # the buffer lasts this many round trips; a refill leaves with one still in it
MIN_SPAN = 0.005       # size for at least this round trip: fewer, larger requests when the link is quick
RTT_CAP = 0.2          # ... and at most this one: never hoard more than DEPTH x RTT_CAP of work per handler
RTT_SAMPLES = 8        # the round trip is the worst of this many recent samples (2 s of PING/PONGs)
UP, DOWN = 0.5, 0.1    # job-time average weights: a slower job counts at once, faster ones slowly
IDLE_STALE = 5.0       # seconds without a message before the job time is no longer trusted
SPREAD_JOBS = 1000     # the residual is an average over about this many recent jobs ...
KNOWN_JOBS = 500       # ... trusted once the fleet's recent jobs count this many (about 700 after a start)
BACKLOG_RUN = 3        # a backlog: this many messages in a row said more were pending
BUFFER_REQUESTS = 4    # the buffer holds at most this many requests of workers.batch (within the fair share)
WAIT_ROUNDS = 4        # jobs waiting for a full limit a worker holds at most: this many rounds of its handlers


class PullSizer:
    """One worker's pull sizing. `concurrency`: handlers; `ceiling`: workers.batch; `share`: this
    worker's fair share of consumer.max_ack_pending; `threads`: sync handlers, whose finished jobs
    reach the loop up to `batching` seconds late."""

    def __init__(self, concurrency: int, ceiling: int, share: int, threads: bool = False, batching: float = 0.0,
                 lookahead: int = 0):
        self.concurrency = concurrency
        # [ordering]: jobs held beyond those running are not a buffer (a job waiting for a handler
        # delays every later job of its key) but a look ahead: this many, parked for their key's turn.
        self.lookahead = lookahead
        self.hops, self.batching = (2, batching) if threads else (1, 0.0)
        self.ceiling = max(1, ceiling)
        self.share = max(1, share)
        self.job_time: float | None = None    # seconds per job, per handler
        self.spent = self.spent_sq = 0.0      # sums of T and T^2 over the recent jobs (SPREAD_JOBS), decayed ...
        self.seen = 0.0                       # ... and of 1: how many they are
        self.fleet_residual = 0.0             # every worker's, from the parent ...
        self.fleet_seen = 0.0                 # ... and how many jobs it rests on
        self.rtts: deque[float] = deque(maxlen=RTT_SAMPLES)
        self.last_message = 0.0                # when the last message arrived ...
        self.pending_run = 0                   # ... and how many in a row said more were pending
        self.stale = False                     # idle too long: job_time describes the last burst

    # -- what the worker observes

    def job_done(self, seconds: float) -> None:
        seconds = max(seconds, 1e-6)
        if self.job_time is None or self.stale:
            self.job_time, self.stale = seconds, False
            self.spent, self.spent_sq, self.seen = seconds, seconds * seconds, 1.0
        else:
            keep = 1.0 - 1.0 / SPREAD_JOBS
            self.spent = self.spent * keep + seconds
            self.spent_sq = self.spent_sq * keep + seconds * seconds
            self.seen = self.seen * keep + 1.0
            weight = UP if seconds > self.job_time else DOWN
            self.job_time += weight * (seconds - self.job_time)

    def round_trip(self, seconds: float) -> None:
        self.rtts.append(seconds)

    @property
    def rtt(self) -> float:
        """The refill time to hide: the worst recent round trip (once or twice, see above), within
        [MIN_SPAN, RTT_CAP]."""
        refill = self.hops * max(self.rtts, default=0.0) + self.wait_for_batch()
        return min(max(refill, MIN_SPAN), RTT_CAP)

    @property
    def residual(self) -> float:
        """How long a job that joins the buffer waits, on average, for the job running when it
        came: E[T^2] / 2 E[T] over the recent jobs (0 before any)."""
        return residual(self.spent, self.spent_sq)

    def shared(self, now: float) -> tuple[float, float, float]:
        """The sums this worker shares with the fleet (of T, T^2 and 1): none once idle (its last
        burst says nothing of the next)."""
        return (0.0, 0.0, 0.0) if self.idle(now) else (self.spent, self.spent_sq, self.seen)

    @property
    def known(self) -> bool:
        """Enough recent jobs, here or in the fleet, to trust their spread (KNOWN_JOBS)."""
        return max(self.seen, self.fleet_seen) >= KNOWN_JOBS

    def spread(self) -> bool:
        """The job times vary too much to buffer while there is no backlog, or may (not known
        yet): a buffered job would wait longer for a handler than the buffer is sized to hide
        (see the module's docstring)."""
        worst = max(self.residual, self.fleet_residual)
        # [ordering]: a backlog keeps no buffer. A job buffered behind a long one (a poison's
        # next delivery) holds up its whole key, not just itself, while other workers are free.
        backlog = self.backlog and not self.lookahead
        return not backlog and (not self.known or worst > self.concurrency * DEPTH * self.rtt)

    def wait_for_batch(self) -> float:
        """How late a finished job's outcome reaches the loop: a handler thread hands outcomes back
        once the oldest would be `batching` old by the end of the next job, so a job that long or
        longer goes back alone, at once (a 50 ms job must not buy a buffered job for 20 ms)."""
        return max(0.0, self.batching - (self.job_time or 0.0))

    def message(self, now: float, pending: int = 0) -> None:
        """A message arrived; `pending`: how many more the stream held for the consumer then."""
        if self.idle(now):
            self.stale = True
        self.last_message = now
        self.pending_run = self.pending_run + 1 if pending > 0 else 0

    @property
    def backlog(self) -> bool:
        return self.pending_run >= BACKLOG_RUN

    def idle(self, now: float) -> bool:
        return now - self.last_message > IDLE_STALE

    # -- what it decides

    def prefetch(self, now: float) -> int:
        """Jobs to hold beyond those running (ready to start: [ordering]'s parked jobs apart)."""
        if self.job_time is None or self.stale or self.idle(now) or self.spread():
            return 0
        return min(BUFFER_REQUESTS * self.ceiling, int(self.concurrency * DEPTH * self.rtt / self.job_time + 0.5))

    def capacity(self, now: float) -> int:
        """Jobs running, buffered and asked for, at most."""
        return min(self.concurrency + self.prefetch(now), self.share)

    def waiting_allowance(self, now: float) -> int:
        """How many jobs waiting for a full limit a worker holds before it asks for no more."""
        return max(WAIT_ROUNDS * self.concurrency, self.capacity(now))

    def size(self, now: float, outstanding: int, credits: int, free_entries: int,
             jobs_left: int | None = None, limit_waiting: int = 0, held: bool = False) -> int:
        """The next pull request's batch, or 0 to send none. `outstanding`: buffered, running and
        asked for; `credits`: asked for and not yet received; `free_entries`: slot-table entries
        not in use; `jobs_left`: jobs this worker may still take (max_jobs), None for no limit;
        `limit_waiting`: jobs parked for a full limit (not in `outstanding`); `held`: a job parked
        until it is its turn to take its limits (see the module's docstring)."""
        if held or (limit_waiting and limit_waiting >= self.waiting_allowance(now)):
            return 0
        capacity = min(self.concurrency, self.share) if limit_waiting else self.capacity(now)
        room = min(capacity - outstanding, free_entries - credits, self.share - outstanding - limit_waiting)
        # Top up only once half the buffer is free: few, large requests, no dribbling. With no
        # buffer, as soon as a handler is free: it would otherwise wait for another to finish.
        if room < max(1, (capacity - self.concurrency + 1) // 2):
            return 0
        if jobs_left is not None:
            room = min(room, jobs_left)
        return max(0, min(room, self.ceiling))


    def ordered_size(self, now: float, busy: int, parked: int, credits: int, free_entries: int,
                     jobs_left: int | None = None, limit_waiting: int = 0, held: bool = False) -> int:
        """[ordering]'s next pull request: what the free handlers and the buffer have room for, as
        without ordering (`busy`: jobs that take a handler, queued or running), while fewer than
        `lookahead` jobs are `parked` for their key's turn and within the fair share; 0 for none."""
        n = self.size(now, busy + credits, credits, free_entries, jobs_left, limit_waiting, held)
        return max(0, min(n, self.lookahead - parked - credits, self.share - busy - parked - credits))


def residual(spent: float, spent_sq: float) -> float:
    """E[T^2] / 2 E[T] from the sums of job times and of their squares (0 when there are none)."""
    return spent_sq / (2 * spent) if spent > 0 else 0.0


def fair_share(max_ack_pending: int, workers: int) -> int:
    """A worker's part of the consumer's max_ack_pending, shared by `workers` (at least one job)."""
    return max(1, max_ack_pending // max(1, workers))
