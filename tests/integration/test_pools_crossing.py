"""Pools meeting each other (issue 28, a cold review): what one pool's state must never do to
another's, forced against a real nats-server with real `supervisor start`s and workers."""

from __future__ import annotations

import json
import os
import signal

import psutil
import tomli_w
from harness import dead_letter_headers, publish_now, run_cli, wait_until
from test_fleet_cluster import fleet_view

from supervisor.parent.safety.peers import PEER_QUIET


def test_the_idempotency_guard_keeps_each_pools_done_markers_apart_on_a_fan_out_stream(nats_server,
                                                                                          supervisor_factory):
    """A limits stream, two pools whose filters overlap (allowed off a work queue: each consumer
    gets every message, a fan-out), [idempotency] on. Every job must run in both pools: a done
    marker of pool a's run must not make pool b ack its own delivery unrun."""
    pools = {"a": {"count": 1, "filter_subject": "jobs.>"},
             "b": {"count": 1, "filter_subject": "jobs.>", "handler": "testhandlers:record_v2"}}
    sup = supervisor_factory(nats_server, pools=pools, stream={"retention": "limits"},
                             idempotency={"enabled": True})
    sup.wait_ready(2)
    seqs = publish_now(nats_server.url, count=10, data="0.01")

    def both_settled():
        s = sup.try_status()
        return s and all(p["jobs"]["ack"] + p["jobs"]["duplicate"] >= 10 for p in s["pools"].values()) and s
    status = wait_until(both_settled, what="10 jobs settled in each pool")
    ran = sorted((r.seq, r.data.startswith("v2:")) for r in sup.jobs.done())
    dup = {name: p["jobs"]["duplicate"] for name, p in status["pools"].items()}
    assert ran == sorted([(s, False) for s in seqs] + [(s, True) for s in seqs]), \
        f"each pool must run every job once; ran {ran}, skipped as duplicates by pool: {dup}"
    assert sup.stop() == 0


def test_a_retry_copy_runs_only_in_the_pool_that_re_published_it_on_a_fan_out_stream(nats_server,
                                                                                      supervisor_factory):
    """A limits stream, pools a and b on one filter; a's handler fails the job's first attempt
    with a delay past retry.republish_after, so a re-publishes it as a copy (to the job's own
    subject) and acks its delivery; b's handler ran the job at once. The copy reaches every
    consumer on that subject: b must not run the job a second time for a's retry."""
    pools = {"a": {"count": 1, "filter_subject": "jobs.>"},
             "b": {"count": 1, "filter_subject": "jobs.>", "handler": "testhandlers:record_any"}}
    retry = {"republish_after": 0.5, "rules": [{"on": ["RuntimeError"], "base": 1.0, "jitter": 0.0}]}
    sup = supervisor_factory(nats_server, pools=pools, stream={"retention": "limits"}, retry=retry)
    sup.wait_ready(2)
    [seq] = publish_now(nats_server.url, count=1, data="fail-first-attempt")

    def copy_settled():
        copies = [r for r in sup.jobs.done() if not r.data.startswith("any:") and r.seq != seq]
        if not copies:
            return None
        b = nats_server.consumer(name="workers-b")
        return b["delivered"]["stream_seq"] >= copies[0].seq and b["num_pending"] == b["num_ack_pending"] == 0
    wait_until(copy_settled, what="pool a's copy run, and pool b past it")
    in_b = [r.seq for r in sup.jobs.done() if r.data.startswith("any:")]
    assert in_b == [seq], f"pool b ran seq {in_b}: a's retry copy ran in b too"
    assert sup.stop() == 0


def test_each_pools_dead_letter_of_a_fan_out_message_is_kept_and_replayed_to_that_pool_alone(nats_server,
                                                                                              supervisor_factory):
    """A limits stream, pools a and b on one filter, both handlers reject the job until it comes
    back from `dlq replay`. Each pool gives up on its own delivery: two dead letters (one Msg-Id
    per stream and seq kept the first and folded the second away). `dlq replay --all` sends each
    back to its pool alone: the job runs once in a and once in b, not twice in each."""
    pools = {"a": {"count": 1, "filter_subject": "jobs.>"},
             "b": {"count": 1, "filter_subject": "jobs.>", "handler": "uxhandlers:reject_unless_replayed_v2"}}
    sup = supervisor_factory(nats_server, pools=pools, stream={"retention": "limits"},
                             workers={"handler": "uxhandlers:reject_unless_replayed"})
    sup.wait_ready(2)
    [seq] = publish_now(nats_server.url, count=1, data="x")
    wait_until(lambda: len(dead_letter_headers(nats_server.url)) == 2, what="a dead letter per pool")
    letters = dlq_list(nats_server.url)
    assert sorted((x["stream_seq"], x["consumer"]) for x in letters) == [(seq, "workers-a"), (seq, "workers-b")]
    r = run_cli("dlq", "replay", "--all", "--server", nats_server.url)
    assert r.returncode == 0 and "replayed 2 dead letters" in r.stdout, r.stdout + r.stderr

    def settled():
        s = sup.try_status()
        return s and all(p["jobs"]["ack"] >= 1 and p["jobs"]["duplicate"] >= 1 for p in s["pools"].values())
    wait_until(settled, what="each pool ran its replay and acked the other's unrun")
    assert sorted(r.data.split(" ")[0] for r in sup.jobs.done()) == ["v2:x", "x"]
    assert sup.stop() == 0


def dlq_list(url: str) -> list[dict]:
    r = run_cli("dlq", "list", "--json", "--server", url)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_reload_that_fails_after_making_a_pool_leaves_no_peer_behind(nats_server, supervisor_factory):
    """Supervisor W runs pool b alone. X runs pool a, then a SIGHUP adds b and c, and c's handler
    cannot be imported: the reload fails and X runs on as it was. But b's crew had been made
    first, and its hello reached W: unless it says goodbye, W counts a peer on b's consumer for
    good, and its in-transit check and re-NAK (which need it alone) stay off until W restarts."""
    b = {"count": 1, "filter_subject": "jobs.b.>"}
    w = supervisor_factory(nats_server, pools={"b": b})
    x = supervisor_factory(nats_server, pools={"a": {"count": 1, "filter_subject": "jobs.a.>"}})
    w.wait_ready(1)
    x.wait_ready(1)
    wait_until(lambda: w.status()["peers"]["alone"], what="W alone on b's consumer")
    x.config_path.write_text(tomli_w.dumps({**x.config, "pools": {
        **x.config["pools"], "b": b, "c": {"filter_subject": "jobs.c.>", "handler": "nosuchmodule:handle"}}}))
    x.signal(signal.SIGHUP)
    x.wait_log("reload failed; still running on the previous config")
    assert set(x.status()["pools"]) == {"a"}
    wait_until(lambda: w.status()["peers"]["alone"], timeout=3 * PEER_QUIET,
               what="W alone again on b's consumer after X's failed reload")
    assert x.stop() == 0 and w.stop() == 0


def test_pools_a_reload_adds_to_a_config_that_had_none_name_themselves(nats_server, supervisor_factory):
    """No [pools.*], then a SIGHUP brings pools a and b: the default pool leaves, a and b start,
    and theirs are pools' ways (each worker, log line and alert names its pool), not the
    unnamed default's (the crews were made while the running config still had no pools). The
    fleet takes the new consumers' leases and lets the old one's go (it stayed on the first
    pool's consumer once: the sample subscription was made once, at start)."""
    sup = supervisor_factory(nats_server, args=("--log-format", "json"), consumer={"filter_subject": "jobs.d.>"})
    sup.wait_ready(2)
    sup.config_path.write_text(tomli_w.dumps({**sup.config, "pools": {
        "a": {"count": 1, "filter_subject": "jobs.a.>"}, "b": {"count": 1, "filter_subject": "jobs.b.>"}}}))
    sup.signal(signal.SIGHUP)
    status = wait_until(lambda: (s := sup.try_status()) and set(s.get("pools", ())) == {"a", "b"}
                        and s["workers"]["ready"] == 2 and len(s["workers"]["list"]) == 2 and s, what="a and b ready")
    assert sorted(w.get("pool", "") for w in status["workers"]["list"]) == ["a", "b"]
    started = sup.wait_event("pool_added", pool="b")
    assert sup.events("worker_ready", pool="a") and started
    # The fleet follows: the consumer that left is no longer polled here (its lease let go), a's and b's are.
    wait_until(lambda: sup.status()["fleet"]["polls"] == ["workers-a", "workers-b"], what="the fleet polling a and b")
    assert sup.events("fleet_poller_lost", consumer="workers")
    assert sup.stop() == 0


def test_a_pool_a_reload_took_out_sends_the_nak_it_held_back_for_its_last_worker(nats_server, supervisor_factory,
                                                                                tmp_path):
    """Pool b leaves the config (SIGHUP) while its worker runs a long job; the parent's link is
    refused and the retiring worker is SIGKILLed: its NAK is held back until NATS is back. Pool b
    has no worker left then, but it must not be dropped with that NAK: once the parent is back
    the NAK goes out and the job runs again at once (here, in a supervisor that runs pool b),
    not after AckWait."""
    from linkfaults import Refuse

    ack_wait = 60.0
    pools = {"a": {"count": 1, "filter_subject": "jobs.a.>"},
             "b": {"count": 1, "filter_subject": "jobs.b.>", "ack_wait": ack_wait}}
    proxy = Refuse(nats_server).start()
    try:
        x = supervisor_factory(nats_server, pools=pools, nats={"servers": [proxy.url]}, args=("--log-format", "json"))
        x.wait_ready(2)
        [seq] = publish_now(nats_server.url, count=1, data=f"until:{tmp_path / 'gate'}", subject="jobs.b.x")
        victim = wait_until(lambda: [r for r in x.jobs.running() if r.seq == seq], what="b's job running")[0]
        x.config_path.write_text(tomli_w.dumps({**x.config, "pools": {"a": pools["a"]}}))
        x.signal(signal.SIGHUP)
        x.wait_event("pool_removed", pool="b")
        proxy.refuse("jetstream-supervisor")
        wait_until(lambda: not x.status()["nats"]["connected"], what="the parent disconnected")
        psutil.Process(victim.pid).send_signal(signal.SIGKILL)
        x.wait_event("nak_held_back", seq=seq)
        wait_until(lambda: "b" not in x.status()["pools"] and not x.status()["workers"]["list"][1:],
                   what="pool b without workers")
        proxy.allow()
        wait_until(lambda: x.status()["nats"]["connected"], what="the parent back")
        y = supervisor_factory(nats_server, pools={"b": pools["b"]})
        again = wait_until(lambda: [r for r in y.jobs.started() if r.seq == seq], timeout=ack_wait / 2,
                           what="b's job back long before AckWait")[0]
        assert again.delivery == 2 and x.events("held_back_sent", count=1)
        (tmp_path / "gate").touch()
        wait_until(lambda: seq in y.jobs.done_seqs(), what="the job done")
        assert x.stop() == 0 and y.stop() == 0
    finally:
        proxy.stop()


def test_a_lost_hosts_jobs_are_released_when_the_poller_runs_another_pool(nats_server, supervisor_factory, tmp_path):
    """The systemd template's way: one supervisor per pool per host (`start --pool NAME`), all in
    one fleet bucket. X runs pool a and is the first poller; Y and then W run pool b, and Y's
    whole host dies (its process group SIGKILLed) while it runs a long job of b. AckWait 300 s:
    only a release brings the job back to W within the test. A poller per bucket ran pool a
    and released only a's jobs; with a poller per consumer, W takes b's lease from the dead Y
    and releases it (X, polling a, leaves b's jobs to b's poller)."""
    pools = {"a": {"count": 1, "filter_subject": "jobs.a.>"},
             "b": {"count": 1, "filter_subject": "jobs.b.>", "ack_wait": 300.0}}

    def host(name: str, pool: str):
        return supervisor_factory(nats_server, pools=pools, args=("--pool", pool, "--log-format", "json"),
                                  fleet={"name": name, "heartbeat": 0.5})
    x = host("x", "a")
    x.wait_ready(1)
    wait_until(lambda: (x.try_status() or {}).get("fleet", {}).get("is_poller"), what="x the poller")
    y = host("y", "b")
    y.wait_ready(1)
    [seq] = publish_now(nats_server.url, count=1, data=f"until:{tmp_path / 'gate'}", subject="jobs.b.x")
    wait_until(lambda: [r for r in y.jobs.running() if r.seq == seq], what="y running b's job")
    w = host("w", "b")
    w.wait_ready(1)
    wait_until(lambda: {r["name"]: r["held"] for r in fleet_view(x)["supervisors"]}.get("y") == 1,
               what="y's heartbeat listing the job", interval=0.25)
    os.killpg(y.proc.pid, signal.SIGKILL)
    y.proc.wait()
    lost = w.wait_event("fleet_peer_lost", peer="y")
    assert lost["released"] == [seq] and lost["consumers"] == ["workers-b"], lost
    wait_until(lambda: [r for r in w.jobs.started() if r.seq == seq], timeout=20, what="b's job run again on w")
    assert x.status()["fleet"]["polls"] == ["workers-a"] and not x.events("fleet_peer_lost")
    (tmp_path / "gate").touch()
    assert w.stop() == 0 and x.stop() == 0


def test_two_sighups_in_a_row_that_add_a_pool_start_it_once(nats_server, supervisor_factory):
    """A pool added to the file, then SIGHUP twice in a row (a config tool, `systemctl reload`
    twice), the second while the first is still under way (it imports c's handler, which takes a
    second): each reload makes its plan against the pools running then, so both would add pool c.
    The second crew must not replace the first behind its back: the first's workers would run on
    with nobody reaping them, NAKing their dead's jobs or sending their +WPI."""
    sup = supervisor_factory(nats_server, pools={"a": {"count": 1, "filter_subject": "jobs.a.>"}})
    sup.wait_ready(1)
    sup.config_path.write_text(tomli_w.dumps({**sup.config, "pools": {
        **sup.config["pools"], "c": {"count": 1, "filter_subject": "jobs.c.>", "handler": "slowimport:handle"}}}))
    sup.signal(signal.SIGHUP)
    sup.wait_log("received SIGHUP")
    sup.signal(signal.SIGHUP)           # while the first reload imports c's handler (a second)
    status = wait_until(lambda: (s := sup.try_status()) and set(s["pools"]) == {"a", "c"}
                        and s["workers"]["ready"] == 2 and s, what="pools a and c ready")
    listed = {w["pid"] for w in status["workers"]["list"]}
    seqs = publish_now(nats_server.url, count=4, data="0", subject="jobs.c.x")
    wait_until(lambda: set(seqs) <= sup.jobs.done_seqs(), what="c's jobs done")
    assert sup.worker_pids() == listed, f"worker processes {sup.worker_pids()}, /status lists {listed}"
    assert sup.stop() == 0
