"""Issue 17: README promises about peer supervisors and the done-marker, each forced against a real
nats-server with real workers, so that breaking the promise turns the test red.

- "with several supervisors on one consumer they come back after AckWait": a supervisor whose
  worker died with a pull request outstanding must not NAK, as lost in transit, a job that a
  peer supervisor's worker is running (supervisor/parent/safety/in_transit.py runs only when Peers.alone()).
- "If the done-marker cannot be written after the handler returned, the job is acked anyway":
  the KV bucket is deleted for real while the job runs (workers/middleware/guard.py Guard.after).

AckWait is 60 s in both: anything redelivered within the test's seconds was someone's NAK.
"""

from __future__ import annotations

import asyncio

import nats
from harness import SupervisorProc, publish, wait_until

ACK_WAIT = 60.0
JSON = ("--log-format", "json")


def runs_of(seq: int, *sups: SupervisorProc) -> list[tuple[int, int]]:
    """(pid, delivery) of every start of job `seq` in the journals of `sups`."""
    return [(r.pid, r.delivery) for s in sups for r in s.jobs.started() if r.seq == seq]


def checks(sup: SupervisorProc) -> dict:
    """The in-transit reconciliations this supervisor decided: runs, naked, skipped."""
    return sup.status()["peers"]["in_transit_checks"]


def kill_with_credits(sup: SupervisorProc, server) -> None:
    """SIGKILL the one worker of `sup` while it has a pull request outstanding. An idle worker
    renews its request every PULL_EXPIRES (workers/runtime/puller.py): a kill between the
    expiry and the renewal finds no credits, and the in-transit check has nothing to look at;
    kill the replacement then."""
    for _ in range(10):
        sup.wait_ready(1)
        # The other supervisor's worker is busy (concurrency 1, nothing to prefetch): the
        # waiting pull request is this one's.
        wait_until(lambda: server.consumer()["num_waiting"] >= 1, what="the worker waiting on a pull")
        victim = sup.workers()[0]
        victim.kill()
        death = wait_until(lambda: [d for d in sup.status()["crosscheck"]["recent_deaths"] if d["pid"] == victim.pid],
                           what="the death in the ledger")[0]
        if death["in_transit"] > 0:
            return
    raise AssertionError("never killed the worker with a pull request outstanding")


# ---------------------------------------------------------------- in transit, with a peer

def beta_runs_alpha_listens(server, supervisor_factory, gate, **sections: dict) -> tuple:
    """Supervisor beta's only worker runs a job until `gate` exists; supervisor alpha, on the same
    consumer, has heard beta: (alpha, beta, the job's start record)."""
    same = {"consumer": {"ack_wait": ACK_WAIT}, "workers": {"count": 1}, **sections}
    beta = supervisor_factory(server, args=JSON, **same)
    beta.wait_ready(1)
    publish(server.url, count=1, data=f"until:{gate}")
    job = wait_until(lambda: beta.jobs.running(), what="beta's worker running the job")[0]
    alpha = supervisor_factory(server, args=JSON, **same)
    alpha.wait_ready(1)
    wait_until(lambda: alpha.status()["peers"]["heard"], what="alpha has heard from beta")
    return alpha, beta, job


def test_a_supervisor_with_a_peer_never_naks_the_peers_running_job(nats_server, supervisor_factory, tmp_path):
    """Beta's only worker runs a job; alpha, on the same consumer, knows beta is there. Alpha's
    idle worker dies with a pull request outstanding: alpha has a death with credits, and a
    stored, delivered message (beta's job) held by none of its own workers. Alone it would NAK
    that message as lost in transit; with a peer it must leave it to AckWait, because the
    message is a peer's running job."""
    gate = tmp_path / "release"
    alpha, beta, job = beta_runs_alpha_listens(nats_server, supervisor_factory, gate)
    kill_with_credits(alpha, nats_server)

    # The in-transit check counts a decision only for a death with credits outstanding: once
    # it has decided (skipped, or run), whatever it would NAK has been NAKed and fenced.
    decided = wait_until(lambda: (c := checks(alpha))["skipped"] + c["runs"] >= 1 and c,
                         what="alpha's in-transit check decided about the death")
    alpha.wait_ready(1)
    assert decided["naked"] == 0 and decided["runs"] == 0, decided
    assert alpha.status()["crosscheck"]["in_transit_naked"] == 0
    assert runs_of(job.seq, alpha, beta) == [(job.pid, 1)], "beta's running job was handed out again"

    gate.touch()
    wait_until(lambda: nats_server.stream_msgs() == 0 and not beta.jobs.running() and not alpha.jobs.running(),
               what="beta's job finished and acked")
    assert runs_of(job.seq, alpha, beta) == [(job.pid, 1)]
    assert [r.seq for s in (alpha, beta) for r in s.jobs.done()] == [job.seq]
    assert not alpha.events("redelivered") and not beta.events("redelivered")
    assert alpha.stop() == 0 and beta.stop() == 0


# ---------------------------------------------------------------- the done-marker cannot be written

async def delete_bucket(url: str, bucket: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_key_value(bucket)
    finally:
        await nc.close()


def test_a_done_marker_that_cannot_be_written_still_acks_the_job(nats_server, supervisor_factory, tmp_path):
    """The job claims its lease and runs; the bucket is deleted under it; the handler returns.
    The marker write fails (nobody answers on $KV.<bucket>.>): the job is acked anyway, once,
    not NAKed to run again."""
    gate = tmp_path / "release"
    sup = supervisor_factory(nats_server, args=JSON, consumer={"ack_wait": ACK_WAIT},
                             workers={"count": 1, "double_ack": True}, idempotency={"enabled": True})
    sup.wait_ready(1)
    bucket = sup.status()["idempotency"]["bucket"]
    publish(nats_server.url, count=1, data=f"until:{gate}")
    job = wait_until(lambda: sup.jobs.running(), what="the job running under its lease")[0]
    asyncio.run(delete_bucket(nats_server.url, bucket))

    gate.touch()
    failed = sup.wait_event("done_marker_failed")
    settled = wait_until(lambda: (s := sup.status()["jobs"])["ack"] + s["nak"] + s["term"] >= 1 and s,
                         what="the job settled")
    assert settled["ack"] == 1 and settled["nak"] == 0 and settled["term"] == 0, settled
    wait_until(lambda: nats_server.stream_msgs() == 0, what="the acked job gone from the work queue")
    assert f"seq={job.seq}" in failed["message"], failed
    assert runs_of(job.seq, sup) == [(job.pid, 1)] and len(sup.jobs.done()) == 1
    assert not sup.events("redelivered")
    assert sup.stop() == 0
