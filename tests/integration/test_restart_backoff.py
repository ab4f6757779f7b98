"""Restart backoff as the arbiter applies it, with real processes (supervisor/core/policy.py has the
pure rule and its unit tests): a worker that did useful work and is then killed comes back after
`restart.backoff_initial` every time; workers that die before they are ready back off
exponentially up to `restart.backoff_max`. Delays are read from the structured events (what the
arbiter planned) and checked against when the next worker was really forked."""

import signal

from harness import publish, wait_until

EVENTS = ("--log-format", "json")


def test_a_worker_that_did_useful_work_is_restarted_promptly_every_time(nats_server, supervisor_factory):
    initial = 0.5
    sup = supervisor_factory(nats_server, workers={"count": 1}, args=EVENTS, log={"level": "debug"},
                             restart={"backoff_initial": initial, "backoff_max": 8.0})
    sup.wait_ready(1)
    for round in range(1, 4):
        publish(nats_server.url, count=1, data="0")
        wait_until(lambda: sup.status()["jobs"]["ack"] == round, what=f"job {round} done by the current worker")
        [worker] = sup.workers()
        worker.send_signal(signal.SIGKILL)
        died = sup.wait_event("worker_died", worker_pid=worker.pid)
        planned = sup.wait_event("worker_restart_planned", worker_pid=worker.pid)
        assert planned["delay"] == initial, f"death {round}: {planned['delay']}s, not backoff_initial"
        started = wait_until(lambda: [e for e in sup.events("worker_started", slot=0) if e["ts"] >= died["ts"]],
                             what="the replacement forked")[0]
        assert initial - 0.01 <= started["ts"] - died["ts"] < initial + 3.0, (died, started)
        sup.wait_ready(1)
    assert sup.status()["workers"]["list"][0]["restarts"] == 3
    assert sup.stop() == 0


def test_workers_dying_before_ready_back_off_exponentially(nats_server, supervisor_factory):
    initial, maximum = 0.25, 2.0
    sup = supervisor_factory(nats_server, workers={"count": 1, "init": "testhandlers:boom_init"}, args=EVENTS,
                             log={"level": "debug"},
                             restart={"backoff_initial": initial, "backoff_max": maximum, "boot_failures_to_halt": 100})
    wait_until(lambda: len(sup.events("worker_restart_planned")) >= 6, timeout=60, what="six boot deaths")
    planned = sup.events("worker_restart_planned")[:6]
    assert [e["delay"] for e in planned] == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    # Each next worker was forked no sooner than its delay after the death before it.
    deaths = sup.events("worker_died")
    starts = sup.events("worker_started")
    for death, plan in zip(deaths[:5], planned[:5]):
        assert death["worker_pid"] == plan["worker_pid"] and "init hook failed" in death["cause"]
        nxt = next(s for s in starts if s["ts"] >= death["ts"] and s["worker_pid"] != death["worker_pid"])
        assert plan["delay"] - 0.01 <= nxt["ts"] - death["ts"] < plan["delay"] + 3.0, (death, plan, nxt)
    assert sup.status()["state"] != "running"          # never all ready: no READY, no "running"
    assert sup.stop() == 0
