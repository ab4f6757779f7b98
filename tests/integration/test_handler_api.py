"""The handler API's outcomes against a real server: `Retry(delay)` is a NAK with that delay,
`Reject(reason)` a TERM with a dead-letter copy. AckWait is 60 s, so a redelivery within seconds
was the worker's NAK, and one after the delay was not an immediate NAK."""

import asyncio

import nats
from harness import publish, wait_until
from test_crash_safety import dead_letters

ACK_WAIT = 60.0


def test_retry_delay_is_a_nak_with_that_delay(nats_server, supervisor_factory):
    delay = 2.0
    sup = supervisor_factory(nats_server, workers={"count": 2}, consumer={"ack_wait": ACK_WAIT})
    sup.wait_ready(2)
    publish(nats_server.url, count=1, data=f"retry:{delay}")
    first = wait_until(lambda: sup.jobs.started(), what="the first delivery")[0]
    again = wait_until(lambda: [r for r in sup.jobs.started() if r.delivery == 2], timeout=ACK_WAIT / 3,
                       what="the job back after its delay, long before AckWait")[0]
    # The NAK left the worker after the handler started, so the server held it back at least this long.
    waited = again.t - first.t
    assert delay <= waited < delay + 10, f"redelivered {waited:.2f}s later, asked for {delay}s"
    wait_until(lambda: nats_server.stream_msgs() == 0, what="acked on the second delivery")
    status = wait_until(lambda: (s := sup.status())["jobs"]["ack"] == 1 and s, what="the ack counted")
    assert status["jobs"]["nak"] == 1
    assert status["crosscheck"]["unexplained_redeliveries"] == 0 and status["crosscheck"]["crashes"] == 0
    assert sup.stop() == 0


async def publish_with_headers(url: str) -> int:
    nc = await nats.connect(url)
    try:
        ack = await nc.jetstream().publish("jobs.orders", b"reject",
                                           headers={"X-Trace": "trace-7", "Nats-Msg-Id": "order-7"})
        return ack.seq
    finally:
        await nc.close()


def test_reject_terms_the_job_and_dead_letters_a_copy(nats_server, supervisor_factory):
    sup = supervisor_factory(nats_server, workers={"count": 2}, consumer={"ack_wait": ACK_WAIT})
    sup.wait_ready(2)
    seq = asyncio.run(publish_with_headers(nats_server.url))
    [letter] = wait_until(lambda: asyncio.run(dead_letters(nats_server.url)), what="the dead-letter copy")
    assert letter.data == b"reject" and letter.subject == "dlq.jobs"
    h = letter.headers
    assert h["X-Trace"] == "trace-7", "the job's own headers are kept"
    assert h["Supervisor-Dead-Letter-Stream"] == "JOBS" and h["Supervisor-Dead-Letter-Sequence"] == str(seq)
    assert h["Supervisor-Dead-Letter-Subject"] == "jobs.orders"
    assert h["Supervisor-Dead-Letter-Deliveries"] == "1"
    assert h["Supervisor-Dead-Letter-Reason"] == "payload asked to be rejected"
    assert h["Supervisor-Dead-Letter-Msg-Id"] == "order-7"
    # The original is TERMed: gone from the work queue, never redelivered.
    wait_until(lambda: nats_server.stream_msgs() == 0, what="the original terminated")
    status = wait_until(lambda: (s := sup.status())["advisories"]["terminated"] == 1 and s,
                        what="the MSG_TERMINATED advisory")
    assert (status["jobs"]["ack"], status["jobs"]["nak"], status["jobs"]["term"]) == (0, 0, 1)
    c = nats_server.consumer()
    assert c["num_redelivered"] == 0 and c["delivered"]["consumer_seq"] == 1 and c["num_ack_pending"] == 0
    assert [(r.seq, r.delivery) for r in sup.jobs.started()] == [(seq, 1)]
    assert sup.stop() == 0
