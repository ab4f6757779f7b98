"""/metrics: Prometheus text built at scrape time from the Snapshot /status shows.
prometheus-client is used for exposition only: no registry-wide globals, no HTTP thread.

With [pools.*] in the config, every series about a pool (its workers, jobs, consumer, lag,
crash cross-check, autoscaling, [ordering]) carries a `pool` label, one sample per pool (the
ordering_* series only for pools ordered); the supervisor's own (the loop's step failures,
[limits.NAME]) do not. Without pools the series are as they always were: one pool, no label."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from supervisor.observe.snapshot import PoolSnapshot, Snapshot
from workers.protocol import slots

P = "jetstream_supervisor_"
CONSUMER_GAUGES = {"consumer_num_pending": "num_pending", "consumer_num_ack_pending": "num_ack_pending",
                   "consumer_num_redelivered": "num_redelivered", "consumer_num_waiting": "num_waiting",
                   "consumer_ack_floor": "ack_floor_consumer_seq", "consumer_delivered": "delivered_consumer_seq"}
LAG_STATES = ("unknown", "ok", "growing", "stuck")
CROSSCHECK = (("crash_held_jobs", "jobs_held_at_crash", "Jobs dead workers held at their death"),
              ("crash_redelivered", "held_jobs_redelivered", "Jobs held at a death seen redelivered"),
              ("crash_acked_after", "held_jobs_acked_after_crash", "Jobs held at a death acked afterwards"),
              ("unexplained_redeliveries", "unexplained_redeliveries", "Redeliveries no crash or NAK explains"),
              ("quarantined", "quarantined", "Poison jobs dead-lettered after repeated worker deaths"))


class Collector:
    def __init__(self, snap: Snapshot):
        self.snap = snap
        self.pools = snap.each()
        self.label = ["pool"] if snap.labelled else []

    def family(self, kind: type, name: str, help_: str, labels: Iterable[str],
               samples: Iterable[tuple[PoolSnapshot, list[str], float]]) -> Metric:
        """One family of per-pool series: each sample's labels, and the pool's name when labelled."""
        fam = kind(P + name, help_, labels=[*labels, *self.label])
        for p, values, value in samples:
            fam.add_metric([*values, *([p.name] if self.label else [])], value)
        return fam

    def gauge(self, name: str, help_: str, value: Any, labels: Iterable[str] = ()) -> Metric:
        """A per-pool gauge; `value(pool)` gives [(label values, value), ...], or one number."""
        return self.family(GaugeMetricFamily, name, help_, labels, self.samples(value))

    def counter(self, name: str, help_: str, value: Any, labels: Iterable[str] = ()) -> Metric:
        return self.family(CounterMetricFamily, name, help_, labels, self.samples(value))

    def samples(self, value: Any) -> Iterator[tuple[PoolSnapshot, list[str], float]]:
        for p in self.pools:
            got = value(p)
            for values, v in (got if isinstance(got, list) else [([], got)]):
                yield p, values, v

    def collect(self) -> Iterator[Metric]:
        yield from self.workers()
        yield self.counter("jobs", "Jobs settled by workers, by outcome",
                           lambda p: [([k], n) for k, n in p.pool.jobs.as_dict().items()], ["outcome"])
        yield self.durations()
        yield from self.consumer()
        yield from self.crosscheck()
        yield from self.limits(self.snap)
        yield from self.ordering()

    def workers(self) -> Iterator[Metric]:
        yield self.gauge("workers", "Worker processes by state",
                         lambda p: [([s], [w.state for w in p.pool.workers].count(s))
                                    for s in ("starting", "ready", "draining")], ["state"])
        yield self.gauge("workers_target", "Worker count asked for", lambda p: p.pool.target)
        yield self.gauge("autoscale_target", "Worker count autoscaling runs (workers_target when off)",
                         lambda p: p.autoscale["target"])
        yield self.gauge("autoscale_enabled", "1 when autoscale.enabled", lambda p: int(p.autoscale["enabled"]))
        yield self.gauge("autoscale_paused", "1 while a manual scale pauses autoscaling",
                         lambda p: int(p.autoscale["resumes_in_s"] is not None))
        yield self.counter("worker_restarts", "Workers restarted after dying", lambda p: p.pool.restarts)
        yield self.counter("worker_deaths", "Workers that died unexpectedly", lambda p: p.pool.worker_deaths)
        yield self.counter("in_progress_pings", "+WPI sent for long jobs", lambda p: p.pool.pings)
        if self.label:
            yield self.gauge("pool_halted", "1 once the pool halted at boot (restart.boot_failures_to_halt)",
                             lambda p: int(bool(p.halted)))
        failures = CounterMetricFamily(P + "loop_step_failures", "Exceptions a step of the parent's loop raised "
                                       "(logged and survived)", labels=["step"])
        for step, n in self.snap.loop.get("step_failures", {}).items():
            failures.add_metric([step], n)
        yield failures

    def limits(self, snap: Snapshot) -> Iterator[Metric]:
        """[limits.NAME]: held across the fleet; this supervisor's waiting jobs and waits."""
        in_use = GaugeMetricFamily(P + "limit_in_use", "Slots of the limit held across the fleet", labels=["limit"])
        waiting = GaugeMetricFamily(P + "limit_waiting", "This supervisor's jobs waiting for the limit now",
                                    labels=["limit"])
        waited = CounterMetricFamily(P + "limit_wait_seconds", "Seconds this supervisor's jobs spent waiting for "
                                     "the limit", labels=["limit"])
        taken = CounterMetricFamily(P + "limit_taken", "Times this supervisor's jobs took the limit", labels=["limit"])
        for v in snap.limits:
            if v.in_use is not None:
                in_use.add_metric([v.name], v.in_use)
            waiting.add_metric([v.name], v.waiting)
            waited.add_metric([v.name], v.wait_s)
            taken.add_metric([v.name], v.taken)
        yield from (in_use, waiting, waited, taken)
        yield self.gauge("consumer_paused", "1 while the consumer is paused (its PauseUntil)",
                         lambda p: int(bool(p.consumer.values.get("paused_until"))))

    def ordering(self) -> Iterator[Metric]:
        """[ordering], for each pool that has it: jobs parked for their key's turn here; the jobs
        its keys have in the stream (under its consumer's filter)."""
        ordered = [(p, p.ordering) for p in self.pools if p.ordering is not None]
        if not ordered:
            return
        Sample = tuple[PoolSnapshot, list[str], float]

        def series(kind: type, name: str, help_: str, values: list[Sample]) -> Iterator[Metric]:
            if values:
                yield self.family(kind, name, help_, [], values)
        yield from series(GaugeMetricFamily, "ordering_parked", "Jobs parked now until they are the first of their key",
                          [(p, [], v.parked) for p, v in ordered])
        yield from series(GaugeMetricFamily, "ordering_waiting_keys", "Distinct keys of the parked jobs",
                          [(p, [], v.waiting_keys) for p, v in ordered])
        yield from series(GaugeMetricFamily, "ordering_longest_wait_seconds", "How long the longest-parked job has "
                          "waited", [(p, [], max((b.since_s for b in v.blocked), default=0.0)) for p, v in ordered])
        yield from series(CounterMetricFamily, "ordering_checks", "Times workers asked the stream for a key's first job",
                          [(p, [], v.checks) for p, v in ordered])
        yield from series(CounterMetricFamily, "ordering_wait_seconds", "Seconds jobs spent parked for their key's turn",
                          [(p, [], v.waited_s) for p, v in ordered])
        counted = [(p, v.backlog) for p, v in ordered if v.backlog.get("keys") is not None]
        yield from series(GaugeMetricFamily, "ordering_backlog_keys", "Keys with jobs in the stream",
                          [(p, [], b["keys"]) for p, b in counted])
        yield from series(GaugeMetricFamily, "ordering_backlog_jobs", "Jobs in the stream that have a key",
                          [(p, [], b["jobs"]) for p, b in counted])

    def durations(self) -> Metric:
        h = HistogramMetricFamily(P + "job_duration_seconds", "Handler run time per job", labels=self.label)
        for p in self.pools:
            buckets, running = [], 0
            for bound, n in zip([*map(str, slots.DURATION_BUCKETS), "+Inf"], p.pool.duration_buckets):
                running += n
                buckets.append((bound, running))
            h.add_metric([p.name] if self.label else [], buckets, p.pool.duration_sum)
        return h

    def consumer(self) -> Iterator[Metric]:
        polled = self.pools
        Sample = tuple[PoolSnapshot, list[str], float]
        for name, key in CONSUMER_GAUGES.items():
            have: list[Sample] = [(p, [], p.consumer.values[key]) for p in polled if p.consumer.values.get(key) is not None]
            if have:
                yield self.family(GaugeMetricFamily, name, f"ConsumerInfo {key}", [], have)
        ages: list[Sample] = [(p, [], p.consumer.poll_age_s) for p in polled if p.consumer.poll_age_s is not None]
        if ages:
            yield self.family(GaugeMetricFamily, "consumer_poll_age_seconds", "Age of the last good ConsumerInfo",
                              [], ages)
        lagged = [p for p in polled if p.lag is not None]
        if lagged:
            yield self.family(GaugeMetricFamily, "lag_state", "1 for the current lag state", ["state"],
                              [(p, [s], 1.0 if p.lag and s == p.lag.state else 0.0) for p in lagged for s in LAG_STATES])
            yield self.family(CounterMetricFamily, "advisories", "JetStream advisories received", ["kind"],
                              [(p, [kind], n) for p in lagged for kind, n in p.advisories.items()])

    def crosscheck(self) -> Iterator[Metric]:
        for name, key, help_ in CROSSCHECK:
            yield self.counter(name, help_, lambda p, key=key: p.ledger[key])
        yield self.gauge("crash_outstanding", "Jobs held at a death not yet seen acked", lambda p: len(p.outstanding))


def render(snap: Snapshot) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector(snap))
    return generate_latest(registry)
