"""[limits.NAME] on a 3-node cluster (issue 26): the limits bucket has the stream's replicas, so
its leader's death moves it; slots held meanwhile stay held (their TTL outlives an election),
none is handed out twice, and no job is lost. A job on a gate holds one slot from before the
kill (the bucket names its worker) until the cluster is healthy again, so a slot is renewed
through the election."""

from __future__ import annotations

from harness import publish_now, wait_until
from natscluster import SteadyPublisher
from test_fleet_cluster import done_seqs, fleet_supervisor
from test_limits import most_at_once, records, slot_holders

BUCKET_STREAM = "KV_SUPERVISOR_LIMITS"


def test_the_limit_holds_through_a_kv_leader_kill(nats_cluster, supervisor_factory, tmp_path):
    cluster = nats_cluster
    limits = {"db": {"concurrency": 3, "subjects": ["jobs.db.>"]}}
    alpha = fleet_supervisor(supervisor_factory, cluster, "alpha", limits=limits, args=("--log-format", "json"))
    alpha.wait_ready()                    # provisions the stream, the consumer and the R3 limits bucket
    beta = fleet_supervisor(supervisor_factory, cluster, "beta", limits=limits, args=("--log-format", "json"))
    beta.wait_ready()
    gate = tmp_path / "gate"
    pub = SteadyPublisher(cluster.urls, count=150, rate=12, data="0.2", subject="jobs.db.write").start()
    try:
        wait_until(lambda: len(done_seqs(alpha, beta)) >= 20, what="limited jobs done on the fleet")
        [gated] = publish_now(cluster.urls[0], count=1, data=f"until:{gate}", subject="jobs.db.write")
        [holding] = wait_until(lambda: [r for r in records(alpha, beta) if r.seq == gated], what="the gated job running")
        leader = cluster.stream_leader(BUCKET_STREAM)
        held_before = slot_holders(cluster.urls)
        leader.kill()
        assert any(h.pid == holding.pid and h.parent in (alpha.proc.pid, beta.proc.pid) for h in held_before.values()), \
            f"no slot held by the gated job's worker {holding.pid} when the KV leader died: {held_before}"
        cluster.stream_leader(BUCKET_STREAM, not_on=leader.name)
        leader.start()
        cluster.wait_healthy()
        gate.touch()
        pub.join(timeout=120)
    finally:
        gate.touch()
        pub.stop()
    stored = set(pub.stored.values())
    assert len(stored) == 150
    stored.add(gated)
    wait_until(lambda: stored <= done_seqs(alpha, beta), timeout=120, what="every stored job done")
    wait_until(lambda: cluster.stream_messages("JOBS") == 0, what="every job acked")
    assert most_at_once(records(alpha, beta)) <= 3, "the limit was exceeded across the leader change"
    lost = alpha.events("limit_slot_lost") + beta.events("limit_slot_lost")
    assert not lost, lost
