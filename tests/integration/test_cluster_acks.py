"""A consumer leader failover must rerun no job that completed (workers/runtime/reack.py).

On a 3-node cluster with an R3 stream, an ack the worker's server read can still be lost: the
consumer leader replicates it after applying it, and from the leader's death until a new one is
elected nobody subscribes to the ack subject, so the servers drop acks silently while the
worker's fence succeeds. Each worker keeps its recent acks and sends them again, until the new
leader confirms each, when the consumer's leader changes. Judged by the handlers' own journal:
every job completed exactly once.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading

import nats
from harness import wait_until
from natscluster import NatsCluster, SteadyPublisher

ACK_WAIT = 30.0     # far past an election (4-9 s): a job back before it came back by a NAK, not an expiry
JSON_LOGS = ("--log-format", "json")
CONSUMER = ("JOBS", "workers")


def cluster_supervisor(factory, servers: list[str], **sections):
    return factory(None, args=JSON_LOGS, nats={"servers": servers, "startup_timeout": 30.0},
                   stream={"replicas": 3}, consumer={"ack_wait": ACK_WAIT}, monitor={"interval": 0.25},
                   **sections)


def lead(cluster: NatsCluster, on: str) -> None:
    """The consumer's leader moves to node `on` (a step-down with a preferred placement), and the
    stream's away from it."""
    def leads(stream: str, consumer: str | None, name: str) -> bool:
        node = cluster._leader(stream, consumer)
        return node is not None and node.name == name

    if not leads(*CONSUMER, on):
        reply = cluster.api(f"$JS.API.CONSUMER.LEADER.STEPDOWN.{'.'.join(CONSUMER)}", {"placement": {"preferred": on}})
        assert reply.get("success"), reply
        wait_until(lambda: leads(*CONSUMER, on), what=f"consumer leader {on}", interval=0.1)
    if cluster.stream_leader("JOBS").name == on:
        other = next(n.name for n in cluster.nodes if n.name != on)
        assert cluster.api("$JS.API.STREAM.LEADER.STEPDOWN.JOBS", {"placement": {"preferred": other}}).get("success")
        wait_until(lambda: leads("JOBS", None, other), what=f"stream leader {other}", interval=0.1)


def server_time(stamp: str) -> float:
    """A Go RFC 3339 timestamp (nanoseconds, Z) as seconds since the epoch."""
    from datetime import datetime

    whole, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(whole + "+00:00").timestamp() + float("0." + (frac or "0"))


class AdvisoryWatch:
    """The LEADER_ELECTED advisories for the consumer, as a test-side client on `servers` sees
    them, with the server's own time of each (a thread of its own)."""

    def __init__(self, servers: list[str]):
        self.servers = servers
        self.seen: list[dict] = []
        self.ready, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self.run()), daemon=True)

    def __enter__(self) -> AdvisoryWatch:
        self.thread.start()
        assert self.ready.wait(30), "advisory watch did not connect"
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(10)

    async def run(self) -> None:
        async def quiet(exc: Exception) -> None:
            pass

        async def seen(msg) -> None:
            self.seen.append(json.loads(msg.data))

        nc = await nats.connect(servers=self.servers, error_cb=quiet, max_reconnect_attempts=-1)
        await nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.{'.'.join(CONSUMER)}", cb=seen)
        await nc.flush()
        self.ready.set()
        while not self.done.is_set():
            await asyncio.sleep(0.05)
        await nc.close()


def runs_per_seq(*sups) -> collections.Counter:
    return collections.Counter(r.seq for s in sups for r in s.jobs.done())


def settled(cluster: NatsCluster, stored: set[int], sup) -> None:
    """Every stored job done, acked (gone from the work queue) and nothing awaiting an ack: no
    redelivery can still come."""
    wait_until(lambda: stored <= sup.jobs.done_seqs(), timeout=2 * ACK_WAIT, what="every stored job done")
    wait_until(lambda: cluster.stream_messages("JOBS") == 0 and cluster.consumer_state(*CONSUMER)["num_ack_pending"] == 0,
               timeout=2 * ACK_WAIT, what="every job acked, nothing awaiting an ack")


def test_acks_sent_while_the_consumer_has_no_leader_are_confirmed_by_the_next(nats_cluster, supervisor_factory,
                                                                           tmp_path):
    """The forcing: the worker connects to n1 or n2 only, the consumer leader is n3. Two jobs
    are running when n3 is SIGKILLed; they finish (their gate opens) while n1 and n2 still have
    no leader, so their acks reach a server with nobody to take them, and the worker's fence
    succeeds. The journal's finish times against the new leader's LEADER_ELECTED advisory prove
    the acks went out into that gap. The new leader holds both jobs as pending: without the
    re-sent acks each runs again once AckWait is out. With them, each ran once, and the parent's
    ledger counts the acks re-sent and confirmed."""
    cluster = nats_cluster
    n1, n2, n3 = cluster.nodes
    sup = cluster_supervisor(supervisor_factory, [n1.url, n2.url], workers={"count": 1, "concurrency": 2})
    sup.wait_ready(1)
    lead(cluster, "n3")
    gate = tmp_path / "finish"
    with AdvisoryWatch([n1.url, n2.url]) as advisories:
        warm = SteadyPublisher([n1.url], count=10, rate=50, data="0").start()
        warm.join()
        wait_until(lambda: set(warm.stored.values()) <= sup.jobs.done_seqs(), what="the warm-up jobs done")
        gated = SteadyPublisher([n1.url], count=2, rate=50, data=f"until:{gate}", prefix="gated").start()
        gated.join()
        wait_until(lambda: len(sup.jobs.running()) == 2, what="both gated jobs running")
        n3.kill()
        assert {n1.claims(*CONSUMER)[0], n2.claims(*CONSUMER)[0]} <= {"n3", "", None}, "a new leader already"
        gate.touch()
        finished = wait_until(lambda: len(done := [r for r in sup.jobs.done() if r.seq in gated.stored.values()]) == 2
                              and done, what="both gated jobs finished")
        new_leader = cluster.consumer_leader(*CONSUMER, not_on="n3").name
        elected = wait_until(lambda: [a for a in advisories.seen if a.get("leader") == new_leader], what="the advisory")
    elected_at = server_time(elected[0]["timestamp"])
    assert max(r.t for r in finished) < elected_at, "the acks did not go out while the consumer had no leader"

    stored = set(warm.stored.values()) | set(gated.stored.values())
    settled(cluster, stored, sup)
    runs = runs_per_seq(sup)
    assert [seq for seq, n in runs.items() if n > 1] == [], f"ran twice: {runs}"
    cc = sup.status()["crosscheck"]
    assert cc["acks_resent_confirmed"] >= 2 and cc["acks_resent_unconfirmed"] == 0, cc
    assert cc["unexplained_redeliveries"] == 0 and cc["crashes"] == 0, cc
    resent = sup.events("acks_resent")
    assert resent and all(e["unconfirmed"] == [] for e in resent), resent
    n3.start()
    cluster.wait_healthy()
    assert sup.stop() == 0


JOBS = 120


def test_the_consumer_leader_killed_under_load_reruns_no_completed_job(nats_cluster, supervisor_factory):
    """Steady load on one supervisor over all three nodes, the consumer leader SIGKILLed and
    restarted: no job is lost and, by the handlers' journal, none that completed ran again.
    (The window's forcing test is the one above; the chaos suite's cluster-leaders scenario kills
    leaders repeatedly.)"""
    cluster = nats_cluster
    sup = cluster_supervisor(supervisor_factory, cluster.urls, workers={"count": 3})
    sup.wait_ready(3)
    pub = SteadyPublisher(cluster.urls, count=JOBS, rate=12, data="0.25").start()
    try:
        wait_until(lambda: len(sup.jobs.done()) >= 20, what="jobs flowing")
        victim = cluster.consumer_leader(*CONSUMER)
        # Something to lose: jobs running at the kill (a loaded box may be between jobs a moment).
        wait_until(lambda: sup.jobs.running(), what="a job running at the kill")
        victim.kill()
        cluster.consumer_leader(*CONSUMER, not_on=victim.name)
        victim.start()
        cluster.wait_healthy()
        pub.join(timeout=120)
    finally:
        pub.stop()
    stored = set(pub.stored.values())
    assert len(stored) == JOBS
    settled(cluster, stored, sup)
    runs = runs_per_seq(sup)
    assert [seq for seq, n in runs.items() if n > 1] == [], "completed jobs ran again after the failovers"
    cc = sup.status()["crosscheck"]
    assert cc["acks_resent"] > 0 and cc["unexplained_redeliveries"] == 0 and cc["crashes"] == 0, cc
    assert sup.stop() == 0
