"""`supervisor status`, `supervisor scale` and `supervisor demo` (issue 4), against real servers and
real supervisors; the rendering of odd /status states (stale poll, dead workers' jobs) as a unit."""

import json
import re
import signal
import subprocess
import sys

import psutil
import tomli_w
from harness import DEADLINE, child_env, popen_at_a_terminal, publish, run_cli, wait_until
from natsauth import free_port

from supervisor.cli.render import render_status


def one_line_error(r: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("supervisor: error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def in_flight(status: dict) -> int:
    return sum(len(w["in_flight"]) for w in status["workers"]["list"])


# ---------------------------------------------------------------- status

def test_status_text_and_json_on_a_running_supervisor(nats_server, supervisor_factory, tmp_path):
    sup = supervisor_factory(nats_server, workers={"count": 2})       # monitor.http port 0: SupervisorProc.http
    sup.wait_ready(2)
    gate = tmp_path / "gate"             # the two jobs stay in flight until the CLI has read them
    publish(nats_server.url, count=2, data=f"until:{gate}")
    s = wait_until(lambda: (lambda s: s if s and in_flight(s) == 2 and s["consumer"].get("num_ack_pending") == 2
                            else None)(sup.try_status()), what="2 jobs in flight in /status")

    r = run_cli("status", "--url", sup.http)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for w in s["workers"]["list"]:
        assert f" {w['pid']} " in out, out
    assert "JOBS/workers" in out and "pending=" in out and "ackPending=2" in out and "ackFloor=" in out, out
    assert "seq 1 #1" in out and "seq 2 #1" in out, out          # in-flight seqs with their deliveries
    assert "running" in out and "lag " in out and "crashes     0" in out and "alerts      none" in out, out
    assert "\x1b[" not in out                                   # no colours when not a terminal

    r = run_cli("status", "--json", "--url", f"http://{sup.http}/")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert {w["pid"] for w in data["workers"]["list"]} == sup.worker_pids()
    assert data["consumer"]["name"] == "workers" and "poll_age_s" in data["consumer"]

    # URL from monitor.http of a config: one naming the port the supervisor bound. Its own config
    # says port 0, as a port picked in advance may be taken (by any socket) before it binds it.
    bound = sup.tmp / "bound.toml"
    bound.write_text(tomli_w.dumps({**sup.config, "monitor": {**sup.config["monitor"], "http": sup.http}}))
    r = run_cli("status", "--config", str(bound))
    assert r.returncode == 0, r.stderr
    assert str(sup.proc.pid) in r.stdout
    gate.touch()
    wait_until(lambda: len(sup.jobs.done()) == 2, what="the two jobs done")


def test_status_and_scale_without_a_supervisor_are_one_clear_line(tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    for args in (("status", "--url", dead), ("status", "--json", "--url", dead), ("scale", "2", "--url", dead)):
        r = run_cli(*args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert "no supervisor answers at http://" + dead in one_line_error(r)
        assert r.stdout == ""

    for url in ("127.0.0.1", "ftp://127.0.0.1:1", "http://127.0.0.1:notaport"):
        r = run_cli("status", "--url", url)
        assert r.returncode == 2, (url, r.stderr)
        assert "--url" in one_line_error(r)

    config = tmp_path / "config.toml"
    config.write_text('[monitor]\nhttp = ""\n')
    r = run_cli("status", "--config", str(config))
    assert r.returncode == 2 and "monitor.http" in one_line_error(r)


def test_status_with_no_workers_and_while_draining(nats_server, supervisor_factory, tmp_path):
    sup = supervisor_factory(nats_server, workers={"count": 1})
    sup.wait_ready(1)
    r = run_cli("scale", "0", "--url", sup.http)
    assert r.returncode == 0 and "target 0 workers (was 1)" in r.stdout, r.stderr
    wait_until(lambda: (s := sup.try_status()) and not s["workers"]["list"], what="no worker left")
    r = run_cli("status", "--url", sup.http)
    assert r.returncode == 0, r.stderr
    assert "no worker processes (target 0)" in r.stdout and "pending=" in r.stdout, r.stdout

    assert run_cli("scale", "1", "--url", sup.http).returncode == 0
    sup.wait_ready(1)
    gate = tmp_path / "job-may-end"        # the job lasts until the CLI has seen the drain, however slow the box
    publish(nats_server.url, count=1, data=f"until:{gate}")
    # Running, not only held: a job held unstarted at the SIGTERM is NAKed and the worker leaves
    # at once, the supervisor with it, before any status could show it draining (seen at -n 6).
    wait_until(lambda: (s := sup.try_status()) and in_flight(s) == 1 and sup.jobs.running(), what="the long job running")
    sup.signal(signal.SIGTERM)
    wait_until(lambda: (s := sup.try_status()) and s["state"] == "draining", what="draining")
    r = run_cli("status", "--url", sup.http)
    assert r.returncode == 0, r.stderr
    assert "draining" in r.stdout.splitlines()[0], r.stdout
    assert "seq 1 #1" in r.stdout, r.stdout                       # the job it is finishing
    gate.touch()
    assert sup.wait() == 0
    assert sup.jobs.done_seqs() == {1}


def test_status_with_nats_gone_shows_the_stale_poll(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 1})
    sup.wait_ready(1)
    nats_server.stop()
    wait_until(lambda: (s := sup.try_status()) and s["lag"]["state"] == "unknown"
               and (s["consumer"]["poll_age_s"] or 0) >= 2.0, what="the last good poll going stale")
    r = run_cli("status", "--url", sup.http)
    assert r.returncode == 0, r.stderr
    assert "DISCONNECTED" in r.stdout and "STALE" in r.stdout and "poll failing" in r.stdout, r.stdout
    assert "nats_disconnected" in r.stdout, r.stdout


def test_render_status_stale_poll_dead_workers_jobs_and_alerts():
    status = {
        "version": "0.1.0", "pid": 42, "uptime_s": 3725.0, "state": "running",
        "nats": {"connected": False, "server": None, "embedded": False, "servers": ["nats://10.0.0.1:4222"]},
        "workers": {"target": 2, "alive": 1, "ready": 1, "list": [
            {"slot": 1, "pid": 4242, "state": "ready", "jobs_acked": 7, "jobs_nacked": 1, "jobs_terminated": 0,
             "restarts": 3, "rss_bytes": 31457280, "heartbeat_age_s": None, "retiring": False,
             "in_flight": [{"stream_seq": s, "delivery": 2, "age_s": s / 10} for s in range(10, 15)]}]},
        "consumer": {"stream": "JOBS", "name": "workers", "num_pending": 5, "num_ack_pending": 5,
                     "num_redelivered": 1, "num_waiting": 0, "delivered_consumer_seq": 20,
                     "ack_floor_consumer_seq": 9, "poll_age_s": 12.5, "error": "ConsumerInfo failed: timeout"},
        "lag": {"state": "unknown", "pending_slope_per_s": None, "drain_rate_per_s": None, "eta_s": None,
                "reason": "no ConsumerInfo for 12.5s"},
        "crosscheck": {"crashes": 2, "crashes_holding_jobs": 1, "jobs_held_at_crash": 7, "held_jobs_naked": 7,
                       "held_jobs_redelivered": 0, "held_jobs_acked_after_crash": 0, "unexplained_redeliveries": 0,
                       "quarantined": 0, "outstanding": [
                           {"stream_seq": s, "delivery": 1, "naked": True, "slot": 0, "pid": 4241,
                            "cause": "killed by SIGKILL", "age_s": 4.0, "redelivered": False} for s in range(1, 8)]},
        "alerts": [{"kind": "nats_disconnected", "message": "the supervisor's NATS connection is down"}],
    }
    out = render_status(status)
    assert "up 1h02m" in out and "DISCONNECTED" in out and "nats://10.0.0.1:4222" in out
    assert "4242" in out and "30.0" in out and "+2 more" in out               # RSS MB, in-flight cut at 3
    assert "seq 14 #2 1.4s" in out                                             # oldest first
    assert "polled 12s ago, STALE" in out and "poll failing: ConsumerInfo failed: timeout" in out
    assert "unknown: no ConsumerInfo for 12.5s" in out
    assert "outstanding 7 job(s)" in out and "seq 1 (delivery 1) held by worker 0 pid 4241" in out
    assert "and 2 more" in out and "nats_disconnected: the supervisor's NATS connection is down" in out
    # a supervisor that has not polled yet, and a shape with keys missing, still render
    assert "no ConsumerInfo yet" in render_status({"consumer": {"stream": "JOBS", "name": "w", "poll_age_s": None}})
    assert "no worker processes" in render_status({})


# ---------------------------------------------------------------- scale

def test_scale_up_and_down_with_jobs_flowing_loses_nothing(nats_server, supervisor_factory, tmp_path):
    """Scale 1 -> 5 -> 2 with 150 jobs queued. Every job runs until the test opens a gate, so the
    scale-down finds all five workers in a job and 145 waiting, however fast or loaded the box."""
    sup = supervisor_factory(nats_server, workers={"count": 1})
    sup.wait_ready(1)
    gate = tmp_path / "jobs-may-end"
    publish(nats_server.url, count=150, data=f"until:{gate}")
    wait_until(lambda: sup.jobs.running(), what="a job running")

    r = run_cli("scale", "5", "--url", sup.http)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("target 5 workers (was 1)"), r.stdout
    sup.wait_ready(5)
    wait_until(lambda: len({r.pid for r in sup.jobs.started()}) >= 5, what="all five workers taking jobs")

    r = run_cli("scale", "2", "--url", sup.http)
    assert r.returncode == 0 and r.stdout.startswith("target 2 workers (was 5)"), (r.stdout, r.stderr)
    assert sup.jobs.done() == [] and len(sup.jobs.running()) == 5    # the scale-down finds every worker busy
    wait_until(lambda: (s := sup.try_status()) and s["workers"]["target"] == 2 and
               sum(not w["retiring"] for w in s["workers"]["list"]) == 2, what="three workers retiring")
    gate.touch()
    wait_until(lambda: (s := sup.try_status()) and len(s["workers"]["list"]) == 2, what="back to two workers")

    wait_until(lambda: sup.jobs.done_seqs() == set(range(1, 151)), what="every job done")
    wait_until(lambda: nats_server.stream_msgs() == 0, what="stream empty (every job acked)")
    done = [r.seq for r in sup.jobs.done()]
    assert sorted(done) == list(range(1, 151)), "a job finished twice: a drained worker's ack was lost"
    assert sorted(r.seq for r in sup.jobs.started()) == list(range(1, 151)), "a retired worker's job was cut short"
    assert len(psutil.Process(sup.proc.pid).children()) == 2


def test_scale_usage_errors(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 1})
    sup.wait_ready(1)
    r = run_cli("scale", "-1", "--url", sup.http)
    assert r.returncode == 2 and "0 or more" in one_line_error(r)
    r = run_cli("scale", "5000", "--url", sup.http)                 # refused by the supervisor: 400
    assert r.returncode == 2 and "400 Bad Request" in one_line_error(r)
    assert sup.status()["workers"]["target"] == 1


# ---------------------------------------------------------------- demo

def marked_processes(where) -> list[int]:
    """Every process started in the test's own directory (the demo's processes change neither
    their directory nor, unlike their environment in /proc, keep it out of reach: process titles
    overwrite the memory /proc/PID/environ reads)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.cwd() == str(where):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found


def test_demo_runs_the_seed_scenario_and_exits_0(tmp_path):
    r = run_cli("demo", tmp=tmp_path, timeout=DEADLINE)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    # The crashing worker holds job-06, and on a loaded box also the job it had buffered to hide
    # a slow pull round trip (workers/runtime/pulls.py): every job it held is named, NAKed and back.
    crash = re.search(r"CRASHED \(exit code 13\) holding ((?:job-\d\d \(seq \d+\)(?:, )?)+), no ack; "
                      r"the supervisor NAKed (it|\d+) at once", out)
    assert crash, out
    held = re.findall(r"job-(\d\d) \(seq (\d+)\)", crash.group(1))      # in the slot table's order
    n = len(held)
    assert ("06", "6") in held and n <= 3 and crash.group(2) == ("it" if n == 1 else str(n)), out
    for name, seq in held:
        assert f"got job-{name} again (seq {seq}, delivery #2)" in out, out
    assert "ms after the crash" in out and "restarted: pid" in out, out
    assert f"deliveries={30 + n} unique=30 redelivered={n}  (workers acked 30)" in out, out
    assert "redelivered= counts jobs in flight that had been delivered before" in out, out
    assert f"delivered= counts deliveries, not jobs: {30 + n} for 30 jobs; the extra {n} " in out, out
    assert (f"cross-check: crashes=1 held at crash={n} NAKed={n} redelivered={n} acked after crash={n} unexplained=0 "
            "outstanding=0") in out, out
    assert "stream JOBS: 0 message(s) left" in out and "one worker needs about 6.0 s" in out, out
    assert out.rstrip().splitlines()[-1].startswith("PASS: every job acked (30/30)"), out
    assert len(out.splitlines()) <= 40 and "\x1b[" not in out, out
    assert "Traceback" not in r.stderr, r.stderr
    wait_until(lambda: not marked_processes(tmp_path), 10, "every process the demo started to be gone")


def test_what_a_test_will_ctrl_c_gets_sigint_even_from_a_suite_run_in_the_background():
    """The Ctrl-C tests' premise (harness.popen_at_a_terminal): with SIGINT ignored here, as in a
    suite started with `pytest &` by a script, a plain child inherits the ignore and would run on
    through the test's SIGINT; a child started at a terminal's defaults does not, and the ignore
    here is left as it was."""
    probe = [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"]
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        plain = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()
        ours = popen_at_a_terminal(probe, stdout=subprocess.PIPE, text=True).communicate(timeout=DEADLINE)[0].strip()
        after = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, saved if saved is not None else signal.default_int_handler)
    assert (plain, ours, after) == ("False", "True", signal.SIG_IGN)


def test_demo_ctrl_c_stops_its_supervisor_and_leaves_nothing_behind(tmp_path):
    proc = popen_at_a_terminal([sys.executable, "-m", "supervisor", "demo", "--jobs", "300"], cwd=tmp_path, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env())
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "published 300 jobs" in line:
                break
        assert len(marked_processes(tmp_path)) >= 5, "demo, supervisor, nats-server and 3 workers"
        proc.send_signal(signal.SIGINT)
        out = "".join(lines) + proc.stdout.read()
        assert proc.wait(DEADLINE) == 1, out
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.rstrip().endswith("FAIL: interrupted"), out
    assert "supervisor stopped cleanly" in out and "Traceback" not in out, out
    wait_until(lambda: not marked_processes(tmp_path), 10, "every process the demo started to be gone")
