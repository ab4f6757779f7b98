"""Issue 18's soak: routine faults together (recycling every 20 jobs, a random worker SIGKILLed
every 2-4 s, 150 jobs/s of 20 ms). The old restart policy let every slot's backoff climb to 30 s
and the pool turned itself off. Now: the pool stays at its target, every job runs, nothing
waits for AckWait. SOAK_SECONDS sets the length (the issue's run: 240; the suite: 30)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time

import psutil
import pytest
from harness import SupervisorProc, child_env, wait_until

from supervisor.core.policy import STORM_MIN_DEATHS

SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "30"))
ACK_WAIT = 60.0
RATE = 150


def test_recycling_and_random_kills_keep_the_pool_up_and_lose_nothing(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 4, "max_jobs": 20},
                             consumer={"ack_wait": ACK_WAIT},
                             restart={"backoff_initial": 0.1, "backoff_max": 30.0, "poison_after_crashes": 1000},
                             args=("--log-format", "json"))
    sup.wait_ready(4)
    began = time.time()
    count = int(RATE * SOAK_SECONDS)
    publisher = subprocess.Popen([sys.executable, "-m", "supervisor", "publish", "--server", nats_server.url,
                                  "--count", str(count), "--rate", str(RATE), "--data", "0.02"],
                                 env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rng = random.Random(18)
    missing_since: dict[int, float] = {}
    longest_gap, killed = 0.0, list[int]()
    next_kill = time.monotonic() + rng.uniform(2, 4)
    try:
        while publisher.poll() is None:
            now = time.monotonic()
            status = sup.try_status()
            if status:
                present = {w["slot"] for w in status["workers"]["list"] if not w.get("retiring")}
                for slot in range(4):
                    if slot in present:
                        missing_since.pop(slot, None)
                    else:
                        longest_gap = max(longest_gap, now - missing_since.setdefault(slot, now))
            if now >= next_kill and status:
                victim = kill_a_serving_worker(sup, status, rng)
                if victim:
                    killed.append(victim)
                    next_kill = now + rng.uniform(2, 4)
            time.sleep(0.05)                      # the sampling period, not a synchronisation
        assert publisher.returncode == 0, publisher.stderr.read()
    finally:
        publisher.kill()
    wait_until(lambda: sup.jobs.done_seqs() >= set(range(1, count + 1)), timeout=ACK_WAIT / 2,
               what=f"all {count} jobs done well before AckWait")
    # A SIGKILL can land on a worker that has just exited by recycling (a zombie, or in its exit):
    # it then dies of nothing. The supervisor's own log says which kills hit a live worker.
    wait_until(lambda: sigkilled(sup) | drained(sup) >= set(killed), timeout=ACK_WAIT / 2,
               what=f"each of {killed} logged dead of our SIGKILL, or drained")
    kills = len(set(killed) & sigkilled(sup))
    status = sup.status()
    cc = status["crosscheck"]
    assert kills >= SOAK_SECONDS / 4 - 1, f"only {kills} of {len(killed)} kills hit a live worker"
    assert cc["crashes"] >= kills
    # Refilled at backoff_initial every time (0.1 s; grown, it would pass 2 s within five kills),
    # with room for a NAK fence and a fork on a loaded parent.
    assert longest_gap < 2.0, f"a slot stayed empty for {longest_gap:.2f}s (restart delays grew)"
    # A kill every 2-4 s is a storm by the policy's measure (STORM_MIN_DEATHS within STORM_WINDOW,
    # or one per worker): /status must say so, unless the run was too short to kill that often.
    assert kills < max(STORM_MIN_DEATHS, 4) or any(a["kind"] == "worker_deaths" for a in status["alerts"]), \
        (kills, status["alerts"])
    assert sup.stop() == 0
    # Every job ran: nothing lost, and every other check held (above). A redelivery the ledger cannot explain is F17
    # (docs/RELIABILITY.md, open): a job's first delivery that never started came back as
    # delivery 2 at once, with no death, no NAK event and no in-transit NAK naming it. Seen in 2
    # of the last 3 full-suite runs, never in 188 runs of this test alone: reported, with its story,
    # as the known open finding, not as a pass.
    if cc["unexplained_redeliveries"]:
        pytest.xfail("F17 (open): " + story(sup, cc["recent_unexplained"], began) + strangers(nats_server))


def kill_a_serving_worker(sup: SupervisorProc, status: dict, rng: random.Random) -> int | None:
    """SIGKILL a random worker that /status lists as not retiring and that still runs; its pid,
    or None when none could be killed this time (reaped meanwhile)."""
    listed = {w["pid"] for w in status["workers"]["list"] if not w.get("retiring")}
    serving = []
    for p in sup.workers():
        try:
            if p.pid in listed and p.status() != psutil.STATUS_ZOMBIE:
                serving.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    if not serving:
        return None
    victim = rng.choice(sorted(serving))
    try:
        psutil.Process(victim).kill()
    except psutil.NoSuchProcess:
        return None
    return victim


def story(sup: SupervisorProc, unexplained: list[dict], began: float) -> str:
    """Each unexplained redelivery as the job log and the supervisor's log tell it: every run of
    the job (delivery, worker, seconds since the publisher started) and every line naming its
    seq (the deaths that held it, the NAKs, its redeliveries and why), so that a failure on a
    loaded machine says which interleaving it was (seen once in CI, not reproduced since)."""
    out = [f"run so far: {time.time() - began:.1f}s (AckWait {ACK_WAIT:g}s)"]
    for r in unexplained:
        seq = r["stream_seq"]
        runs = [f"{x.event} d{x.delivery} pid {x.pid} +{x.t - began:.2f}s" for x in sup.jobs.records() if x.seq == seq]
        said = [said_when(line, began) for line in sup.log().splitlines()
                if "seq" in line and re.search(rf"\b{seq}\b", line)]
        out += [f"seq {seq} delivery {r['delivery']}: {runs}", *said[-30:]]
    return "\n".join(out)


def strangers(server) -> str:
    """The server's connections once our supervisor has stopped: none but the test's own should
    be left. A process of another test bound to this consumer (a stray reconnecting to a port
    this server took over) would take jobs outside our ledger: F17's first suspect."""
    try:
        conns = server.monitor("connz?subs=1")["connections"]
    except (OSError, ValueError, KeyError) as exc:
        return f"\nconnections after the stop: unknown ({exc})"
    rows = [f"{c.get('name')!r} from {c.get('ip')}:{c.get('port')} since {c.get('start')}, "
            f"subs {c.get('subscriptions_list', [])[:4]}" for c in conns]
    return "\nconnections after the stop: " + ("; ".join(rows) or "none")


def said_when(line: str, began: float) -> str:
    """A JSON log line as `+seconds message`; any other line as it is."""
    try:
        record = json.loads(line)
        return f"+{record['ts'] - began:.2f}s {record['message']}"
    except (ValueError, KeyError, TypeError):
        return line[:300]


def sigkilled(sup: SupervisorProc) -> set[int]:
    """Workers the supervisor saw die of a SIGKILL it did not send itself (its own kills name their cause)."""
    return {e["worker_pid"] for e in sup.events("worker_died") if e["cause"].startswith("signal SIGKILL")}


def drained(sup: SupervisorProc) -> set[int]:
    """Workers that exited cleanly: a SIGKILL sent to one as it ended by recycling killed nothing."""
    return {e["worker_pid"] for e in sup.events("worker_exited")}
