"""Crash safety (issue 3): held jobs come back in milliseconds, the ledger proves nothing was lost,
poison and hung workers are handled, long jobs are kept alive, nothing outlives the parent."""

import asyncio
import collections
import json
import os
import random
import signal
import time

import nats
import psutil
from harness import alive, publish, wait_until

from supervisor.parent.safety.peers import SUSPECT_GRACE

ACK_WAIT = 60.0      # far longer than any wait below: a job back within seconds was NAKed, not expired
NAKED_WITHIN = 10.0  # a job NAKed at a death is back within this (AckWait 30 s in the tests that use it)
JSON_LOGS = ("--log-format", "json")    # structured events (SupervisorProc.events) instead of wording


def test_random_sigkills_lose_nothing_and_ledger_matches(nats_server, supervisor_factory):
    """AckWait 30 s, 4 workers, 400 jobs of 50 ms, 10 workers SIGKILLed at random moments."""
    sup = supervisor_factory(nats_server, workers={"count": 4}, consumer={"ack_wait": 30.0},
                             restart={"poison_after_crashes": 100})
    sup.wait_ready(4)
    publish(nats_server.url, count=400, data="0.05")
    rng = random.Random(7)
    kills = []                                     # (time, pid, seqs running at the kill)
    while len(kills) < 10:
        alive = sup.worker_pids()
        running = wait_until(lambda: [r for r in sup.jobs.running() if r.pid in alive], what="a job in flight")
        victim = rng.choice(running).pid
        time.sleep(rng.uniform(0, 0.05))          # a random moment of the job, not a synchronisation
        psutil.Process(victim).send_signal(signal.SIGKILL)
        t_kill = time.time()
        wait_until(lambda: victim not in sup.worker_pids(), what="the victim reaped")
        # The victim's log is final now: what it started and never finished was running at the kill.
        running_at_kill = {r.seq for r in sup.jobs.running() if r.pid == victim}
        kills.append((t_kill, victim, running_at_kill))
        sup.wait_ready(4)

    wait_until(lambda: sup.jobs.done_seqs() >= set(range(1, 401)), timeout=120, what="every job done")
    wait_until(lambda: nats_server.stream_msgs() == 0, what="every job acked")
    status = wait_until(lambda: (s := sup.status())["crosscheck"]["outstanding"] == [] and s, what="ledger settled")
    cc = status["crosscheck"]
    deaths = {d["pid"]: d for d in cc["recent_deaths"]}       # the last 10 deaths: all of them here

    # Ground truth from the job log and the kills the test made.
    assert cc["crashes"] == 10 and set(deaths) == {pid for _, pid, _ in kills}
    starts = sup.jobs.started()
    redelivered = {r.seq for r in starts if r.delivery > 1}
    for t_kill, pid, seen_running in kills:
        held = set(deaths[pid]["held"])
        started_by_victim = {r.seq for r in starts if r.pid == pid}
        assert seen_running <= held, (pid, seen_running, held)
        # Pulled but not started yet: the victim never ran it, so it must have come back.
        assert held - started_by_victim <= redelivered, (pid, held, started_by_victim)
        for seq in seen_running:   # back in well under AckWait (30 s): the supervisor NAKed it
            again = min(r.t for r in starts if r.seq == seq and r.delivery > 1)
            # Milliseconds when idle; the bound leaves a loaded box seconds and still cannot be
            # met by an AckWait expiry.
            assert again - t_kill < NAKED_WITHIN, f"seq {seq} came back {again - t_kill:.2f}s after the kill"
    held_anywhere = set().union(*(set(d["held"]) for d in deaths.values()))
    runs = collections.Counter(r.seq for r in sup.jobs.done())
    duplicates = {seq for seq, n in runs.items() if n > 1}
    assert duplicates <= held_anywhere, "every duplicate must be a job held at a death"
    # A redelivered job no death held was on the wire to a victim: its previous delivery never
    # started anywhere, and the ledger explained it as in transit (found and NAKed, or after AckWait).
    started = {(r.seq, r.delivery) for r in starts}
    not_held = {(r.seq, r.delivery) for r in starts if r.delivery > 1 and r.seq not in held_anywhere}
    assert not [(seq, d) for seq, d in not_held if (seq, d - 1) in started], not_held
    # Found and NAKed, or back after AckWait: each counts in in_transit_redeliveries (issue 22 item 7).
    assert len(not_held) <= cc["in_transit_redeliveries"], (not_held, cc)
    assert cc["unexplained_redeliveries"] == 0
    held_jobs = [h for d in deaths.values() for h in d["held_jobs"]]
    # A job held at two deaths (redelivered to the next victim) counts once per death.
    came_back = [h for h in held_jobs if any(r.seq == h["stream_seq"] and r.delivery > h["delivery"] for r in starts)]
    assert cc["held_jobs_redelivered"] == len(came_back) == sum(h["came_back_after_s"] is not None for h in held_jobs)
    assert cc["jobs_held_at_crash"] == len(held_jobs) == sum(len(d["held"]) for d in deaths.values())
    # Every unsettled job and every ack in doubt was NAKed (AckWait 30 s: none was near its end).
    assert cc["held_jobs_naked"] == sum(h["naked"] for h in held_jobs)
    assert all(h["naked"] for h in held_jobs if h["state_at_death"] in ("held", "running", "acked")), held_jobs
    assert cc["held_jobs_naked"] >= sum(len(s) for _, _, s in kills)
    # Each job acked at least once; an ack counted twice needs a second run of the job.
    assert 400 <= status["jobs"]["ack"] <= len(sup.jobs.done())
    assert sup.stop() == 0


def test_long_job_outlives_ack_wait_without_redelivery(nats_server, supervisor_factory):
    """AckWait 5 s and one 11 s job (past two AckWaits): in-progress pings keep it; delivered once,
    never redelivered. (A ping is due every third of AckWait: 5 s leaves a loaded box seconds of
    slack, 2 s did not.)"""
    sup = supervisor_factory(nats_server, workers={"count": 2}, consumer={"ack_wait": 5.0}, args=JSON_LOGS)
    sup.wait_ready(2)
    publish(nats_server.url, count=1, data="11")
    seen_redelivered = 0
    deadline = time.monotonic() + 60
    while not sup.jobs.done() and time.monotonic() < deadline:
        seen_redelivered = max(seen_redelivered, nats_server.consumer()["num_redelivered"])
        time.sleep(0.1)
    wait_until(lambda: nats_server.stream_msgs() == 0, what="the job acked")
    # Should it ever come back, say what the supervisor saw: a death, a stale link, pings held back.
    said = "\n".join(f"{e['event']}: {e['message']}" for e in sup.events()
                     if e["event"] not in ("worker_ready", "fleet_poller", "http_listening", "stream_created",
                                           "consumer_created"))
    assert [(r.seq, r.delivery) for r in sup.jobs.started()] == [(1, 1)], said
    assert seen_redelivered == 0, said
    c = nats_server.consumer()
    assert c["delivered"]["consumer_seq"] == 1 and c["num_redelivered"] == 0
    assert sup.status()["crosscheck"]["unexplained_redeliveries"] == 0
    assert sup.stop() == 0


async def dead_letters(url: str, stream: str = "JOBS_DLQ") -> list:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        return [await js.get_msg(stream, seq) for seq in range(info.state.first_seq, info.state.last_seq + 1)
                if info.state.messages]
    finally:
        await nc.close()


def test_poison_job_is_quarantined_with_evidence(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 2}, restart={"poison_after_crashes": 3},
                             consumer={"ack_wait": ACK_WAIT})
    sup.wait_ready(2)
    # A death in the supervisor's first moments leaves what was on the dead worker's wire to
    # AckWait by design (it cannot tell yet that it is alone, nor read the consumer from before
    # the death: README). Seen at -n 6: the first crash 30 ms after ready. The case here starts once
    # it can.
    wait_until(lambda: (s := sup.try_status()) and s["peers"]["alone"] and s["consumer"]["num_pending"] is not None,
               30, "the supervisor sure it is alone, with a ConsumerInfo reading")
    publish(nats_server.url, count=1, data="crash")
    publish(nats_server.url, count=20, data="0.01")
    wait_until(lambda: nats_server.stream_msgs() == 0, timeout=ACK_WAIT / 3,
               what="poison terminated and the rest acked (each crash NAKed, not left to AckWait)")
    assert sup.jobs.done_seqs() == set(range(2, 22)), "the other jobs keep flowing"
    letters = asyncio.run(dead_letters(nats_server.url))
    assert len(letters) == 1
    h = letters[0].headers
    assert letters[0].data == b"crash"
    assert h["Supervisor-Dead-Letter-Stream"] == "JOBS" and h["Supervisor-Dead-Letter-Sequence"] == "1"
    assert h["Supervisor-Dead-Letter-Deliveries"] == "3"
    assert h["Supervisor-Dead-Letter-Deaths"].count("exit code 13") == 3
    assert "poison" in h["Supervisor-Dead-Letter-Reason"]
    status = sup.status()
    assert status["crosscheck"]["quarantined"] == 1 and status["crosscheck"]["crashes"] == 3
    assert any(a["kind"] == "poison" for a in status["alerts"])
    assert sup.stop() == 0


def test_sigstopped_worker_is_killed_and_its_job_runs_elsewhere(nats_server, supervisor_factory):
    heartbeat_timeout = 3.0
    sup = supervisor_factory(nats_server, workers={"count": 2, "heartbeat_timeout": heartbeat_timeout},
                             consumer={"ack_wait": ACK_WAIT}, args=JSON_LOGS)
    sup.wait_ready(2)
    publish(nats_server.url, count=1, data="long-once:30")
    victim = wait_until(lambda: sup.jobs.running(), what="the job to start")[0]
    psutil.Process(victim.pid).send_signal(signal.SIGSTOP)
    stopped = time.time()
    redone = wait_until(lambda: [r for r in sup.jobs.started() if r.seq == victim.seq and r.delivery == 2],
                        timeout=ACK_WAIT / 2, what="the job redelivered long before AckWait")[0]
    assert redone.pid != victim.pid
    assert redone.t - stopped < heartbeat_timeout + 10, "killed and NAKed, not left to AckWait"
    wait_until(lambda: [r for r in sup.jobs.done() if r.seq == victim.seq], what="the job redone elsewhere")
    assert not psutil.pid_exists(victim.pid) or psutil.Process(victim.pid).status() == psutil.STATUS_ZOMBIE
    killed = sup.wait_event("worker_killed", worker_pid=victim.pid)
    assert "workers.heartbeat_timeout" in killed["reason"]
    assert sup.wait_event("worker_died", worker_pid=victim.pid)["naked"] == [victim.seq]
    sup.wait_ready(2)
    wait_until(lambda: nats_server.stream_msgs() == 0, what="the job acked")
    assert sup.stop() == 0


def test_job_timeout_kills_the_worker_and_counts_toward_poison(nats_server, supervisor_factory):
    """Each timeout kills the worker and NAKs the job at once: with AckWait 60 s the second
    delivery starts about job_timeout after the first, never an AckWait later."""
    job_timeout = 1.0
    sup = supervisor_factory(nats_server, workers={"count": 1, "job_timeout": job_timeout},
                             restart={"poison_after_crashes": 2}, consumer={"ack_wait": ACK_WAIT}, args=JSON_LOGS)
    sup.wait_ready(1)
    publish(nats_server.url, count=1, data="30")
    wait_until(lambda: nats_server.stream_msgs() == 0, timeout=ACK_WAIT / 2,
               what="the job quarantined after 2 timeouts, long before AckWait")
    first, second = sup.jobs.started()
    assert (first.delivery, second.delivery) == (1, 2)
    assert second.t - first.t < job_timeout + 10, "killed at job_timeout and NAKed, not left to AckWait"
    kills = sup.events("worker_killed")
    assert [k["worker_pid"] for k in kills] == [first.pid, second.pid]
    assert all("workers.job_timeout=1s" in k["reason"] for k in kills), kills
    letters = asyncio.run(dead_letters(nats_server.url))
    assert len(letters) == 1 and "job_timeout" in letters[0].headers["Supervisor-Dead-Letter-Deaths"]
    assert sup.stop() == 0


def test_short_ack_wait_is_flagged(nats_server, supervisor_factory):
    """AckWait 1 s, 3 s jobs, in-progress pings off: redeliveries no crash explains are counted
    and the ack_wait_too_short alert names AckWait and the job durations."""
    sup = supervisor_factory(nats_server, workers={"count": 2, "progress_pings": False},
                             consumer={"ack_wait": 1.0, "max_deliver": 2})
    sup.wait_ready(2)
    publish(nats_server.url, count=1, data="3")

    def flagged():
        s = sup.status()
        alert = [a for a in s["alerts"] if a["kind"] == "ack_wait_too_short"]
        return s["crosscheck"]["unexplained_redeliveries"] >= 1 and alert and s["jobs"]["ack"] >= 1 and alert[0]
    alert = wait_until(flagged, what="the ack_wait_too_short alert")
    assert "ack_wait is 1s" in alert["message"] and "slowest job seen ran 3." in alert["message"]
    assert sup.stop() == 0


def test_parent_sigkill_leaves_no_process(tmp_path, supervisor_factory):
    # A store of the test's own: a SIGKILLed supervisor cannot remove a throw-away one.
    sup = supervisor_factory(None, workers={"count": 3}, embedded={"store_dir": str(tmp_path / "store")})
    sup.wait_ready(3)
    family = psutil.Process(sup.proc.pid).children(recursive=True)
    assert len(family) == 4                        # 3 workers + the embedded nats-server
    sup.signal(signal.SIGKILL)
    sup.wait()
    wait_until(lambda: not [p for p in family if alive(p)],
               timeout=30, what="every worker and the nats-server gone")


def open_objects(pid: int) -> dict[int, tuple[str, tuple[int, int] | None]]:
    """fd -> (what it points at, (device, inode)) for a process; anon inodes share one inode, so
    they get no identity (and are checked by name)."""
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
            st = os.stat(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue                     # closed meanwhile
        out[int(name)] = (target, None if target.startswith("anon_inode:") else (st.st_dev, st.st_ino))
    return out


def test_workers_close_every_inherited_descriptor(nats_server, supervisor_factory, tmp_path):
    """The parent holds a file, a pipe, a listening TCP socket, a UDP socket and a unix socket
    pair (opened by the handler module it imports before forking), its NATS connection, its HTTP
    listener, pidfds and the other workers' event pipes. A worker shares nothing with it but
    stdin/stdout/stderr, /dev/null and its own event pipe."""
    report = tmp_path / "inherit.json"
    sup = supervisor_factory(nats_server, workers={"count": 2, "handler": "inherithandlers:record"},
                             env={"INHERIT_FILE": str(tmp_path / "inherited.txt"), "INHERIT_REPORT": str(report)})
    sup.wait_ready(2)
    planted = json.loads(report.read_text())
    assert planted["parent"] == sup.proc.pid
    parent = open_objects(sup.proc.pid)
    parent_ids = {ident: target for target, ident in parent.values() if ident}
    planted_inodes = set(planted["inodes"].values())
    assert planted_inodes <= {ino for _, ino in parent_ids}, "the parent holds what the test planted"
    devnull = os.stat(os.devnull)
    for worker in sup.workers():
        mine = open_objects(worker.pid)
        std = {mine[fd][1] for fd in (0, 1, 2) if fd in mine}
        shared = {ident: target for target, ident in mine.values()
                  if ident in parent_ids and ident not in std and ident != (devnull.st_dev, devnull.st_ino)}
        assert [t for t in shared.values() if not t.startswith("pipe:")] == [], (worker.pid, shared)
        assert len(shared) == 1, f"worker {worker.pid} shares more than its event pipe: {shared}"
        assert not planted_inodes & {ino for _, ino in shared}, (worker.pid, shared, planted)
        assert planted["file"] not in {t for t, _ in mine.values()}
        assert not [t for t, _ in mine.values() if t == "anon_inode:[pidfd]"], "no pidfd of the parent's"
        conns = [c for c in worker.net_connections("inet") if c.raddr and c.raddr.port == nats_server.port]
        assert len(conns) == 1, conns                # its own NATS connection, nothing inherited
        assert not [c for c in worker.net_connections("inet") if c.status == psutil.CONN_LISTEN or not c.raddr]
    names = {c["name"] for c in json.loads(nats_server_connz(nats_server))["connections"]}
    assert sum("worker" in (n or "") for n in names) == 2
    assert sup.stop() == 0


def nats_server_connz(server) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/connz", timeout=5) as r:
        return r.read().decode()


def recycle_order_ok(sup) -> int:
    """Capacity never drops on a recycle (max_jobs, RSS, a config roll): the replacement is ready
    before the old worker exits. Read from the structured events of a supervisor run with JSON
    logs. Returns how many recycles have completed."""
    events = sup.events()
    complete = 0
    for k, ev in enumerate(events):
        if ev["event"] != "worker_recycling":      # logged as the replacement is forked
            continue
        slot, old = ev["slot"], ev["worker_pid"]
        later = events[k + 1:]
        exited = next((j for j, e in enumerate(later) if e["event"] in ("worker_exited", "worker_died")
                       and e["worker_pid"] == old), None)
        if exited is None:
            continue                     # still under way
        assert later[exited]["event"] == "worker_exited", f"recycled worker {old} died: {later[exited]}"
        ready = next((j for j, e in enumerate(later) if e["event"] == "worker_ready" and e["slot"] == slot), None)
        assert ready is not None and ready < exited, f"worker {slot} pid {old} exited before its replacement was ready"
        complete += 1
    return complete


def test_max_jobs_recycles_one_at_a_time_without_losing_jobs(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 2, "max_jobs": 5}, args=JSON_LOGS)
    sup.wait_ready(2)
    publish(nats_server.url, count=40, data="0.02")
    wait_until(lambda: nats_server.stream_msgs() == 0, what="every job acked")
    done = sup.jobs.done()
    assert sorted(r.seq for r in done) == list(range(1, 41)), "each job exactly once"
    runs_per_pid = collections.Counter(r.pid for r in sup.jobs.started())
    # A worker due for recycling takes no job it will not run (none runs more than max_jobs), and
    # recycling alone redelivers nothing (a NAKed prefetch would spend a delivery attempt: issue 9).
    assert max(runs_per_pid.values()) == 5, runs_per_pid
    assert all(r.delivery == 1 for r in sup.jobs.started())
    assert nats_server.consumer()["delivered"]["consumer_seq"] == 40
    # Every worker that reached max_jobs, and only those, was recycled: 40 jobs make at least 6
    # of them (the last two share what is left); each left only once its replacement was ready.
    recycled = wait_until(lambda: {e["worker_pid"] for e in sup.events("worker_recycling")}
                          >= {p for p, n in runs_per_pid.items() if n == 5} and sup.events("worker_recycling"),
                          what="every worker that ran 5 jobs recycled")
    assert {e["worker_pid"] for e in recycled} == {p for p, n in runs_per_pid.items() if n == 5}
    assert len(recycled) >= 6 and set(runs_per_pid) - {e["worker_pid"] for e in recycled} <= sup.worker_pids()
    wait_until(lambda: recycle_order_ok(sup) == len(recycled), what="the recycles done, each replacement ready first")
    assert sup.status()["crosscheck"]["crashes"] == 0
    assert sup.stop() == 0


def test_max_rss_recycles_a_bloated_worker(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 1, "max_rss_mb": 120}, args=JSON_LOGS)
    sup.wait_ready(1)
    first = sup.worker_pids()
    publish(nats_server.url, count=2, data="grow:80")
    recycled = sup.wait_event("worker_recycling")
    assert recycled["worker_pid"] in first and "workers.max_rss_mb=120" in recycled["reason"]
    wait_until(lambda: sup.worker_pids() and sup.worker_pids().isdisjoint(first), what="a fresh worker")
    wait_until(lambda: recycle_order_ok(sup) == 1, what="the old worker gone after its replacement was ready")
    assert nats_server.stream_msgs() == 0
    assert sup.stop() == 0


def test_peer_supervisors_explain_each_others_redeliveries(nats_server, supervisor_factory):
    """A supervisor per host on one consumer: a job host A's dead worker held is redelivered to
    host B's worker, and B's ledger says which crash explains it instead of raising an alarm.
    B starts first (no workers yet), so the job is not one pending at B's start (that would
    explain it too)."""
    b = supervisor_factory(nats_server, workers={"count": 0}, consumer={"ack_wait": 30.0}, args=JSON_LOGS)
    wait_until(lambda: (s := b.try_status()) and s["state"] == "running", what="B up with no workers")
    a = supervisor_factory(nats_server, workers={"count": 1}, restart={"backoff_initial": 5.0, "backoff_max": 5.0},
                           consumer={"ack_wait": 30.0})
    a.wait_ready(1)
    publish(nats_server.url, count=1, data="long-once:30")
    held = wait_until(lambda: a.jobs.running(), what="host A running the job")[0]
    for n in (1, 2):
        b.signal(signal.SIGTTIN)
        b.wait_ready(n)
    psutil.Process(held.pid).send_signal(signal.SIGKILL)
    redone = wait_until(lambda: b.jobs.done(), what="host B redoing the job")[0]
    assert redone.seq == held.seq and redone.delivery == 2
    s = wait_until(lambda: (s := b.status())["crosscheck"]["explained_redeliveries"] == 1 and s,
                   what="B's ledger explaining the redelivery")
    assert s["crosscheck"]["unexplained_redeliveries"] == 0
    seen = b.wait_event("redelivered", seq=held.seq, delivery=2)
    # A's word came before the redelivery (explained at once) or just after it (explained then).
    why = seen["why"] or b.wait_event("redelivery_explained", seq=held.seq)["why"]
    assert f"pid {held.pid}" in why, why                      # which crash: A's worker, by its pid
    # A suspect becomes unexplained SUSPECT_GRACE after it was seen, at B's next audit (a loop
    # tick: at most 0.5 s): wait past that, then nothing may have turned unexplained.
    wait_until(lambda: time.time() > seen["ts"] + SUSPECT_GRACE + 1.0, timeout=SUSPECT_GRACE + 5,
               what="the suspect grace to pass")
    assert b.status()["crosscheck"]["unexplained_redeliveries"] == 0
    assert a.status()["crosscheck"]["crashes"] == 1
    assert a.stop() == 0 and b.stop() == 0


def test_server_restart_loses_nothing(nats_server, supervisor_factory):
    """nats-server stopped and started again (same store) while jobs flow: every job is acked
    in the end; workers and the parent reconnect, pull afresh and re-send acks that may have
    died with the old connection. No job runs twice unless it was redelivered, and the ledger
    explains every redelivery."""
    sup = supervisor_factory(nats_server, workers={"count": 2}, consumer={"ack_wait": 5.0})
    sup.wait_ready(2)
    publish(nats_server.url, count=80, data="0.05")
    wait_until(lambda: len(sup.jobs.done()) >= 20, what="jobs flowing")
    nats_server.stop()
    nats_server.start()
    wait_until(lambda: sup.jobs.done_seqs() >= set(range(1, 81)), timeout=90, what="every job done")
    wait_until(lambda: nats_server.stream_msgs() == 0, timeout=60, what="every job acked")
    s = wait_until(lambda: (s := sup.try_status()) and s["nats"]["connected"] and s, what="the parent reconnected")
    assert s["workers"]["alive"] == 2
    runs = collections.Counter((r.seq, r.delivery) for r in sup.jobs.done())
    assert [k for k, n in runs.items() if n > 1] == [], "a delivery ran twice"
    twice = {seq for seq, n in collections.Counter(r.seq for r in sup.jobs.done()).items() if n > 1}
    redelivered = {r.seq for r in sup.jobs.started() if r.delivery > 1}
    assert twice <= redelivered
    cc = wait_until(lambda: (c := sup.status()["crosscheck"]) and not c["outstanding"] and c, what="ledger settled")
    assert cc["unexplained_redeliveries"] == 0, cc["recent_unexplained"]
    assert sup.stop() == 0


def test_acks_lost_with_a_connection_are_sent_again(nats_server, supervisor_factory):
    """The workers' connections go deaf for a moment: everything they write (acks, PINGs) is
    lost while jobs keep arriving on their pull requests, then the connections drop and they
    reconnect. The acks they sent into the void are sent again on the new connection before
    AckWait, so no job runs twice (without that, each comes back after AckWait and reruns)."""
    from cutproxy import CutProxy

    proxy = CutProxy(nats_server).start()
    try:
        sup = supervisor_factory(nats_server, workers={"count": 2}, consumer={"ack_wait": ACK_WAIT},
                                 nats={"servers": [proxy.url]})
        sup.wait_ready(2)
        publish(nats_server.url, count=300, data="0.02")
        wait_until(lambda: len(sup.jobs.done()) >= 30, what="jobs flowing")
        cut_at = time.time()
        assert len(proxy.cut("worker", 1.0)) == 2
        lost_acks = proxy.dropped.count(b"+ACK")
        acked_in_the_void = len([r for r in sup.jobs.done() if r.t > cut_at])
        assert lost_acks >= 1 and acked_in_the_void >= 1, "the cut must have swallowed acks"
        wait_until(lambda: nats_server.stream_msgs() == 0, timeout=ACK_WAIT * 3 / 4,
                   what="every job acked, the lost acks re-sent before AckWait")
        runs = collections.Counter(r.seq for r in sup.jobs.done())
        assert sorted(runs) == list(range(1, 301)) and set(runs.values()) == {1}, \
            f"ran twice: {sorted(s for s, n in runs.items() if n > 1)}"
        assert all(r.delivery == 1 for r in sup.jobs.started())
        assert nats_server.consumer()["num_redelivered"] == 0
        assert sup.status()["crosscheck"]["unexplained_redeliveries"] == 0
        assert sup.stop() == 0
    finally:
        proxy.stop()


def test_an_ack_not_yet_fenced_is_kept_and_naked_at_death(nats_server, supervisor_factory):
    """A worker SIGKILLs itself right after publishing a job's ack, before the fence confirms it
    (tests/handlers/testhandlers.py die_after_ack_init: the kill point, explicit). Its slot table still
    holds the entry as ACKED; the parent NAKs it at the death, the job comes back within seconds
    (AckWait 60 s) and is acked: nothing lost."""
    sup = supervisor_factory(nats_server, workers={"count": 2, "init": "testhandlers:die_after_ack_init"},
                             consumer={"ack_wait": ACK_WAIT}, args=JSON_LOGS)
    sup.wait_ready(2)
    publish(nats_server.url, count=1, data="die-after-ack")
    first = wait_until(lambda: sup.jobs.done(), what="the job done once")[0]
    death = sup.wait_event("worker_died", worker_pid=first.pid)
    assert "SIGKILL" in death["cause"] and death["held"] == [first.seq] and death["naked"] == [first.seq]
    [record] = [d for d in sup.status()["crosscheck"]["recent_deaths"] if d["pid"] == first.pid]
    assert [(h["stream_seq"], h["state_at_death"], h["naked"]) for h in record["held_jobs"]] == \
        [(first.seq, "acked", True)]
    again = wait_until(lambda: [r for r in sup.jobs.done() if r.delivery == 2], timeout=ACK_WAIT / 3,
                       what="the job back long before AckWait")[0]
    assert again.seq == first.seq and again.t - first.t < ACK_WAIT / 6
    wait_until(lambda: nats_server.stream_msgs() == 0, what="the job acked in the end")
    cc = wait_until(lambda: (c := sup.status()["crosscheck"]) and not c["outstanding"] and c, what="ledger settled")
    assert cc["held_jobs_naked"] == 1 and cc["unexplained_redeliveries"] == 0
    assert sup.stop() == 0


def test_a_batch_of_acks_not_yet_fenced_is_kept_and_naked_at_death(nats_server, supervisor_factory, tmp_path):
    """Issue 25: a sync handler's outcomes are acked a batch at a time, one write for all
    (Settler.ack_all). A worker SIGKILLs itself right after publishing such a batch, before the
    fence (testhandlers.die_after_ack_init, `die-after-acks`): every entry of the batch is still
    ACKED in its table, the parent NAKs each, they come back within seconds (AckWait 60 s) and
    every job is acked once the replacement has run them: nothing lost, every rerun explained."""
    publish(nats_server.url, count=200, data="die-after-acks")        # a backlog: outcomes come back in batches
    sup = supervisor_factory(nats_server, workers={"count": 1, "init": "testhandlers:die_after_ack_init"},
                             consumer={"ack_wait": ACK_WAIT}, args=JSON_LOGS, env={"DIE_ONCE": str(tmp_path / "died")})
    death = sup.wait_event("worker_died")
    assert "SIGKILL" in death["cause"], death
    [record] = [d for d in sup.status()["crosscheck"]["recent_deaths"] if d["pid"] == death["worker_pid"]]
    acked = [h["stream_seq"] for h in record["held_jobs"] if h["state_at_death"] == "acked"]
    assert len(acked) >= 2 and all(h["naked"] for h in record["held_jobs"]), record["held_jobs"]
    wait_until(lambda: nats_server.stream_msgs() == 0, timeout=ACK_WAIT / 3, what="every job acked, long before AckWait")
    assert {r.seq for r in sup.jobs.done()} == set(range(1, 201))
    assert {r.seq for r in sup.jobs.done() if r.delivery == 2} >= set(acked), "the batch's jobs ran again"
    cc = wait_until(lambda: (c := sup.status()["crosscheck"]) and not c["outstanding"] and c, what="ledger settled")
    assert cc["crashes"] == 1 and cc["unexplained_redeliveries"] == 0, cc
    assert sup.stop() == 0


def test_an_ack_nats_py_refuses_while_reconnecting_is_sent_once_it_is_back(nats_server, supervisor_factory, tmp_path):
    """The interleaving: a job ends while the server is down and nats-py refuses its ack
    (reconnect buffer full: OutboundBufferLimitError, testhandlers.full_buffer_when_down_init).
    Its pull requests wait for the reconnect (they are not even tried while it is down: see
    tests/integration/test_worker_edges.py, R8).
    The error used to kill the task that settles jobs: the ack never went, the job ran again
    after AckWait with no crash to explain it, and the worker settled nothing more. Now the entry
    is kept as an ack to send again; once the server is back it is acked within seconds (AckWait
    60 s), ran once, and the worker goes on working."""
    gate = tmp_path / "finish"
    sup = supervisor_factory(nats_server, workers={"count": 1, "init": "testhandlers:full_buffer_when_down_init"},
                             consumer={"ack_wait": ACK_WAIT}, args=JSON_LOGS)
    sup.wait_ready(1)
    publish(nats_server.url, count=1, data=f"until:{gate}")
    [job] = wait_until(lambda: sup.jobs.running(), what="the job running")
    nats_server.stop()
    sup.wait_event("nats_disconnected", pid=job.pid)                # the worker knows it is down
    gate.touch()                                                    # the job ends now, offline
    unsent = sup.wait_event("settle_unsent", seq=job.seq)
    assert (unsent["outcome"], unsent["error"]) == ("ack", "OutboundBufferLimitError"), unsent
    nats_server.start()
    wait_until(lambda: nats_server.stream_msgs() == 0, timeout=ACK_WAIT / 3, what="the refused ack sent after the reconnect")
    publish(nats_server.url, count=1, data="0")                     # the worker still settles jobs
    wait_until(lambda: nats_server.stream_msgs() == 0 and len(sup.jobs.done()) == 2, what="the next job done and acked")
    assert [(r.seq, r.delivery) for r in sup.jobs.started()] == [(job.seq, 1), (job.seq + 1, 1)], "nothing ran twice"
    assert nats_server.consumer()["num_redelivered"] == 0
    assert sup.worker_pids() == {job.pid} and sup.status()["crosscheck"]["crashes"] == 0
    assert sup.stop() == 0


def test_a_batch_of_acks_refused_while_reconnecting_is_sent_once_it_is_back(nats_server, supervisor_factory, tmp_path):
    """Issue 25, the same interleaving on the batched path: 50 quick jobs, one that runs until
    the test says, and 50 quick ones behind it, pulled together (a backlog) by one worker. The
    server stops while the gated job runs; once it ends, its ack and those of the jobs pulled
    behind it (a handler thread's batches: one publish_each each, Settler.ack_all) are refused
    whole by nats-py (testhandlers.full_buffer_when_down_init), each reported unsent and kept.
    Once the server is back every ack is sent again and fenced: all 101 jobs acked, none ran
    twice, no crash. How many the worker holds behind the gated job is its pull sizing's (a
    buffer sized from the measured job time and round trip: all 50, or, on a loaded box, fewer);
    at least one, and the count is taken once the server is down and nothing more can come."""
    gate = tmp_path / "finish"
    publish(nats_server.url, count=50, data="0")
    publish(nats_server.url, count=1, data=f"until:{gate}")
    publish(nats_server.url, count=50, data="0")
    sup = supervisor_factory(nats_server, workers={"count": 1, "init": "testhandlers:full_buffer_when_down_init"},
                             consumer={"ack_wait": ACK_WAIT}, args=JSON_LOGS)
    sup.wait_ready(1)

    def holding() -> list[int]:
        return sorted(j["stream_seq"] for j in sup.status()["workers"]["list"][0]["in_flight"])
    wait_until(lambda: nats_server.stream_msgs() == 51 and (seqs := holding())[:1] == [51] and len(seqs) >= 2,
               what="the first 50 acked, the gated job running and jobs held behind it")
    [gated] = sup.jobs.running()
    nats_server.stop()
    sup.wait_event("nats_disconnected", pid=gated.pid)
    held = holding()                                                # nothing more can come now
    gate.touch()                                                    # they all end now, offline
    wait_until(lambda: len(sup.events("settle_unsent")) == len(held), what="every ack refused and reported")
    assert sorted(e["seq"] for e in sup.events("settle_unsent")) == held
    assert {e["outcome"] for e in sup.events("settle_unsent")} == {"ack"}
    nats_server.start()
    wait_until(lambda: nats_server.stream_msgs() == 0, timeout=ACK_WAIT / 3,
               what="the refused acks sent after the reconnect")
    started = [(r.seq, r.delivery) for r in sup.jobs.started()]
    assert sorted(started) == [(seq, 1) for seq in range(1, 102)], "each job ran once"
    assert nats_server.consumer()["num_redelivered"] == 0
    assert sup.status()["crosscheck"]["crashes"] == 0
    assert sup.stop() == 0


def test_a_stopping_worker_waits_for_nats_to_send_an_ack_it_could_not(nats_server, supervisor_factory, tmp_path):
    """The interleaving: a job ends while the server is down, nats-py refuses its ack (as in the
    test above), and the supervisor is told to stop before the server is back. The worker used to
    try one fence and exit: the parent NAKed the entry, and the job, done and never acked, ran
    again on the next start. Now the stopping worker waits for NATS, within graceful_timeout:
    the server comes back, the ack is sent, and the supervisor stops cleanly with the stream
    empty and the job run once."""
    gate = tmp_path / "finish"
    sup = supervisor_factory(nats_server, workers={"count": 1, "init": "testhandlers:full_buffer_when_down_init",
                                                   "graceful_timeout": 60.0},
                             consumer={"ack_wait": ACK_WAIT}, args=JSON_LOGS)
    sup.wait_ready(1)
    publish(nats_server.url, count=1, data=f"until:{gate}")
    [job] = wait_until(lambda: sup.jobs.running(), what="the job running")
    nats_server.stop()
    sup.wait_event("nats_disconnected", pid=job.pid)
    gate.touch()
    unsent = sup.wait_event("settle_unsent", seq=job.seq)
    assert unsent["outcome"] == "ack", unsent
    sup.signal(signal.SIGTERM)
    waiting = sup.wait_event("settle_waiting", pid=job.pid)      # stopping, and holding on for NATS
    assert waiting["unconfirmed"] == 1, waiting
    nats_server.start()
    assert sup.wait() == 0
    assert nats_server.stream_msgs() == 0, "the ack reached the server before the worker left"
    assert [(r.seq, r.delivery) for r in sup.jobs.started()] == [(job.seq, 1)]
    assert not sup.events("worker_died")


def test_a_failing_settle_path_crashes_the_worker_so_its_job_comes_back(nats_server, supervisor_factory):
    """A bug in the settle path (testhandlers.finish_fails_init raises in Worker.finished) used to
    kill that task quietly: the job stayed held by a live worker that would never settle it, until
    AckWait. Now the worker exits as crashed: the parent NAKs the job, it comes back within
    seconds (AckWait 60 s) and the death explains the rerun."""
    sup = supervisor_factory(nats_server, workers={"count": 1, "init": "testhandlers:finish_fails_init"},
                             consumer={"ack_wait": ACK_WAIT}, args=JSON_LOGS)
    sup.wait_ready(1)
    publish(nats_server.url, count=1, data="finish-fails:0")
    first = wait_until(lambda: sup.jobs.done(), what="the handler done")[0]
    failed = sup.wait_event("worker_task_failed", pid=first.pid)
    assert failed["task"] == "HandlerThreads.finisher" and "the settle path failing on purpose" in failed["exception"]
    death = sup.wait_event("worker_died", worker_pid=first.pid)
    assert death["held"] == [first.seq] and death["naked"] == [first.seq], death
    again = wait_until(lambda: [r for r in sup.jobs.done() if r.delivery == 2], timeout=ACK_WAIT / 3,
                       what="the job back long before AckWait")[0]
    assert again.seq == first.seq and again.pid != first.pid
    wait_until(lambda: nats_server.stream_msgs() == 0, what="the job acked in the end")
    cc = wait_until(lambda: (c := sup.status()["crosscheck"]) and not c["outstanding"] and c, what="ledger settled")
    assert cc["crashes"] == 1 and cc["unexplained_redeliveries"] == 0, cc
    assert sup.stop() == 0


def test_inbox_tap_does_not_leave_a_dead_workers_job_to_ack_wait(nats_server, supervisor_factory):
    """Something subscribed to '_INBOX.>' keeps a dead worker's pull request alive, so the server
    hands the job the parent NAKed straight back to it. The parent NAKs once more when nobody
    has seen the job again, instead of leaving it to the 60 s AckWait."""
    async def tap_and_kill():
        nc = await nats.connect(nats_server.url)
        tapped = []

        async def on_msg(msg):
            if msg.reply and msg.reply.startswith("$JS.ACK."):
                tapped.append(msg.reply)
        await nc.subscribe("_INBOX.>", cb=on_msg)
        await nc.flush()
        sup = supervisor_factory(nats_server, workers={"count": 1, "concurrency": 2},
                                 restart={"backoff_initial": 6.0, "backoff_max": 6.0}, consumer={"ack_wait": ACK_WAIT},
                                 args=JSON_LOGS)
        await asyncio.to_thread(sup.wait_ready, 1)
        await asyncio.to_thread(publish, nats_server.url, count=1, data="long-once:30")
        victim = (await asyncio.to_thread(wait_until, lambda: sup.jobs.running(), 60, "the job running"))[0]
        killed = time.monotonic()
        psutil.Process(victim.pid).send_signal(signal.SIGKILL)
        await asyncio.to_thread(wait_until, lambda: [r for r in sup.jobs.done() if r.seq == victim.seq], 45,
                                "the job redone long before AckWait")
        await nc.close()
        return sup, tapped, time.monotonic() - killed
    sup, tapped, took = asyncio.run(tap_and_kill())
    assert tapped, "the tap must have received the job the NAK freed (the hazard this test is about)"
    victim_seq = sup.jobs.started()[0].seq
    assert sup.events("renak", seq=victim_seq), "NAKed once more"
    assert took < ACK_WAIT / 2, took
    assert sup.stop() == 0
