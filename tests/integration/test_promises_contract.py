"""Promises of docs/CONTRACT.md and the README that no other test would notice breaking (issue 17): the
`/status` JSON shape, the crash counters and the `worker_deaths` alert, and the consumer's
`filter_subject` and `backoff` reaching the server and doing what they say. Real nats-server,
real supervisor, real workers; every expectation below is written from the SPEC/README text,
not from the product's code."""

import json
import urllib.request
from typing import Any

from harness import publish, wait_until
from test_observability import metric_families, value

NUMBER = (int, float)
NONE = type(None)

# The /status tree docs/CONTRACT.md promises, key by key ("## HTTP", the `/status` JSON block, and "Wave 2
# additions"). A tuple of types is a leaf; a dict is an object whose keys must all be present
# (more are welcome, says SPEC); a one-element list is a list whose every entry has that shape.
STATUS_SHAPE: dict[str, Any] = {
    "version": (str,),                      # "version": "0.1.0"
    "pid": (int,),                          # "pid": 1234
    "uptime_s": NUMBER,                     # "uptime_s": 12.5
    "state": (str,),                        # "state": "running" (starting | running | draining | stopping)
    "nats": {                               # "nats": {"connected": true, "server": "127.0.0.1:4222", "embedded": true}
        "connected": (bool,),
        "server": (str,),
        "embedded": (bool,),
    },
    "workers": {                            # "workers": {"target": 8, "alive": 8, "list": [...]}
        "target": (int,),
        "alive": (int,),
        "list": [{                          # {"slot": 0, "pid": 1240, "state": "ready", ...
            "slot": (int,),
            "pid": (int,),
            "state": (str,),                # starting | ready | draining
            "jobs_acked": (int,),           # "jobs_acked": 10, "jobs_nacked": 0,
            "jobs_nacked": (int,),
            "jobs_terminated": (int,),      # "jobs_terminated": 0, "restarts": 1, "rss_bytes": 21000000,
            "restarts": (int,),
            "rss_bytes": (int,),
            "in_flight": [{                 # "in_flight": [{"stream_seq": 42, "delivery": 1, "age_s": 0.1}]
                "stream_seq": (int,),
                "delivery": (int,),
                "age_s": NUMBER,
            }],
        }],
    },
    "consumer": {                           # "consumer": {"stream": "JOBS", "name": "workers", "num_pending": 38,
        "stream": (str,),
        "name": (str,),
        "num_pending": (int,),
        "num_ack_pending": (int,),          # "num_ack_pending": 2, "num_redelivered": 0, "num_waiting": 1,
        "num_redelivered": (int,),
        "num_waiting": (int,),
        "delivered_consumer_seq": (int,),   # "delivered_consumer_seq": 2, "ack_floor_consumer_seq": 0,
        "ack_floor_consumer_seq": (int,),
        "poll_age_s": NUMBER,               # "poll_age_s": 0.4
    },
    "lag": {                                # "lag": {"state": "growing", "pending_slope_per_s": 3.9,
        "state": (str,),                    #         "drain_rate_per_s": 4.0, "eta_s": 9.5}
        "pending_slope_per_s": NUMBER,
        "drain_rate_per_s": NUMBER,
        "eta_s": (*NUMBER, NONE),           # null while nothing drains (a job in flight, none acked yet)
    },
    "crosscheck": {                         # "crosscheck": {"crashes": 1, "crashes_holding_jobs": 1,
        "crashes": (int,),
        "crashes_holding_jobs": (int,),
        "jobs_held_at_crash": (int,),       # "jobs_held_at_crash": 1, "held_jobs_naked": 1,
        "held_jobs_naked": (int,),
        "held_jobs_redelivered": (int,),    # "held_jobs_redelivered": 1, "held_jobs_acked_after_crash": 1,
        "held_jobs_acked_after_crash": (int,),
        "unexplained_redeliveries": (int,),  # "unexplained_redeliveries": 0, "quarantined": 0, "outstanding": []
        "quarantined": (int,),
        "outstanding": (list,),
    },
    "alerts": [{"kind": (str,), "message": (str,)}],   # "alerts": [{"kind": "ack_wait_too_short", "message": "..."}]
    # Wave 2: "/status gains "autoscale": {"enabled", "target", "min", "max", "reason", "last_change_s"}
    "autoscale": {
        "enabled": (bool,),
        "target": (int,),
        "min": (int,),
        "max": (int,),
        "reason": (str,),
        "last_change_s": (*NUMBER, NONE),   # null until the count has changed once
    },
    "fleet": {"name": (str,), "peers": (int,)},   # Wave 2: and "fleet": {"name", "peers": n}
}
STATES = {"starting", "running", "draining", "stopping"}
WORKER_STATES = {"starting", "ready", "draining"}
LAG_STATES = {"unknown", "ok", "growing", "stuck"}


def shape_errors(value: Any, shape: Any, path: str = "status") -> list[str]:
    """Every place `value` misses `shape`: a missing key, a wrong type, a list entry that does."""
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return [f"{path}: {type(value).__name__}, not an object"]
        return [err for k, sub in shape.items()
                for err in (shape_errors(value[k], sub, f"{path}.{k}") if k in value else [f"{path}.{k}: missing"])]
    if isinstance(shape, list):
        if not isinstance(value, list):
            return [f"{path}: {type(value).__name__}, not a list"]
        return [err for i, item in enumerate(value) for err in shape_errors(item, shape[0], f"{path}[{i}]")]
    # bool is an int to isinstance: a count that is True/False is as wrong as a string.
    if isinstance(value, bool) and bool not in shape or not isinstance(value, shape):
        return [f"{path}: {value!r} is not {' or '.join(t.__name__ for t in shape)}"]
    return []


def test_status_json_has_every_key_spec_lists(supervisor_factory, tmp_path):
    """One live supervisor on the embedded server, one job held in flight by the test: every key
    of the contract's /status block is there with its type, at every level, the enums within their sets."""
    gate = tmp_path / "gate"
    sup = supervisor_factory(None, workers={"count": 2})
    sup.wait_ready(2)
    server = sup.status()["nats"]["server"]
    try:
        publish(f"nats://{server}", count=1, data=f"until:{gate}")

        def settled():   # the job in flight, a ConsumerInfo poll since, the lag analysed
            s = sup.status()
            busy = [w for w in s["workers"]["list"] if w["in_flight"]]
            return s if busy and s["consumer"].get("num_ack_pending") == 1 and s["lag"]["state"] != "unknown" else None
        wait_until(settled, what="a job in flight, polled and analysed")
        # The fleet counts its peers after its first heartbeat round; until then peers is null.
        wait_until(lambda: isinstance(sup.status()["fleet"].get("peers"), int), timeout=30,
                   what="fleet.peers (docs/CONTRACT.md: a number n)")
        status = settled()
        assert status, "the job left flight while the test held it"
        assert shape_errors(status, STATUS_SHAPE) == []
        assert status["nats"]["embedded"] is True and status["nats"]["connected"] is True
        assert status["nats"]["server"].startswith("127.0.0.1:")      # host:port, as in SPEC
        assert status["state"] in STATES and status["lag"]["state"] in LAG_STATES
        assert {w["state"] for w in status["workers"]["list"]} <= WORKER_STATES
        assert status["workers"]["target"] == status["workers"]["alive"] == len(status["workers"]["list"]) == 2
        held = [j for w in status["workers"]["list"] for j in w["in_flight"]]
        assert [(j["stream_seq"], j["delivery"]) for j in held] == [(1, 1)] and held[0]["age_s"] >= 0
        assert (status["consumer"]["stream"], status["consumer"]["name"]) == ("JOBS", "workers")
        assert all(w["rss_bytes"] > 0 for w in status["workers"]["list"])
    finally:
        gate.touch()
    wait_until(lambda: sup.status()["consumer"].get("num_ack_pending") == 0, what="the held job acked")
    assert sup.stop() == 0


def test_worker_deaths_alert_and_crash_metrics_match_the_crosscheck(nats_server, supervisor_factory):
    """README "Restarts": at least 5 deaths in 60 s (policy.DeathRate: STORM_MIN_DEATHS, or one per
    worker if more) raise a `worker_deaths` alert naming the causes. docs/CONTRACT.md /metrics: restarts,
    crash-held and crash-redelivered counters, which must agree with /status's crosscheck and
    with the job journal (each death is one crash-once job's first delivery, never finished)."""
    deaths = 5
    sup = supervisor_factory(nats_server, workers={"count": 2, "batch": 1},
                             restart={"backoff_initial": 0.05, "backoff_max": 0.5})
    sup.wait_ready(2)
    # One at a time, each redone and acked before the next: a worker dies holding only the job
    # that kills it. Acked means the stream empty AND no worker's table holding it: an ACKED entry
    # stays until its fence proves the server read the ack (/status `settling`), and one still
    # there at the next death is a job held at that crash too (6 == 5 once, at load 11-16).
    def settled() -> bool:
        return nats_server.stream_msgs() == 0 and not any(w["in_flight"] or w["settling"]
                                                            for w in sup.status()["workers"]["list"])
    for n in range(1, deaths + 1):
        publish(nats_server.url, count=1, data="crash-once")
        wait_until(lambda n=n: sup.status()["crosscheck"]["crashes"] >= n, what=f"worker death {n}")
        wait_until(settled, what=f"crash-once job {n} redone, acked and its ack fenced")
    alert = wait_until(lambda: [a for a in sup.status()["alerts"] if a["kind"] == "worker_deaths"],
                       what="the worker_deaths alert")[0]
    assert f"{deaths} worker deaths" in alert["message"] and f"{deaths}x exit code 13" in alert["message"], alert

    def quiet():   # every held job seen redelivered and acked, every slot refilled: counters stop moving
        s = sup.status()
        c = s["crosscheck"]
        return s if c["held_jobs_acked_after_crash"] == deaths and not c["outstanding"] \
            and s["workers"]["ready"] == 2 else None
    status = wait_until(quiet, what="the crash cross-check settled")
    code, text = sup.get("/metrics")
    assert code == 200
    fams, c, p = metric_families(text), status["crosscheck"], "jetstream_supervisor_"
    killed = [r for r in sup.jobs.started() if r.data == "crash-once" and r.delivery == 1]
    assert len(killed) == c["crashes"] == c["crashes_holding_jobs"] == deaths
    assert value(fams, p + "worker_restarts") == c["crashes"] == sum(w["restarts"] for w in status["workers"]["list"])
    assert value(fams, p + "crash_held_jobs") == c["jobs_held_at_crash"] == deaths
    assert value(fams, p + "crash_redelivered") == c["held_jobs_redelivered"] == deaths
    assert value(fams, p + "unexplained_redeliveries") == c["unexplained_redeliveries"] == 0
    assert sorted(r.seq for r in sup.jobs.done()) == list(range(1, deaths + 1))
    assert sup.stop() == 0


def consumer_config(server: Any, stream: str = "JOBS", name: str = "workers") -> dict:
    """The consumer's config as the server holds it (/jsz with config=true)."""
    url = f"http://127.0.0.1:{server.monitor_port}/jsz?consumers=true&config=true"
    with urllib.request.urlopen(url, timeout=5) as r:
        jsz = json.load(r)
    for account in jsz.get("account_details", []):
        for s in account.get("stream_detail", []):
            for c in s.get("consumer_detail", []) if s["name"] == stream else ():
                if c["name"] == name:
                    return c["config"]
    raise AssertionError(f"consumer {stream}/{name} not found in /jsz")


def test_filter_subject_runs_only_its_subject(nats_server, supervisor_factory):
    """consumer.filter_subject: the server-side consumer filters, so jobs on other subjects of the
    stream never reach a worker. jobs.b is published first: a consumer without the filter would
    hand those out before the jobs.a behind them."""
    sup = supervisor_factory(nats_server, stream={"subjects": ["jobs.a", "jobs.b"]},
                             consumer={"filter_subject": "jobs.a"})
    sup.wait_ready(2)
    assert consumer_config(nats_server).get("filter_subject") == "jobs.a"
    publish(nats_server.url, count=3, data="b:0", extra=("--subject", "jobs.b"))
    publish(nats_server.url, count=3, data="a:0", extra=("--subject", "jobs.a"))
    wait_until(lambda: sum(r.data == "a:0" for r in sup.jobs.done()) == 3
               and nats_server.consumer()["num_ack_pending"] == 0, what="the jobs.a jobs done and acked")
    assert sorted(r.data for r in sup.jobs.started()) == ["a:0"] * 3
    assert sorted(r.seq for r in sup.jobs.done()) == [4, 5, 6]
    assert nats_server.stream_msgs() == 3                  # the jobs.b jobs wait in the stream, untouched
    assert nats_server.consumer()["num_pending"] == 0      # jobs.b is not the consumer's to count
    assert sup.stop() == 0


def test_backoff_reaches_the_server_and_pings_outlast_its_first_step(nats_server, supervisor_factory):
    """consumer.backoff: the server applies backoff[0] instead of AckWait to a first delivery
    (policy.ack_wait_for), so the in-progress pings must beat that step, not ack_wait: a job more
    than twice as long as backoff[0] still runs once, on its first delivery."""
    first_step, job_s = 4.0, 9.0      # a ping every third of the step: seconds of slack on a loaded box
    sup = supervisor_factory(nats_server, consumer={"ack_wait": 60.0, "backoff": [first_step, 30.0], "max_deliver": 5})
    sup.wait_ready(2)
    config = consumer_config(nats_server)
    assert config.get("backoff") == [int(first_step * 1e9), int(30e9)]     # nanoseconds, as NATS keeps them
    publish(nats_server.url, count=1, data=str(job_s))
    done = wait_until(lambda: sup.jobs.done(), timeout=job_s + 60, what="the long job done")
    started = sup.jobs.started()
    assert [(r.seq, r.delivery) for r in started] == [(1, 1)], started
    assert done[0].t - started[0].t >= job_s > 2 * first_step                   # it did outlast the step
    wait_until(lambda: nats_server.consumer()["num_ack_pending"] == 0, what="the job acked")
    assert nats_server.consumer()["num_redelivered"] == 0
    _, text = sup.get("/metrics")
    assert value(metric_families(text), "jetstream_supervisor_in_progress_pings") >= 2
    assert sup.stop() == 0


def test_status_consumer_keys_are_there_and_null_before_the_first_poll():
    """A script reading /status["consumer"]["num_pending"] must not hit a missing key in the
    moment between start and the first ConsumerInfo answer: every polled key is there, null."""
    from types import SimpleNamespace

    from supervisor.nats.consumer import POLLED_KEYS, consumer_dict
    from supervisor.observe.status import consumer_block
    from supervisor.parent.snapshots import consumer_view

    block = consumer_block(consumer_view(None, "JOBS", "workers"))
    assert set(STATUS_SHAPE["consumer"]) - {"poll_age_s"} <= {"stream", "name", *POLLED_KEYS}
    assert {k: block[k] for k in (*POLLED_KEYS, "poll_age_s")} == dict.fromkeys((*POLLED_KEYS, "poll_age_s"))
    assert (block["stream"], block["name"]) == ("JOBS", "workers")
    seqs = SimpleNamespace(consumer_seq=1, stream_seq=1)    # POLLED_KEYS names exactly what a poll adds
    info = SimpleNamespace(stream_name="JOBS", name="workers", num_pending=0, num_ack_pending=0, num_redelivered=0,
                           num_waiting=0, delivered=seqs, ack_floor=seqs, cluster=None, created="2026-12-01")
    assert set(consumer_dict(info)) == {"stream", "name", *POLLED_KEYS}
