"""Pools meeting each other (issue 28, a cold review): what one pool's state must never do to
another's, forced against a real nats-server with real `supervisor start`s and workers."""

from __future__ import annotations

from harness import publish_now, wait_until


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
