"""The 3-node cluster fixture itself (tests/natscluster.py): what other cluster tests rely on."""

from __future__ import annotations

import asyncio
import json

import nats
from nats.js import api

from harness import wait_until


async def _setup(urls: list[str]) -> None:
    nc = await nats.connect(servers=urls)
    js = nc.jetstream()
    await js.add_stream(api.StreamConfig(name="JOBS", subjects=["jobs.>"], num_replicas=3,
                                         retention=api.RetentionPolicy.WORK_QUEUE))
    await js.add_consumer("JOBS", api.ConsumerConfig(durable_name="workers", ack_policy=api.AckPolicy.EXPLICIT))
    for i in range(5):
        await js.publish("jobs.x", str(i).encode())
    await nc.close()


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
    assert cluster.consumer_state("JOBS", "workers")["num_pending"] == 5


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
