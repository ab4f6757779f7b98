"""The views as functions of a literal Snapshot: /status, /healthz, the alerts, /metrics, the
fleet heartbeat and the process title, with no server, no arbiter and no worker."""

from __future__ import annotations

import dataclasses

from prometheus_client.parser import text_string_to_metric_families

from supervisor.config import Config
from supervisor.core.lag import LagReport
from supervisor.nats.consumer import POLLED_KEYS
from supervisor.observe import metrics
from supervisor.observe.snapshot import (
    Alert,
    ConsumerView,
    Counters,
    JobView,
    NatsView,
    PoolView,
    Snapshot,
    WorkerView,
)
from supervisor.observe.status import build_status, health, title
from supervisor.parent.tasks.fleet import build_beat
from workers.protocol import slots

LEDGER = {"crashes": 1, "crashes_holding_jobs": 1, "jobs_held_at_crash": 2, "held_jobs_naked": 2,
          "held_jobs_redelivered": 2, "held_jobs_acked_after_crash": 1, "unexplained_redeliveries": 0,
          "quarantined": 0}


def worker(slot: int, state: str = "ready", jobs: tuple[JobView, ...] = ()) -> WorkerView:
    return WorkerView(slot=slot, pid=1000 + slot, state=state, retiring=False, counters=Counters(ack=5, nak=1),
                      started=6, restarts=slot, rss_bytes=20_000_000, heartbeat_age_s=0.2, uptime_s=12.0, jobs=jobs)


def snapshot(**changes) -> Snapshot:
    running = JobView(stream_seq=42, delivery=2, state="running", age_s=0.5, timer_age_s=0.5,
                      reply="$JS.ACK.JOBS.workers.2.42.7.0.0")
    acked = JobView(stream_seq=41, delivery=1, state="acked", age_s=0.1, timer_age_s=0.1,
                    reply="$JS.ACK.JOBS.workers.1.41.6.0.0")
    pool = PoolView(target=2, ready=2, retiring=0, workers=(worker(0, jobs=(running, acked)), worker(1)), capacity=64,
                    jobs=Counters(ack=10, nak=2, term=1, duplicate=3),
                    duration_buckets=(4, 6, *([0] * (len(slots.DURATION_BUCKETS) - 1))), duration_sum=1.5,
                    slowest_job_s=0.4, restarts=1, worker_deaths=1, pings=7, busy=True)
    values = dict.fromkeys(POLLED_KEYS) | {"num_pending": 38, "num_ack_pending": 2, "num_redelivered": 0,
                                           "num_waiting": 1, "delivered_consumer_seq": 12, "ack_floor_consumer_seq": 10}
    base = Snapshot(
        at=100.0, version="0.1.0", pid=1234, uptime_s=12.5, state="running", stopping=False, cfg=Config(),
        nats=NatsView(connected=True, server="127.0.0.1:4222", embedded=True, servers=("nats://127.0.0.1:4222",)),
        pool=pool, consumer=ConsumerView("JOBS", "workers", values, 0.4, "self", 0, ""),
        lag=LagReport("ok", 0.0, 4.0, 9.5, "draining"),
        autoscale={"enabled": False, "target": 2, "min": 1, "max": 8, "resumes_in_s": None},
        crosscheck={**LEDGER, "outstanding": []}, loop={"step_failures": {"reap": 2}}, ledger=LEDGER,
        outstanding=(), peers={"alone": True},
        advisories={"max_deliveries": 0, "terminated": 1}, fleet={"name": "h1", "peers": 0},
        raised=(Alert("worker_deaths", "one died", 1.0),))
    return dataclasses.replace(base, **changes)


def test_status_has_the_contract_shape_from_a_snapshot():
    s = build_status(snapshot())
    assert (s["state"], s["pid"], s["nats"]["server"]) == ("running", 1234, "127.0.0.1:4222")
    assert s["workers"]["target"] == 2 and s["workers"]["alive"] == 2 and s["workers"]["ready"] == 2
    w0 = s["workers"]["list"][0]
    assert (w0["slot"], w0["jobs_acked"], w0["jobs_nacked"], w0["jobs_started"]) == (0, 5, 1, 6)
    # in_flight: what runs or waits to run; an ack waiting for its fence is not "in flight"
    assert w0["in_flight"] == [{"stream_seq": 42, "delivery": 2, "age_s": 0.5, "state": "running"}]
    assert s["consumer"]["num_pending"] == 38 and s["consumer"]["poll_age_s"] == 0.4
    assert s["lag"]["state"] == "ok" and s["headline"]["state"] == "draining"
    assert s["jobs"] == {"ack": 10, "nak": 2, "term": 1, "duplicate": 3}
    assert s["alerts"] == [{"kind": "worker_deaths", "message": "one died"}]


def test_alerts_follow_the_snapshot():
    snap = snapshot(ledger={**LEDGER, "unexplained_redeliveries": 2},
                    nats=NatsView(False, None, True, ()), lag=LagReport("stuck", None, None, None, "flat ack floor"),
                    consumer=ConsumerView("JOBS", "workers", dict.fromkeys(POLLED_KEYS), None, "self", 0, "timeout"))
    kinds = [a["kind"] for a in build_status(snap)["alerts"]]
    assert kinds == ["worker_deaths", "ack_wait_too_short", "lag_stuck", "consumer_unavailable", "nats_disconnected"]


def test_a_missing_held_job_is_an_alert_only_after_ack_wait_and_a_grace():
    late = {"stream_seq": 9, "redelivered": False, "age_s": Config().consumer.ack_wait + 10}
    early = {"stream_seq": 8, "redelivered": False, "age_s": 1.0}
    kinds = [a["kind"] for a in build_status(snapshot(outstanding=(late, early)))["alerts"]]
    assert kinds.count("held_job_missing") == 1


def test_health_reads_state_workers_and_lag():
    assert health(snapshot()) == (True, "ok")
    assert health(snapshot(state="draining")) == (False, "supervisor is draining")
    none_ready = dataclasses.replace(snapshot().pool, ready=0)
    assert health(snapshot(pool=none_ready)) == (False, "no worker ready (0/2)")
    assert health(snapshot(lag=LagReport("stuck", None, None, None, "flat"))) == (False, "lag stuck: flat")


def test_metrics_from_a_snapshot():
    families = {f.name: f for f in text_string_to_metric_families(metrics.render(snapshot()).decode())}
    P = "jetstream_supervisor_"
    jobs = {s.labels["outcome"]: s.value for s in families[P + "jobs"].samples if s.name.endswith("_total")}
    assert jobs == {"ack": 10, "nak": 2, "term": 1, "duplicate": 3}
    workers = {s.labels["state"]: s.value for s in families[P + "workers"].samples}
    assert workers == {"starting": 0, "ready": 2, "draining": 0}
    count = next(s.value for s in families[P + "job_duration_seconds"].samples if s.name.endswith("_count"))
    assert count == 10                            # the buckets summed, +Inf included
    pending = families[P + "consumer_num_pending"].samples[0].value
    assert pending == 38
    failures = {s.labels["step"]: s.value for s in families[P + "loop_step_failures"].samples
                if s.name.endswith("_total")}
    assert failures == {"reap": 2}
    lag = {s.labels["state"]: s.value for s in families[P + "lag_state"].samples}
    assert lag["ok"] == 1.0 and sum(lag.values()) == 1.0


def test_metrics_leave_out_consumer_numbers_not_yet_polled():
    snap = snapshot(consumer=ConsumerView("JOBS", "workers", dict.fromkeys(POLLED_KEYS), None, "self", 0, ""), lag=None)
    names = {f.name for f in text_string_to_metric_families(metrics.render(snap).decode())}
    assert not any(n.startswith("jetstream_supervisor_consumer_num") for n in names)
    assert "jetstream_supervisor_lag_state" not in names


def test_fleet_heartbeat_from_a_snapshot():
    beat = build_beat(snapshot(), "h1", started=5.0, jobs_per_s=3.456)
    assert beat["workers"] == {"ready": 2, "target": 2} and beat["jobs_per_s"] == 3.46
    assert (beat["capacity"], beat["acked"], beat["busy"], beat["crashes"]) == (64, 10, True, 1)
    assert beat["held"] == [[41, 1, 0.1, "$JS.ACK.JOBS.workers.1.41.6.0.0", "acked"],      # youngest timer first
                            [42, 2, 0.5, "$JS.ACK.JOBS.workers.2.42.7.0.0", "running"]]
    assert beat["held_total"] == 2
    assert beat["consumers"] == {"workers": {"capacity": 64, "held": 2, "acked": 10, "busy": True}}
    short = build_beat(snapshot(), "h1", started=5.0, jobs_per_s=0.0, held_budget=60)
    assert len(short["held"]) == 1 and short["held_total"] == 2   # the youngest timer kept


def test_process_title_from_a_snapshot():
    def of(snap):
        return title(snap.pool.ready, snap.pool.target, snap.state)
    assert of(snapshot()) == "2/2 ready"
    assert of(snapshot(state="draining")) == "2/2 ready, draining"
