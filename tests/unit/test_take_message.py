"""A worker's first steps with a message (workers/runtime/worker.py make_job, parse_ack_reply):
the job and the pending count read from the reply subject once, in both of its forms, and the
job built without Job's own __init__ equal to one built with it."""

from __future__ import annotations

import dataclasses

import pytest

from workers import Job
from workers.runtime.worker import make_job, parse_ack_reply

V1 = "$JS.ACK.JOBS.workers.3.1042.977.1733381234567890123.15"
V2 = "$JS.ACK.hub.ACCHASH.JOBS.workers.3.1042.977.1733381234567890123.15.rnd"


def test_both_forms_of_the_reply_subject_give_stream_seqs_delivery_and_pending():
    assert parse_ack_reply(V1) == ("JOBS", 1042, 977, 3, 15)
    assert parse_ack_reply(V2) == ("JOBS", 1042, 977, 3, 15)


def test_the_job_is_the_one_jobs_own_constructor_makes():
    job, pending = make_job("jobs.new", V1, b"x", {"Nats-Msg-Id": "order-7", "X": "1"})
    assert pending == 15
    assert job == Job(data=b"x", subject="jobs.new", headers={"Nats-Msg-Id": "order-7", "X": "1"}, stream_seq=1042,
                      consumer_seq=977, delivery=3, msg_id="order-7", stream="JOBS")
    assert job.key == "order-7"
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.delivery = 1  # type: ignore[misc]
    bare, _ = make_job("jobs.a", V2, b"", None)
    assert bare == Job(data=b"", subject="jobs.a", headers={}, stream_seq=1042, consumer_seq=977, delivery=3,
                       msg_id=None, stream="JOBS")
    assert bare.key == "JOBS:1042"
