"""The 3-node cluster fixture itself (tests/support/natscluster.py): what other cluster tests rely on."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket

import nats
import psutil
from harness import _in_group, publish, run_cli, wait_until
from nats.js import api
from natsauth import free_port
from natscluster import NatsCluster, SteadyPublisher


async def _setup(urls: list[str]) -> None:
    nc = await nats.connect(servers=urls)
    js = nc.jetstream()
    await js.add_stream(api.StreamConfig(name="JOBS", subjects=["jobs.>"], num_replicas=3,
                                         retention=api.RetentionPolicy.WORK_QUEUE))
    await js.add_consumer("JOBS", api.ConsumerConfig(durable_name="workers", ack_policy=api.AckPolicy.EXPLICIT))
    for i in range(5):
        await js.publish("jobs.x", str(i).encode())
    await nc.close()


def test_a_cluster_port_taken_before_its_node_binds_is_picked_again(tmp_path):
    """The cluster's ports are picked before any node starts; one taken in between (held here,
    for real) makes that node exit "address already in use", and the start picks every node's
    ports again instead of failing the test that asked for a cluster."""
    cluster = NatsCluster(tmp_path / "cluster")
    held = cluster.nodes[1].cluster_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", held))
        taken.listen()
        with cluster.start():
            assert held not in {n.cluster_port for n in cluster.nodes}
            assert len(cluster.live()) == 3 and cluster.meta_leader() in {"n1", "n2", "n3"}
    said = b"".join(f.read_bytes() for f in (tmp_path / "cluster").glob("*.log"))
    assert b"address already in use" in said


def test_cluster_leaders_move_and_a_killed_node_comes_back(nats_cluster):
    cluster = nats_cluster
    assert len({n.name for n in cluster.nodes}) == 3 and cluster.meta_leader() in {"n1", "n2", "n3"}
    asyncio.run(_setup(cluster.urls))
    assert cluster.stream_messages("JOBS") == 5

    consumer_leader = cluster.consumer_leader("JOBS", "workers")
    reply = cluster.stepdown_consumer("JOBS", "workers")
    assert reply.get("success"), json.dumps(reply)
    assert cluster.consumer_leader("JOBS", "workers", not_on=consumer_leader.name).name != consumer_leader.name

    stream_leader = cluster.stream_leader("JOBS")
    stream_leader.kill()
    assert not stream_leader.alive
    assert cluster.stream_leader("JOBS").name != stream_leader.name
    stream_leader.restart()
    cluster.wait_healthy()
    assert cluster.stream_messages("JOBS") == 5
    # A new leader's pending count can lag a moment behind its stream: waited for, not read once.
    wait_until(lambda: cluster.consumer_state("JOBS", "workers")["num_pending"] == 5, what="5 pending after the restart")


def test_a_paused_node_loses_its_leadership_and_resumes(nats_cluster):
    cluster = nats_cluster
    asyncio.run(_setup(cluster.urls))
    leader = cluster.stream_leader("JOBS")
    leader.pause()
    try:
        others = [n for n in cluster.nodes if n is not leader]
        # the two others elect a new leader while the old one is frozen
        wait_until(lambda: {n.claims("JOBS")[0] for n in others} - {None, leader.name}, 60, "a new stream leader")
    finally:
        leader.resume()
    cluster.wait_healthy()
    assert cluster.stream_messages("JOBS") == 5


# ---------------------------------------------------------------- supervisors on the cluster

def fleet_supervisor(factory, cluster, name: str, **sections):
    """A supervisor as a separate "host": its own fleet name, HTTP port, job log. The HTTP port is
    base_config's 127.0.0.1:0, bound by the supervisor (SupervisorProc.http reads it from its log):
    one picked here in advance could be taken before the supervisor binds it."""
    return factory(None, nats={"servers": cluster.urls, "startup_timeout": 30.0},
                   stream={"replicas": 3}, consumer={"ack_wait": 10.0},
                   fleet={"name": name, "heartbeat": 0.5}, workers={"count": 2},
                   monitor={"interval": 0.25}, **sections)


def fleet_view(sup) -> dict:
    r = run_cli("status", "--fleet", "--json", "--config", str(sup.config_path))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def fleet_states(sup) -> dict[str, str]:
    return {row["name"]: row["state"] for row in fleet_view(sup)["supervisors"]}


def done_seqs(*sups) -> set[int]:
    return set().union(*(s.jobs.done_seqs() for s in sups))


def test_two_supervisors_lose_nothing_through_a_stream_leader_kill_and_a_lost_host(nats_cluster, supervisor_factory):
    """Two "hosts" on one R3 stream under steady load: the stream leader SIGKILLed and restarted,
    then one whole supervisor SIGKILLed (parent and workers, the poller: the fleet must elect
    another before it can notice). Every stored job runs; the survivor stays up, marks the
    other lost, and explains its jobs' redeliveries as the lost host's."""
    cluster = nats_cluster
    alpha = fleet_supervisor(supervisor_factory, cluster, "alpha")
    alpha.wait_ready()                    # alpha provisions the stream (R3), the consumer and the bucket
    beta = fleet_supervisor(supervisor_factory, cluster, "beta")
    beta.wait_ready()
    wait_until(lambda: fleet_states(alpha) == {"alpha": "ok", "beta": "ok"}, what="both in the fleet view",
               interval=0.5)
    wait_until(lambda: all((s.try_status() or {}).get("fleet", {}).get("peers") == 1 for s in (alpha, beta)),
               what="each /status counting the other as its one peer")
    pub = SteadyPublisher(cluster.urls, count=300, rate=20, data="0.1").start()
    try:
        wait_until(lambda: alpha.jobs.done_seqs() and beta.jobs.done_seqs(), what="jobs done on both hosts")
        leader = cluster.stream_leader("JOBS")
        leader.kill()
        cluster.stream_leader("JOBS", not_on=leader.name)
        leader.start()
        cluster.wait_healthy()

        victim = wait_until(lambda: next((s for s in (alpha, beta) if (s.try_status() or {}).get(
            "fleet", {}).get("is_poller")), None), what="the fleet's poller")
        survivor = beta if victim is alpha else alpha
        wait_until(lambda: victim.jobs.running(), what="the victim running a job")
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        wait_until(lambda: not any(_in_group(p, victim.proc.pid) for p in psutil.process_iter()),
                   what="the victim's workers gone")
        running_at_kill = {r.seq for r in victim.jobs.running()}       # its job log is final now
        pub.join(timeout=120)
    finally:
        pub.stop()

    stored = set(pub.stored.values())
    assert len(stored) == 300
    wait_until(lambda: stored <= done_seqs(alpha, beta), timeout=120, what="every stored job done")
    wait_until(lambda: cluster.stream_messages("JOBS") == 0, what="every job acked")
    assert survivor.proc.poll() is None, survivor.log()[-3000:]
    states = wait_until(lambda: (s := fleet_states(survivor)) == {victim_name(victim): "lost",
                                                                  victim_name(survivor): "ok"} and s,
                        what="the killed supervisor marked lost", interval=0.5)
    assert states
    status = survivor.status()
    cc = status["crosscheck"]
    assert cc["crashes"] == 0                                        # no worker died on the survivor
    # Every job the victim was running came back explained as the lost host's, not unexplained.
    lost_host = f"lost supervisor {victim_name(victim)}"
    explained = {r["stream_seq"] for r in cc["recent_cluster_explained"] if lost_host in r["why"]}
    assert running_at_kill <= explained, (running_at_kill, cc["recent_cluster_explained"], survivor.log()[-3000:])
    assert cc["lost_peer_redeliveries"] >= len(running_at_kill)
    assert status["fleet"]["is_poller"] and status["fleet"]["peers"] == 0 and status["fleet"]["lost"] == 1


def victim_name(sup) -> str:
    return sup.config["fleet"]["name"]


class StatusSampler:
    """Reads each supervisor's /status every 0.2 s from a thread while the test moves leaders."""

    def __init__(self, sups):
        import threading

        self.sups, self.samples = sups, {id(s): [] for s in sups}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StatusSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for sup in self.sups:
                status = sup.try_status()
                if status:
                    self.samples[id(sup)].append(status)


def reading(alpha, beta, leader: str) -> None:
    """Wait until both supervisors' /status shows ConsumerInfo from `leader`."""
    wait_until(lambda: all((s.try_status() or {}).get("consumer", {}).get("leader") == leader for s in (alpha, beta)),
               what=f"both supervisors reading consumer leader {leader}")


def test_leaders_move_mid_load_and_nobody_notices(nats_cluster, supervisor_factory):
    """Consumer and stream leaders stepped down, then the consumer leader SIGKILLed and restarted,
    under steady load on two supervisors: no exit, no worker death, every job done once acked,
    and the lag readings never go backwards nor turn stuck."""
    cluster = nats_cluster
    alpha = fleet_supervisor(supervisor_factory, cluster, "alpha")
    alpha.wait_ready()
    beta = fleet_supervisor(supervisor_factory, cluster, "beta")
    beta.wait_ready()
    pub = SteadyPublisher(cluster.urls, count=400, rate=20, data="0.1").start()
    with StatusSampler([alpha, beta]) as sampler:
        try:
            wait_until(lambda: len(done_seqs(alpha, beta)) >= 20, what="jobs flowing")
            before = cluster.consumer_leader("JOBS", "workers").name
            assert cluster.stepdown_consumer("JOBS", "workers").get("success")
            moved_to = cluster.consumer_leader("JOBS", "workers", not_on=before).name
            reading(alpha, beta, moved_to)
            assert cluster.stepdown_stream("JOBS").get("success")
            cluster.wait_healthy()
            victim = cluster.consumer_leader("JOBS", "workers")
            victim.kill()
            reading(alpha, beta, cluster.consumer_leader("JOBS", "workers", not_on=victim.name).name)
            victim.start()
            cluster.wait_healthy()
            pub.join(timeout=120)
        finally:
            pub.stop()
        stored = set(pub.stored.values())
        wait_until(lambda: stored <= done_seqs(alpha, beta), timeout=120, what="every stored job done")
        wait_until(lambda: cluster.stream_messages("JOBS") == 0, what="every job acked")
        leader_now = cluster.consumer_leader("JOBS", "workers").name
        reading(alpha, beta, leader_now)
        lag = run_cli("lag", "--json", "--config", str(alpha.config_path))
        assert lag.returncode == 0 and json.loads(lag.stdout)["leader"] == leader_now, lag.stdout + lag.stderr

    for sup in (alpha, beta):
        assert sup.proc.poll() is None, sup.log()[-3000:]
        status = sup.status()
        assert status["crosscheck"]["crashes"] == 0, status["crosscheck"]
        seen = sampler.samples[id(sup)]
        assert len(seen) > 50
        consumers = [s["consumer"] for s in seen if "delivered_consumer_seq" in s["consumer"]]
        for a, b in zip(consumers, consumers[1:]):       # what /status shows never goes back
            assert b["delivered_consumer_seq"] >= a["delivered_consumer_seq"], (a, b)
            assert b["ack_floor_consumer_seq"] >= a["ack_floor_consumer_seq"], (a, b)
        assert "stuck" not in {s["lag"]["state"] for s in seen}
        assert {c.get("leader") for c in consumers} >= {before, moved_to}
        # Acks the moves swallowed came back after AckWait: explained, not "AckWait too short".
        assert status["crosscheck"]["unexplained_redeliveries"] == 0, (status["crosscheck"], sup.log()[-3000:])
    # One of them polled, the other took its samples (and fell back to polling only while none came).
    sources = {s["consumer"].get("source") for sup in (alpha, beta) for s in sampler.samples[id(sup)]}
    assert {"self"} < sources, sources


# ---------------------------------------------------------------- `status --fleet` edge cases

def test_status_fleet_alone_is_one_row_and_the_supervisor_leaves_cleanly(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, fleet={"name": "solo", "heartbeat": 0.5})
    sup.wait_ready()
    view = wait_until(lambda: (v := fleet_view(sup))["supervisors"] and v["supervisors"][0]["workers"]["ready"] == 2
                      and v, what="a heartbeat with both workers ready")
    [row] = view["supervisors"]
    assert (row["name"], row["state"], row["pid"], row["workers"]) == ("solo", "ok", sup.proc.pid,
                                                                        {"ready": 2, "target": 2})
    assert view["consumer"]["name"] == "workers" and view["consumer"]["leader"] is None    # not clustered
    text = run_cli("status", "--fleet", "--config", str(sup.config_path))
    assert text.returncode == 0 and "solo" in text.stdout and " ok " in text.stdout, text.stdout
    fleet = sup.status()["fleet"]
    assert fleet["name"] == "solo" and fleet["peers"] == 0 and fleet["is_poller"]
    assert sup.stop() == 0
    assert fleet_view(sup)["supervisors"] == []        # a clean stop leaves the view, it is not "lost"


def test_status_fleet_with_nats_unreachable_exits_4_within_connect_timeout(tmp_path):
    import socket
    import time

    # Refused at once, and a listener that never says a word (the connect timeout's case).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        for url in (f"nats://127.0.0.1:{free_port()}", f"nats://127.0.0.1:{silent.getsockname()[1]}"):
            started = time.monotonic()
            r = run_cli("status", "--fleet", "--json", "--server", url, tmp=tmp_path,
                        env={"SUPERVISOR_NATS_CONNECT_TIMEOUT": "1.5", "SUPERVISOR_NATS_STARTUP_TIMEOUT": "300"})
            took = time.monotonic() - started
            assert r.returncode == 4, (url, r.returncode, r.stderr)
            assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert "cannot connect to NATS at 127.0.0.1:" in r.stderr and "Traceback" not in r.stderr
            assert took < 30, took      # connect_timeout (1.5 s), not startup_timeout (300 s), plus a loaded box


def alpha_running_two(nats_server, supervisor_factory, data: str, args: tuple = (), **fleet):
    """Hosts alpha and beta (AckWait 300 s, heartbeat 0.5 s): alpha runs two jobs of `data` and
    beta has seen alpha's heartbeat list both. (alpha, beta, the two jobs' sequences)."""
    def host(name: str):
        return supervisor_factory(nats_server, args=args, consumer={"ack_wait": 300.0},
                                  fleet={"name": name, "heartbeat": 0.5, **fleet})

    alpha = host("alpha")
    alpha.wait_ready()
    publish(nats_server.url, count=2, data=data)
    wait_until(lambda: len(alpha.jobs.running()) == 2, what="alpha running both jobs")
    beta = host("beta")
    beta.wait_ready()
    wait_until(lambda: {r["name"]: r["held"] for r in fleet_view(beta)["supervisors"]}.get("alpha") == 2,
               what="alpha's heartbeat listing both jobs", interval=0.5)
    return alpha, beta, {r.seq for r in alpha.jobs.running()}


def test_release_lost_false_leaves_a_silent_hosts_jobs_alone(nats_server, supervisor_factory, tmp_path):
    """fleet.release_lost = false: a host gone silent (its whole process group SIGSTOPped, as in a
    partition) is declared lost, but nothing it held is NAKed, so its jobs are not run twice
    beside it. When it wakes it logs that it was declared lost, finishes its jobs, and each ran
    once."""
    gate = tmp_path / "finish"
    alpha, beta, running = alpha_running_two(nats_server, supervisor_factory, f"until:{gate}",
                                             args=("--log-format", "json"), release_lost=False)
    os.killpg(alpha.proc.pid, signal.SIGSTOP)
    try:
        lost = beta.wait_event("fleet_peer_lost", peer="alpha")
    finally:
        os.killpg(alpha.proc.pid, signal.SIGCONT)
    assert lost["released"] == [] and set(lost["skipped"]) == running, lost
    alpha.wait_event("fleet_declared_lost")
    gate.touch()
    wait_until(lambda: nats_server.stream_msgs() == 0, what="alpha finished and acked both jobs")
    starts = [(r.seq, r.delivery) for r in alpha.jobs.started() + beta.jobs.started()]
    assert sorted(starts) == sorted((seq, 1) for seq in running), "each job ran once, on alpha"
    assert beta.status()["crosscheck"]["unexplained_redeliveries"] == 0
    assert alpha.stop() == 0 and beta.stop() == 0


def test_a_lost_hosts_running_jobs_are_released_long_before_ack_wait(nats_server, supervisor_factory):
    """AckWait 300 s: the killed host's two long jobs run again on the other host within the
    test's 60 s, which only the release (a NAK once the host is declared lost) can do."""
    alpha, beta, running = alpha_running_two(nats_server, supervisor_factory, "20")
    os.killpg(alpha.proc.pid, signal.SIGKILL)
    alpha.proc.wait()
    again = wait_until(lambda: {r.seq for r in beta.jobs.started() if r.delivery == 2} >= running and
                       {r.seq for r in beta.jobs.started() if r.delivery == 2}, what="both jobs started on beta")
    assert again == running
    cc = beta.status()["crosscheck"]
    assert {r["stream_seq"] for r in cc["recent_cluster_explained"]} >= running
    assert cc["unexplained_redeliveries"] == 0
