"""[tracing] by itself (workers/middleware/tracing.py), its spans kept in memory by the SDK's own
InMemorySpanExporter: what each outcome makes of a span, the producer's traceparent whatever the
header's case, the crash board's death as an event, spans still open at exit ended as
abandoned, and the parent importing the exporter before it forks (no worker pays for it)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from supervisor.config import Config
from workers import Context, Job, Reject, Retry
from workers.middleware import tracing
from workers.middleware.chain import HookFailed
from workers.protocol.crashes import Crash, CrashBoard

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def traced(monkeypatch):
    """A Tracing set up as a worker would (slot 2), its spans kept in memory, exported at once."""
    memory = InMemorySpanExporter()
    monkeypatch.setattr(tracing, "BatchSpanProcessor", SimpleSpanProcessor)
    monkeypatch.setattr(tracing, "exporter", lambda tcfg: memory)
    board = CrashBoard(capacity=16)
    mw = tracing.Tracing(board)
    mw.setup(Context(2, 1234, None, None, Config(), False))   # type: ignore[arg-type]  # no loop, no NATS here
    return mw, memory, board


def run(mw, job: Job, outcome: str, error: BaseException | None = None):
    asyncio.run(mw.before_job(job))
    asyncio.run(mw.after_job(job, outcome, error))


@pytest.mark.parametrize("header", ["traceparent", "Traceparent", "TRACEPARENT"])
def test_the_span_is_a_consumer_child_of_the_producers_traceparent(traced, header):
    mw, memory, _ = traced
    run(mw, Job(b"x", "jobs.new", headers={header: TRACEPARENT}, stream_seq=9, stream="JOBS"), "ack")
    [span] = memory.get_finished_spans()
    assert span.name == "process jobs.new" and span.kind.name == "CONSUMER"
    assert format(span.context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert format(span.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert span.attributes["messaging.message.id"] == "JOBS:9" and span.attributes["supervisor.worker"] == 2
    assert span.attributes["supervisor.outcome"] == "ack" and span.status.status_code.name == "UNSET"


def test_a_job_without_a_traceparent_is_a_root_of_its_own_trace(traced):
    mw, memory, _ = traced
    run(mw, Job(b"x", "jobs.a", stream_seq=1), "ack")
    run(mw, Job(b"x", "jobs.b", stream_seq=2), "ack")
    a, b = memory.get_finished_spans()
    assert a.parent is None and b.parent is None and a.context.trace_id != b.context.trace_id


def test_what_each_outcome_makes_of_the_span(traced):
    mw, memory, _ = traced
    boom = ValueError("boom")
    run(mw, Job(b"", "j", stream_seq=1), "retry", Retry(2.5))
    run(mw, Job(b"", "j", stream_seq=2), "reject", Reject("bad payload"))
    run(mw, Job(b"", "j", stream_seq=3), "fail", boom)
    run(mw, Job(b"", "j", stream_seq=4), "fail", HookFailed("Audit.before_job", KeyError("k")))
    retry, reject, fail, hook = memory.get_finished_spans()
    assert retry.attributes["supervisor.retry_delay_s"] == 2.5 and retry.status.status_code.name == "UNSET"
    assert reject.status.status_code.name == "ERROR" and reject.status.description == "rejected: bad payload"
    assert fail.status.status_code.name == "ERROR" and fail.attributes["error.type"] == "ValueError"
    assert [e.name for e in fail.events] == ["exception"]
    assert hook.attributes["error.type"] == "KeyError"       # what the hook raised, not the wrapper


def test_a_redelivery_names_the_death_on_the_board_and_a_first_delivery_does_not(traced):
    mw, memory, board = traced
    board.post(Crash(5, 1, 7, 0, 4321, 1.5, "killed by SIGKILL"))
    run(mw, Job(b"", "j", stream_seq=5, delivery=2), "ack")
    run(mw, Job(b"", "j", stream_seq=6, delivery=2), "ack")          # redelivered, but no death held it
    board.post(Crash(8, 3, 8, 1, 4322, 2.5, "exit code 13"))
    run(mw, Job(b"", "j", stream_seq=8, delivery=3), "ack")          # the death held this very delivery
    run(mw, Job(b"", "j", stream_seq=5, delivery=3), "ack")          # came back after delivery 2: a retry
    named, other, same, later = memory.get_finished_spans()
    [event] = named.events
    assert event.name == "worker crash" and named.attributes["supervisor.redelivered_after"] == "crash"
    assert dict(event.attributes) == {"supervisor.crash.death": 7, "supervisor.crash.worker": 0,
                                      "supervisor.crash.pid": 4321, "supervisor.crash.cause": "killed by SIGKILL",
                                      "supervisor.crash.delivery": 1, "supervisor.crash.time_unix": 1.5}
    assert not other.events and not same.events and not later.events


def test_spans_still_open_when_the_worker_exits_end_as_abandoned(traced):
    mw, memory, _ = traced
    asyncio.run(mw.before_job(Job(b"", "j", stream_seq=1)))         # graceful_timeout ran out: no after_job
    asyncio.run(mw.close())
    [span] = memory.get_finished_spans()
    assert span.attributes["supervisor.outcome"] == "abandoned" and span.status.status_code.name == "ERROR"


def test_the_parent_imports_the_exporter_before_it_forks_and_starts_nothing():
    """A worker's start must fit in heartbeat_timeout; the exporter's imports (requests, protobuf)
    took longer than 2.4 s with 8 workers starting on a loaded box (chaos seed 0). The parent
    imports them with the middleware (load_middleware), and no thread starts."""
    code = ("import sys, threading\n"
            "from supervisor.config import Config\n"
            "from supervisor.parent.supervisor import load_middleware\n"
            "name = 'opentelemetry.exporter.otlp.proto.http.trace_exporter'\n"
            "load_middleware(Config(), print)\n"
            "before = name in sys.modules\n"
            "load_middleware(Config().replace(tracing={'enabled': True}), print)\n"
            "print(before, name in sys.modules, threading.active_count())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "True", "1"], out.stderr
