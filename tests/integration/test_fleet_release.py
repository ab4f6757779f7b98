"""R10: releasing a lost host's jobs (supervisor/parent/tasks/fleet.py) must not release a live host's.

Two ways a live host went silent, each made real here: a heartbeat too big for the server's
max_payload (nats-py refuses it before sending: MaxPayloadError, on every beat), and heartbeats
the bucket refuses (a value over its max_value_size: the server says no, as in any KV trouble).
Capping the held list fixes the first; the probe (ask the silent parent over core NATS before
declaring it lost) the second. The tests count runs in the handlers' journal.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import nats
import nats.errors
import psutil
from harness import NatsServer, publish, run_cli, wait_until
from nats.js.errors import APIError
from test_fleet_cluster import fleet_view

from supervisor.config import Config
from supervisor.parent.tasks.fleet import Fleet, cap_held

ACK_WAIT = 300.0      # a second run within the test is a release, never an expiry
JSON_LOGS = ("--log-format", "json")


def test_a_heartbeat_lists_the_youngest_timers_within_its_budget():
    held = [[seq, 1, float(age), f"$JS.ACK.JOBS.workers.1.{seq}.{seq}.1796162710029000000.0", "running"]
            for seq, age in ((1, 9), (2, 1), (3, 5), (4, 0))]
    one = len(json.dumps(held[0], separators=(",", ":"))) + 1
    assert [j[0] for j in cap_held(held, 2 * one + 1)] == [4, 2]
    assert [j[0] for j in cap_held(held, 10**6)] == [4, 2, 3, 1]
    assert cap_held(held, 0) == []


def host(factory, server, name: str, **workers):
    return factory(server, args=JSON_LOGS, consumer={"ack_wait": ACK_WAIT},
                   fleet={"name": name, "heartbeat": 0.5}, workers={"count": 2, **workers})


def poller_without_workers(factory, server):
    """Host beta: the fleet's poller (started first), with no worker of its own until `ready_to_rerun`,
    so every job runs on alpha, and a second run anywhere is beta's release of one."""
    beta = host(factory, server, "beta", count=0)
    beta.wait_ready(0)
    wait_until(lambda: (beta.try_status() or {}).get("fleet", {}).get("is_poller"), what="beta the poller")
    return beta


def ready_to_rerun(beta) -> None:
    """Beta gets idle workers: a job released now runs there at once, beside alpha's run of it."""
    r = run_cli("scale", "2", "--url", beta.http)
    assert r.returncode == 0, r.stderr
    beta.wait_ready(2)


def listed(beta, n: int) -> dict:
    """Alpha's row in the fleet view once a heartbeat of it holding `n` jobs got through."""
    return wait_until(lambda: next((r for r in fleet_view(beta)["supervisors"] if r["name"] == "alpha"
                                    and r["held"] == n), None), what=f"a heartbeat of alpha holding {n} jobs")


def hold(server_url: str, alpha, n: int, total: int, gate) -> None:
    publish(server_url, count=n, data=f"until:{gate}")
    wait_until(lambda: len(alpha.jobs.running()) == total, what=f"alpha running {total} jobs")


def alpha_grows(factory, server, gate, concurrency: int, first: int, total: int):
    """Beta polls; alpha runs `first` jobs and a heartbeat of it listing them all lands, then it
    runs `total`, and beta gets workers for whatever is released. (alpha, beta)"""
    beta = poller_without_workers(factory, server)
    alpha = host(factory, server, "alpha", concurrency=concurrency)
    alpha.wait_ready()
    hold(server.url, alpha, first, first, gate)
    assert listed(beta, first)["held_listed"] == first
    hold(server.url, alpha, total - first, total, gate)
    ready_to_rerun(beta)
    return alpha, beta


def each_ran_once(server, gate, alpha, beta) -> None:
    assert not beta.events("fleet_peer_lost"), beta.events("fleet_peer_lost")
    gate.touch()
    wait_until(lambda: server.stream_msgs() == 0, what="every job acked")
    starts = [(r.seq, r.delivery) for s in (alpha, beta) for r in s.jobs.started()]
    assert len(starts) == len({seq for seq, _ in starts}), "a job ran twice"
    assert beta.status()["fleet"]["released_jobs"] == 0
    assert alpha.stop() == 0 and beta.stop() == 0


def test_a_host_holding_more_jobs_than_a_heartbeat_can_list_keeps_beating(tmp_path, supervisor_factory):
    """max_payload 4 KB: host alpha's heartbeat lists the 20 jobs it runs (about 2 KB), then it
    takes 60 more. Its heartbeats list what fits and say how many it holds, and keep landing for
    longer than the loss threshold, so beta, the poller, never declares it lost nor releases its
    running jobs. Without the cap each beat holding 80 raised MaxPayloadError, alpha went
    silent, and beta released the 20 its last beat listed: they ran twice."""
    conf = tmp_path / "small.conf"
    conf.write_text("max_payload: 4096\n")
    server = NatsServer(tmp_path / "store", extra_args=("-c", str(conf))).start()
    try:
        gate = tmp_path / "finish"
        alpha, beta = alpha_grows(supervisor_factory, server, gate, concurrency=40, first=20, total=80)
        row = listed(beta, 80)
        assert 20 < row["held_listed"] < 80, row
        beats = alpha.status()["fleet"]["beats"]
        wait_until(lambda: alpha.status()["fleet"]["beats"] > beats + 4, what="alpha beating on, past the loss threshold")
        assert "fleet_heartbeat_failing" not in {a["kind"] for a in alpha.status()["alerts"]}
        each_ran_once(server, gate, alpha, beta)
    finally:
        server.stop()


async def small_fleet_bucket(url: str, max_value_size: int) -> None:
    """The fleet bucket as the supervisor creates it (supervisor/nats/provision.py), but refusing values
    over `max_value_size` bytes."""
    from supervisor.nats.provision import FLEET_KEEP_S

    nc = await nats.connect(url)
    try:
        await nc.jetstream().create_key_value(bucket="SUPERVISOR_FLEET", history=1, ttl=FLEET_KEEP_S,
                                              max_value_size=max_value_size)
    finally:
        await nc.close()


def test_a_silent_host_that_answers_over_nats_is_not_declared_lost(nats_server, supervisor_factory, tmp_path):
    """A 1 KB max_value_size on the fleet bucket: alpha's heartbeat listing the 3 jobs it runs
    fits, but once it runs 12 the bucket refuses its heartbeats (beta's, holding none, fit), so
    beta, the poller, sees alpha silent for 3 beats. Before it declares alpha lost it asks
    alpha's parent over core NATS, gets an answer, and leaves alpha's jobs alone; alpha's
    /status says its heartbeats fail. Without the probe beta released the 3 jobs alpha's last
    heartbeat listed, and they ran twice."""
    asyncio.run(small_fleet_bucket(nats_server.url, 1024))
    gate = tmp_path / "finish"
    alpha, beta = alpha_grows(supervisor_factory, nats_server, gate, concurrency=6, first=3, total=12)
    alive = beta.wait_event("fleet_peer_silent_alive", peer="alpha")
    assert alive["failing"], alive                  # alpha told the prober why its heartbeats fail
    alerts = wait_until(lambda: [a for a in alpha.status()["alerts"] if a["kind"] == "fleet_heartbeat_failing"],
                        what="alpha's alert: its heartbeats fail")
    assert "declares this supervisor lost" in alerts[0]["message"]
    each_ran_once(nats_server, gate, alpha, beta)


def test_a_heartbeat_nats_py_refuses_is_an_alert_at_once_any_other_failure_after_two_beats():
    cfg = Config().replace(fleet={"heartbeat": 0.5})
    ours, theirs = Fleet(cfg, None, None, None), Fleet(cfg, None, None, None)   # no NATS, no arbiter: only the alerts
    ours.beat_failed(0.0, nats.errors.MaxPayloadError())
    [alert] = ours.alerts()
    assert alert["kind"] == "fleet_heartbeat_failing" and "MaxPayloadError" in alert["message"]
    assert "NAKs the jobs its workers run" in alert["message"]       # release_lost is on by default
    now = time.monotonic()
    theirs.beat_failed(now, APIError(description="maximum message size exceeded"))
    assert theirs.alerts() == []                                     # one missed beat: a hiccup
    theirs.failing = (now - 1.0, theirs.failing[1])                  # two beats (0.5 s) of them
    assert [a["kind"] for a in theirs.alerts()] == ["fleet_heartbeat_failing"]


def test_an_orphan_does_not_nak_a_job_the_poller_released_while_it_ran(nats_server, supervisor_factory, tmp_path):
    """Seed 52 of the randomized fault suite (branch pools, `--seed 52 --minutes 0.5`, 1 run of 5):
    a fleet of two, heartbeat 0.5 s. A job ran at delivery 1 in a worker of the supervisor
    SIGKILLed at +10.03 s, came back at delivery 2 at +11.80 s on a worker no fault touched, and
    delivery 3 started at +12.05 s while delivery 2 still ran. The interleaving: the dead
    parent's worker is an orphan that runs its jobs for ORPHAN_GRACE (2 s) and then NAKs what
    still runs; the poller, 3 missed heartbeats (1.5 s) after the parent's last one, found it
    lost (its probe: nobody answers) and released the jobs its last heartbeat listed, the orphan's
    running job among them: delivery 2. The orphan's NAK at the end of its grace matches by
    stream sequence and hit delivery 2: delivery 3, beside it. Here the orphan is SIGSTOPped
    before its parent's SIGKILL and let go once the job's delivery 2 runs on beta, the poller;
    its grace then ends with the job still running. Now an orphan claims its jobs in its parent's
    heartbeat before it NAKs (workers/protocol/fleetclaim.py); here the poller's mark came first,
    and names the job released: the orphan leaves it alone. Red without the claim: delivery 3."""
    gate = tmp_path / "finish"
    alpha, beta, seq, orphan = orphan_running_one_job(supervisor_factory, nats_server, gate)
    os.kill(orphan, signal.SIGSTOP)
    alpha.proc.kill()
    alpha.proc.wait()
    lost = beta.wait_event("fleet_peer_lost", peer="alpha")
    assert lost["released"] == [seq], lost
    wait_until(lambda: [r for r in beta.jobs.running() if (r.seq, r.delivery) == (seq, 2)], what="delivery 2 on beta")
    os.kill(orphan, signal.SIGCONT)
    wait_until(lambda: not alive(orphan), what="the orphan gone, its grace over")
    ran_once_each(nats_server, gate, alpha, beta, [(seq, 1), (seq, 2)])
    assert alpha.events("orphan_nak_skipped", seq=seq, delivery=1, released=True), alpha.log()[-3000:]


def test_an_orphans_claim_keeps_the_poller_from_releasing_what_it_holds(nats_server, supervisor_factory, tmp_path):
    """The other order (what a healthy orphan does): alpha SIGKILLed, its worker claims the job it
    runs in alpha's heartbeat at once, so beta's first lost mark fails (the entry moved) and its
    next one, once the claim too is 3 heartbeats old, lists nothing to release; the orphan's grace
    ends with the job running, and its NAK brings it to beta once (delivery 2), nothing after."""
    gate = tmp_path / "finish"
    alpha, beta, seq, orphan = orphan_running_one_job(supervisor_factory, nats_server, gate)
    alpha.proc.kill()
    alpha.proc.wait()
    wait_until(lambda: not alive(orphan), what="the orphan gone, its grace over")
    lost = beta.wait_event("fleet_peer_lost", peer="alpha")
    assert (lost["held"], lost["released"]) == (0, []), lost
    wait_until(lambda: [r for r in beta.jobs.running() if (r.seq, r.delivery) == (seq, 2)], what="delivery 2 on beta")
    assert not alpha.events("orphan_nak_skipped") and not alpha.events("orphan_claim_failed"), alpha.log()[-3000:]
    ran_once_each(nats_server, gate, alpha, beta, [(seq, 1), (seq, 2)])


def orphan_running_one_job(factory, server, gate):
    """Beta polls (heartbeat 0.5 s, 2 idle workers); alpha's only worker runs one job, which a
    heartbeat of alpha's lists. (alpha, beta, the job's seq, alpha's worker's pid)"""
    beta = poller_without_workers(factory, server)
    alpha = host(factory, server, "alpha", count=1)
    alpha.wait_ready()
    hold(server.url, alpha, 1, 1, gate)
    [seq] = [r.seq for r in alpha.jobs.running()]
    listed(beta, 1)
    ready_to_rerun(beta)
    [orphan] = alpha.worker_pids()
    return alpha, beta, seq, orphan


def ran_once_each(server, gate, alpha, beta, runs: list[tuple[int, int]]) -> None:
    """Let the jobs end: each (seq, delivery) of `runs` started once, no other."""
    gate.touch()
    wait_until(lambda: server.stream_msgs() == 0, what="every job acked")
    started = sorted((r.seq, r.delivery) for s in (alpha, beta) for r in s.jobs.started())
    assert started == runs, f"the job's runs: {started}"
    assert beta.stop() == 0


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
