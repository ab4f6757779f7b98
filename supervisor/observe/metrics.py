"""/metrics: Prometheus text built at scrape time from the Snapshot /status shows.
prometheus-client is used for exposition only: no registry-wide globals, no HTTP thread."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from supervisor.observe.snapshot import PoolView, Snapshot
from workers.protocol import slots

P = "jetstream_supervisor_"
CONSUMER_GAUGES = {"consumer_num_pending": "num_pending", "consumer_num_ack_pending": "num_ack_pending",
                   "consumer_num_redelivered": "num_redelivered", "consumer_num_waiting": "num_waiting",
                   "consumer_ack_floor": "ack_floor_consumer_seq", "consumer_delivered": "delivered_consumer_seq"}
LAG_STATES = ("unknown", "ok", "growing", "stuck")


class Collector:
    def __init__(self, snap: Snapshot):
        self.snap = snap

    def collect(self) -> Iterator[Metric]:
        pool = self.snap.pool
        yield from self.workers(self.snap)
        jobs = CounterMetricFamily(P + "jobs", "Jobs settled by workers, by outcome", labels=["outcome"])
        for outcome, n in pool.jobs.as_dict().items():
            jobs.add_metric([outcome], n)
        yield jobs
        yield self.durations(pool)
        yield from self.consumer(self.snap)
        yield from self.crosscheck(self.snap)
        yield from self.limits(self.snap)
        yield from self.ordering(self.snap)

    def workers(self, snap: Snapshot) -> Iterator[Metric]:
        pool = snap.pool
        g = GaugeMetricFamily(P + "workers", "Worker processes by state", labels=["state"])
        states = [w.state for w in pool.workers]
        for state in ("starting", "ready", "draining"):
            g.add_metric([state], states.count(state))
        yield g
        yield GaugeMetricFamily(P + "workers_target", "Worker count asked for", value=pool.target)
        autoscale = snap.autoscale
        yield GaugeMetricFamily(P + "autoscale_target", "Worker count autoscaling runs (workers_target when off)",
                                value=autoscale["target"])
        yield GaugeMetricFamily(P + "autoscale_enabled", "1 when autoscale.enabled", value=int(autoscale["enabled"]))
        yield GaugeMetricFamily(P + "autoscale_paused", "1 while a manual scale pauses autoscaling",
                                value=int(autoscale["resumes_in_s"] is not None))
        yield CounterMetricFamily(P + "worker_restarts", "Workers restarted after dying", value=pool.restarts)
        yield CounterMetricFamily(P + "worker_deaths", "Workers that died unexpectedly", value=pool.worker_deaths)
        yield CounterMetricFamily(P + "in_progress_pings", "+WPI sent for long jobs", value=pool.pings)
        failures = CounterMetricFamily(P + "loop_step_failures", "Exceptions a step of the parent's loop raised "
                                       "(logged and survived)", labels=["step"])
        for step, n in snap.loop.get("step_failures", {}).items():
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
        yield GaugeMetricFamily(P + "consumer_paused", "1 while the consumer is paused (its PauseUntil)",
                                value=int(bool(snap.consumer.values.get("paused_until"))))

    def ordering(self, snap: Snapshot) -> Iterator[Metric]:
        """[ordering]: jobs parked for their key's turn here; the jobs keys have in the stream."""
        v = snap.ordering
        if v is None:
            return
        yield GaugeMetricFamily(P + "ordering_parked", "Jobs parked now until they are the first of their key",
                                value=v.parked)
        yield GaugeMetricFamily(P + "ordering_waiting_keys", "Distinct keys of the parked jobs", value=v.waiting_keys)
        yield GaugeMetricFamily(P + "ordering_longest_wait_seconds", "How long the longest-parked job has waited",
                                value=max((b.since_s for b in v.blocked), default=0.0))
        yield CounterMetricFamily(P + "ordering_checks", "Times workers asked the stream for a key's first job",
                                  value=v.checks)
        yield CounterMetricFamily(P + "ordering_wait_seconds", "Seconds jobs spent parked for their key's turn",
                                  value=v.waited_s)
        if v.backlog.get("keys") is not None:
            yield GaugeMetricFamily(P + "ordering_backlog_keys", "Keys with jobs in the stream", value=v.backlog["keys"])
            yield GaugeMetricFamily(P + "ordering_backlog_jobs", "Jobs in the stream that have a key",
                                    value=v.backlog["jobs"])

    def durations(self, pool: PoolView) -> Metric:
        buckets, running = [], 0
        for bound, n in zip([*map(str, slots.DURATION_BUCKETS), "+Inf"], pool.duration_buckets):
            running += n
            buckets.append((bound, running))
        h = HistogramMetricFamily(P + "job_duration_seconds", "Handler run time per job")
        h.add_metric([], buckets, pool.duration_sum)
        return h

    def consumer(self, snap: Snapshot) -> Iterator[Metric]:
        c = snap.consumer
        for name, key in CONSUMER_GAUGES.items():
            if c.values.get(key) is not None:
                yield GaugeMetricFamily(P + name, f"ConsumerInfo {key}", value=c.values[key])
        if c.poll_age_s is not None:
            yield GaugeMetricFamily(P + "consumer_poll_age_seconds", "Age of the last good ConsumerInfo",
                                    value=c.poll_age_s)
        if snap.lag is not None:
            g = GaugeMetricFamily(P + "lag_state", "1 for the current lag state", labels=["state"])
            for s in LAG_STATES:
                g.add_metric([s], 1.0 if s == snap.lag.state else 0.0)
            yield g
            a = CounterMetricFamily(P + "advisories", "JetStream advisories received", labels=["kind"])
            for kind, n in snap.advisories.items():
                a.add_metric([kind], n)
            yield a

    def crosscheck(self, snap: Snapshot) -> Iterator[Metric]:
        c = snap.ledger
        for name, key, help_ in (
                ("crash_held_jobs", "jobs_held_at_crash", "Jobs dead workers held at their death"),
                ("crash_redelivered", "held_jobs_redelivered", "Jobs held at a death seen redelivered"),
                ("crash_acked_after", "held_jobs_acked_after_crash", "Jobs held at a death acked afterwards"),
                ("unexplained_redeliveries", "unexplained_redeliveries", "Redeliveries no crash or NAK explains"),
                ("quarantined", "quarantined", "Poison jobs dead-lettered after repeated worker deaths")):
            yield CounterMetricFamily(P + name, help_, value=c[key])
        yield GaugeMetricFamily(P + "crash_outstanding", "Jobs held at a death not yet seen acked",
                                value=len(snap.outstanding))


def render(snap: Snapshot) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector(snap))
    return generate_latest(registry)
