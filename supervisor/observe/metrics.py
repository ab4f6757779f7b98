"""/metrics: Prometheus text built at scrape time from the same state /status shows.
prometheus-client is used for exposition only: no registry-wide globals, no HTTP thread."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from workers.protocol import slots

P = "jetstream_supervisor_"
CONSUMER_GAUGES = {"consumer_num_pending": "num_pending", "consumer_num_ack_pending": "num_ack_pending",
                   "consumer_num_redelivered": "num_redelivered", "consumer_num_waiting": "num_waiting",
                   "consumer_ack_floor": "ack_floor_consumer_seq", "consumer_delivered": "delivered_consumer_seq"}
LAG_STATES = ("unknown", "ok", "growing", "stuck")


class Collector:
    def __init__(self, sup: Any):
        self.sup = sup

    def collect(self) -> Iterator[Metric]:
        arb, mon = self.sup.arbiter, self.sup.monitor
        yield from self.workers(arb)
        jobs = CounterMetricFamily(P + "jobs", "Jobs settled by workers, by outcome", labels=["outcome"])
        for outcome, n in arb.stats.worker_counters().items():
            jobs.add_metric([outcome], n)
        yield jobs
        yield self.durations(arb)
        yield from self.consumer(mon)
        yield from self.crosscheck(arb)

    def workers(self, arb: Any) -> Iterator[Metric]:
        g = GaugeMetricFamily(P + "workers", "Worker processes by state", labels=["state"])
        states = [w.state for w in arb.pool.living()]
        for state in ("starting", "ready", "draining"):
            g.add_metric([state], states.count(state))
        yield g
        yield GaugeMetricFamily(P + "workers_target", "Worker count asked for", value=arb.pool.target)
        autoscale = arb.autoscale.status(time.monotonic())
        yield GaugeMetricFamily(P + "autoscale_target", "Worker count autoscaling runs (workers_target when off)",
                                value=autoscale["target"])
        yield GaugeMetricFamily(P + "autoscale_enabled", "1 when autoscale.enabled", value=int(autoscale["enabled"]))
        yield GaugeMetricFamily(P + "autoscale_paused", "1 while a manual scale pauses autoscaling",
                                value=int(autoscale["resumes_in_s"] is not None))
        yield CounterMetricFamily(P + "worker_restarts", "Workers restarted after dying", value=arb.stats.totals.restarts)
        yield CounterMetricFamily(P + "worker_deaths", "Workers that died unexpectedly",
                                  value=arb.stats.totals.worker_deaths)
        yield CounterMetricFamily(P + "in_progress_pings", "+WPI sent for long jobs", value=arb.stats.totals.pings)
        failures = CounterMetricFamily(P + "loop_step_failures", "Exceptions a step of the parent's loop raised "
                                       "(logged and survived)", labels=["step"])
        for step, n in arb.steps.failures.items():
            failures.add_metric([step], n)
        yield failures

    def durations(self, arb: Any) -> Metric:
        counts, total = arb.stats.duration_histogram()
        buckets, running = [], 0
        for bound, n in zip([*map(str, slots.DURATION_BUCKETS), "+Inf"], counts):
            running += n
            buckets.append((bound, running))
        h = HistogramMetricFamily(P + "job_duration_seconds", "Handler run time per job")
        h.add_metric([], buckets, total)
        return h

    def consumer(self, mon: Any) -> Iterator[Metric]:
        info = (mon.consumer if mon else None) or {}
        for name, key in CONSUMER_GAUGES.items():
            if key in info:
                yield GaugeMetricFamily(P + name, f"ConsumerInfo {key}", value=info[key])
        if mon:
            age = mon.poll_age()
            if age is not None:
                yield GaugeMetricFamily(P + "consumer_poll_age_seconds", "Age of the last good ConsumerInfo", value=age)
            state = mon.analyzer.report(time.monotonic()).state
            g = GaugeMetricFamily(P + "lag_state", "1 for the current lag state", labels=["state"])
            for s in LAG_STATES:
                g.add_metric([s], 1.0 if s == state else 0.0)
            yield g
            a = CounterMetricFamily(P + "advisories", "JetStream advisories received", labels=["kind"])
            for kind, n in mon.advisories.items():
                a.add_metric([kind], n)
            yield a

    def crosscheck(self, arb: Any) -> Iterator[Metric]:
        c = arb.ledger.counts
        for name, key, help_ in (
                ("crash_held_jobs", "jobs_held_at_crash", "Jobs dead workers held at their death"),
                ("crash_redelivered", "held_jobs_redelivered", "Jobs held at a death seen redelivered"),
                ("crash_acked_after", "held_jobs_acked_after_crash", "Jobs held at a death acked afterwards"),
                ("unexplained_redeliveries", "unexplained_redeliveries", "Redeliveries no crash or NAK explains"),
                ("quarantined", "quarantined", "Poison jobs dead-lettered after repeated worker deaths")):
            yield CounterMetricFamily(P + name, help_, value=c[key])
        yield GaugeMetricFamily(P + "crash_outstanding", "Jobs held at a death not yet seen acked",
                                value=len(arb.ledger.outstanding(time.monotonic())))


def render(sup: Any) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector(sup))
    return generate_latest(registry)
