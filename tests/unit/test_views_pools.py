"""The views of a supervisor running several pools, from a literal Snapshot: /status `pools` and
what the top level means then, /metrics series with a `pool` label (read back by Prometheus'
parser), /healthz with a halted pool, the alerts naming their pool, the CLI's rendering."""

from __future__ import annotations

import dataclasses

from prometheus_client.parser import text_string_to_metric_families
from test_views import LEDGER, snapshot, worker

from supervisor.cli.render import render_status
from supervisor.config import Config
from supervisor.config.pools import effective
from supervisor.core.lag import LagReport
from supervisor.observe import metrics
from supervisor.observe.snapshot import Counters, KeyWait, OrderingView, PoolSnapshot
from supervisor.observe.status import build_status, health

CFG = Config().replace(pools={"email": {"filter_subject": "jobs.email.>", "handler": "app:mail"},
                              "reports": {"filter_subject": "jobs.reports.>", "handler": "app:report"}})


def two_pools(halted: str = "", reports_lag: str = "ok"):
    base = snapshot(cfg=CFG)
    email = PoolSnapshot("email", effective(CFG, "email"), base.pool, base.consumer, base.lag, base.autoscale,
                         base.crosscheck, base.ledger, base.outstanding, base.peers, base.advisories)
    one = dataclasses.replace(base.pool, target=1, ready=1, workers=(dataclasses.replace(worker(0), pool="reports"),),
                              jobs=Counters(ack=7))
    reports = PoolSnapshot("reports", effective(CFG, "reports"), one,
                           dataclasses.replace(base.consumer, name="workers-reports"),
                           LagReport(reports_lag, 1.0, 0.5, None, "rising"), {**base.autoscale, "target": 1},
                           {**LEDGER, "crashes": 4, "outstanding": []}, {**LEDGER, "unexplained_redeliveries": 1},
                           (), base.peers, {"max_deliveries": 2, "terminated": 0}, halted=halted)
    return dataclasses.replace(base, pools=(email, reports))


def test_status_has_each_pool_and_names_the_worst():
    s = build_status(two_pools(reports_lag="growing"))
    assert list(s["pools"]) == ["email", "reports"]
    r = s["pools"]["reports"]
    assert (r["workers"]["target"], r["consumer"]["name"], r["lag"]["state"], r["crosscheck"]["crashes"]) == \
        (1, "workers-reports", "growing", 4)
    assert r["workers"]["list"][0]["pool"] == "reports" and r["handler"] == "app:report" and r["halted"] is None
    assert s["headline"]["state"] == "growing" and s["headline"]["reason"].startswith("pool reports: ")
    by_kind = {a["kind"]: a for a in s["alerts"]}
    assert by_kind["ack_wait_too_short"]["pool"] == "reports"
    assert by_kind["ack_wait_too_short"]["message"].startswith("pool reports: 1 redelivery")
    assert by_kind["lag_growing"]["pool"] == "reports"


def test_a_halted_pool_fails_healthz_and_says_so():
    snap = two_pools(halted="3 workers in a row died before becoming ready")
    assert health(snap) == (False, "pool reports halted: 3 workers in a row died before becoming ready")
    s = build_status(snap)
    assert s["pools"]["reports"]["headline"]["state"] == "halted" and s["headline"]["state"] == "halted"
    text = render_status(s)
    assert "pool email  2 alive" in text and "pool reports  1 alive" in text and "HALTED" in text


def test_metrics_carry_a_pool_label_with_pools():
    families = {f.name: f for f in text_string_to_metric_families(metrics.render(two_pools()).decode())}
    P = "jetstream_supervisor_"
    target = {s.labels["pool"]: s.value for s in families[P + "workers_target"].samples}
    assert target == {"email": 2, "reports": 1}
    acked = {s.labels["pool"]: s.value for s in families[P + "jobs"].samples
             if s.name.endswith("_total") and s.labels["outcome"] == "ack"}
    assert acked == {"email": 10, "reports": 7}
    advisories = {(s.labels["pool"], s.labels["kind"]): s.value for s in families[P + "advisories"].samples
                  if s.name.endswith("_total")}
    assert advisories[("reports", "max_deliveries")] == 2
    counts = {s.labels["pool"] for s in families[P + "job_duration_seconds"].samples if s.name.endswith("_count")}
    assert counts == {"email", "reports"}
    assert {s.labels["pool"]: s.value for s in families[P + "pool_halted"].samples} == {"email": 0, "reports": 0}
    # the supervisor's own series have no pool
    assert all("pool" not in s.labels for s in families[P + "loop_step_failures"].samples)


def test_ordering_is_each_pools_own_and_the_top_level_the_first_pools():
    """Reports ordered, email not: /status pools.NAME.ordering each pool's (null for email), the
    top level email's (the first pool's, like consumer and lag: null), /metrics' ordering series
    for reports alone with its pool label, `supervisor status` an ordering line in its section."""
    view = OrderingView(key="subject:3", parked=2, waiting_keys=1, blocked=(KeyWait("x", 41, 2, 1.5),), checks=9,
                        waited_s=0.25, backlog={"keys": 1, "jobs": 3, "top": [{"key": "x", "jobs": 3}]},
                        backlog_age_s=0.5)
    snap = two_pools()
    snap = dataclasses.replace(snap, pools=(snap.pools[0], dataclasses.replace(snap.pools[1], ordering=view)))
    s = build_status(snap)
    assert s["pools"]["email"]["ordering"] is None and s["ordering"] is None
    r = s["pools"]["reports"]["ordering"]
    assert (r["key"], r["parked"], r["blocked"][0]["head_seq"], r["backlog"]["jobs"]) == ("subject:3", 2, 41, 3)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render(snap).decode())}
    P = "jetstream_supervisor_"
    assert {s.labels["pool"]: s.value for s in families[P + "ordering_parked"].samples} == {"reports": 2}
    assert {s.labels["pool"]: s.value for s in families[P + "ordering_backlog_jobs"].samples} == {"reports": 3}
    text = render_status(s)
    assert text.split("pool reports")[1].count("ordering    subject:3: 2 job(s) parked on 1 key(s); longest: key x "
                                               "behind seq 41") == 1
    assert "ordering" not in text.split("pool reports")[0]
    first = dataclasses.replace(snap, ordering=view, pools=(dataclasses.replace(snap.pools[0], ordering=view),
                                                            snap.pools[1]))
    assert build_status(first)["ordering"]["key"] == "subject:3"
