"""Dead letters (issue 15, point 3): a Reject is logged and kept; `supervisor dlq list` shows it
and `dlq replay` runs it again, once, even when a replay was cut short between its publish and
its delete; a job that keeps failing ends there after the default consumer.max_deliver."""

import asyncio
import json

import nats
from harness import run_cli, wait_until

from supervisor.cli import dlq

DLQ = "JOBS_DLQ"


async def _with_js(url: str, work):
    nc = await nats.connect(url)
    try:
        return await work(nc.jetstream())
    finally:
        await nc.close()


def js_call(url: str, work):
    return asyncio.run(_with_js(url, work))


def publish_jobs(url: str, jobs: list[tuple[str, str]]) -> list[int]:
    """(payload, Trace-Id) pairs to jobs.new; their stream sequences."""
    async def work(js):
        return [(await js.publish("jobs.new", data.encode(), headers={"Trace-Id": trace})).seq for data, trace in jobs]
    return js_call(url, work)


def last_seq(url: str, stream: str = "JOBS") -> int:
    async def work(js):
        return (await js.stream_info(stream)).state.last_seq
    return js_call(url, work)


def dlq_cli(url: str, *args: str):
    return run_cli("dlq", *args, "--server", url)


def listed(url: str) -> list[dict]:
    r = dlq_cli(url, "list", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def done_data(sup) -> list[str]:
    return [r.data for r in sup.jobs.done()]


def rejecting(supervisor_factory, nats_server, handler: str = "uxhandlers:reject_unless_replayed"):
    """One worker, JSON logs: the tests read the structured events, not the wording."""
    sup = supervisor_factory(nats_server, args=("--log-format", "json"), workers={"count": 1, "handler": handler})
    sup.wait_ready(1)
    return sup


def test_reject_is_logged_listed_and_replayed(nats_server, supervisor_factory):
    sup = rejecting(supervisor_factory, nats_server)
    assert publish_jobs(nats_server.url, [("a", "t-a"), ("b", "t-b")]) == [1, 2]
    for seq, data in ((1, "a"), (2, "b")):
        rejected = sup.wait_event("rejected", seq=seq)
        assert (rejected["subject"], rejected["reason"], rejected["level"]) == ("jobs.new", f"bad payload {data}", "warning")
        assert f"bad payload {data}" in rejected["message"]          # the operator's line says why
        [copied] = sup.events("dead_letter", seq=seq)                 # copied before the TERM
        assert (copied["to"], copied["reason"]) == ("dlq.jobs", f"bad payload {data}")

    letters = listed(nats_server.url)       # the copy is PubAcked before the TERM: both are there
    assert [(x["seq"], x["subject"], x["stream"], x["stream_seq"], x["deliveries"], x["reason"], x["data"])
            for x in letters] == [(1, "jobs.new", "JOBS", 1, 1, "bad payload a", "a"),
                                  (2, "jobs.new", "JOBS", 2, 1, "bad payload b", "b")]
    assert letters[0]["headers"] == {"Trace-Id": "t-a"} and letters[0]["time"].startswith("20")
    text = dlq_cli(nats_server.url, "list").stdout
    assert "dead-lettered" in text and "JOBS seq 2" in text and "bad payload b" in text, text
    assert len(listed_limited := json.loads(dlq_cli(nats_server.url, "list", "--json", "--limit", "1").stdout)) == 1
    assert listed_limited[0]["seq"] == 1

    r = dlq_cli(nats_server.url, "replay", "--seq", "1")
    assert r.returncode == 0, r.stderr
    assert "dead letter 1 (JOBS seq 1) -> jobs.new: JOBS seq 3" in r.stdout, r.stdout
    wait_until(lambda: "a trace=t-a" in done_data(sup), what="the replayed job to run with its own headers")
    assert [x["seq"] for x in listed(nats_server.url)] == [2]

    r = dlq_cli(nats_server.url, "replay", "--all")
    assert r.returncode == 0 and "replayed 1 dead letter from JOBS_DLQ" in r.stdout, r.stdout + r.stderr
    wait_until(lambda: "b trace=t-b" in done_data(sup), what="the second replayed job to run")
    assert listed(nats_server.url) == []
    assert "no dead letters in JOBS_DLQ" in dlq_cli(nats_server.url, "list").stdout
    assert sorted(done_data(sup)) == ["a trace=t-a", "b trace=t-b"]
    assert len(sup.events("rejected")) == 2          # the replays ran; nothing rejected again
    assert sup.stop() == 0


def test_replay_cut_short_between_publish_and_delete_queues_the_job_once(nats_server, supervisor_factory):
    sup = rejecting(supervisor_factory, nats_server)
    publish_jobs(nats_server.url, [("c", "t-c")])
    sup.wait_event("rejected", seq=1)

    async def first_half(js):    # what a replay killed right after its PubAck has done
        letters, _ = await dlq.read_letters(js, DLQ, 10)
        return (await dlq.publish_copy(js, DLQ, letters[0], None))[0].seq
    copy = js_call(nats_server.url, first_half)
    assert copy == 2 and [x["seq"] for x in listed(nats_server.url)] == [1]

    r = dlq_cli(nats_server.url, "replay", "--all")
    assert r.returncode == 0, r.stderr
    assert "dead letter 1 (JOBS seq 1) was already in JOBS as seq 2 (an earlier replay was cut short)" in r.stdout
    assert listed(nats_server.url) == []
    assert last_seq(nats_server.url) == 2, "the retried replay must not queue a second copy"
    wait_until(lambda: nats_server.consumer()["num_ack_pending"] == 0 and nats_server.consumer()["num_pending"] == 0
               and done_data(sup), what="the replayed job done")
    assert done_data(sup) == ["c trace=t-c"]
    assert sup.stop() == 0


def test_replay_that_cannot_be_stored_keeps_the_dead_letter(nats_server, supervisor_factory):
    sup = rejecting(supervisor_factory, nats_server)
    publish_jobs(nats_server.url, [("d", "t-d")])
    sup.wait_event("rejected", seq=1)
    r = dlq_cli(nats_server.url, "replay", "--all", "--subject", "nowhere.at.all")
    assert r.returncode == 4, r.stdout + r.stderr
    assert "dead letter 1: publishing to nowhere.at.all failed (no stream captures that subject); it stays in " \
           "JOBS_DLQ; replayed 0 before it" in r.stderr, r.stderr
    assert [x["seq"] for x in listed(nats_server.url)] == [1]
    assert sup.stop() == 0


def test_dlq_usage_errors_exit_2(nats_server, tmp_path):
    js_call(nats_server.url, lambda js: js.add_stream(name=DLQ, subjects=["dlq.jobs"]))
    for args, words in ((("replay", "--seq", "7"), "--seq: no dead letter 7 in JOBS_DLQ"),
                        (("list", "--limit", "0"), "--limit: must be 1 or more"),
                        (("replay",), "one of the arguments --all --seq is required")):
        r = dlq_cli(nats_server.url, *args)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    r = run_cli("dlq", "list", "--server", nats_server.url, env={"SUPERVISOR_RESTART_DEAD_LETTER_STREAM": ""})
    assert r.returncode == 2 and "restart.dead_letter_stream: is empty" in r.stderr, r.stderr


def test_a_job_that_keeps_failing_is_dead_lettered_after_the_default_max_deliver(nats_server, supervisor_factory):
    """consumer.max_deliver is finite by default (10): [retry] counts it as the attempts a failing
    job gets, so its 10th failure is dead-lettered by the worker, the exception in the copy's
    headers, where `dlq list` shows it (the server would have given up on it there too)."""
    sup = supervisor_factory(nats_server, args=("--log-format", "json"),
                             workers={"count": 1, "handler": "uxhandlers:always_fail", "retry_backoff": [0.0]})
    sup.wait_ready(1)
    publish_jobs(nats_server.url, [("e", "t-e")])
    letter_logged = sup.wait_event("dead_letter", seq=1)
    reason = "RuntimeError: failing delivery 10 of seq 1 on purpose"
    assert letter_logged["to"] == "dlq.jobs" and letter_logged["reason"].startswith(reason)
    assert letter_logged["reason"].endswith("(attempt 10 of 10)")
    [letter] = listed(nats_server.url)
    assert (letter["stream_seq"], letter["deliveries"]) == (1, 10) and letter["reason"] == letter_logged["reason"]
    assert [e["delivery"] for e in sup.events("handler_failed", seq=1)] == list(range(1, 11))
    assert sup.stop() == 0
