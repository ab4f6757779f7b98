"""[tracing] and log context in real workers against a real nats-server, the spans read by an
OTLP/HTTP receiver of our own (tests/support/otlp.py: the real exporter's real requests,
decoded with opentelemetry-proto): one CONSUMER span per delivery in its producer's trace, a
crash-redelivered job's span naming the death the parent recorded, every span of a recycled or
drained worker exported before it exits, and the handler's own log lines carrying the job."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys

import nats
import pytest
import tomli_w
from harness import child_env, publish, publish_now, wait_until
from natsauth import free_port
from otlp import Receiver

JSON_LOGS = ("--log-format", "json")
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
# No periodic export: what arrives from a worker that exits arrived because it flushed on its way out.
NO_PERIODIC_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "600000"}


@pytest.fixture
def receiver():
    r = Receiver().start()
    yield r
    r.stop()


def traced(supervisor_factory, nats_server, receiver, *, handler="tracehandlers:logs", env=None, **sections):
    workers = {"count": 1, "handler": handler, "retry_backoff": [0.1], **sections.pop("workers", {})}
    return supervisor_factory(nats_server, args=JSON_LOGS, env=env, workers=workers,
                              tracing={"enabled": True, "endpoint": receiver.endpoint}, **sections)


def publish_with_headers(url: str, data: str, headers: dict[str, str], subject: str = "jobs.new") -> int:
    async def run() -> int:
        nc = await nats.connect(url)
        try:
            return (await nc.jetstream().publish(subject, data.encode(), headers=headers)).seq
        finally:
            await nc.close()
    return asyncio.run(run())


def handler_lines(sup) -> list[dict]:
    return [r for r in (json.loads(line) for line in sup.log().splitlines() if line.startswith("{"))
            if r.get("logger") == "tracehandlers"]


@pytest.mark.parametrize("handler", ["tracehandlers:logs", "tracehandlers:logs_async"])
def test_a_job_published_with_a_traceparent_is_one_consumer_span_in_that_trace(nats_server, supervisor_factory,
                                                                                 receiver, handler):
    """A producer's W3C traceparent: the delivery's span is a CONSUMER child of it, with the
    messaging conventions and our attributes; the handler's own span is a child of the job's
    span (it was current in the handler's thread / task), and the handler's own log line
    carries the job and the trace id."""
    sup = traced(supervisor_factory, nats_server, receiver, handler=handler)
    sup.wait_ready(1)
    seq = publish_with_headers(nats_server.url, "0", {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01",
                                                      "Nats-Msg-Id": "order-17"})
    wait_until(lambda: len(sup.jobs.done()) == 1, what="the job done")
    sup.stop()                                  # the drain flushes the worker's spans
    spans = [s for s in receiver.all() if s.trace_id == TRACE_ID]
    [consumer] = [s for s in spans if s.kind == "CONSUMER"]
    assert consumer.name == "process jobs.new"
    assert consumer.parent_id == PARENT_ID
    assert consumer.attributes == {**consumer.attributes, "messaging.system": "nats",
                                   "messaging.destination.name": "jobs.new", "messaging.message.id": "order-17",
                                   "messaging.operation.type": "process", "jetstream.stream": "JOBS",
                                   "jetstream.stream_seq": seq, "jetstream.delivery": 1, "supervisor.worker": 0,
                                   "supervisor.outcome": "ack"}
    assert consumer.resource["service.name"] == "jetstream-supervisor"
    assert consumer.status == "UNSET" and not consumer.events
    [own] = [s for s in spans if s.name == "handler work"]
    assert own.parent_id == consumer.span_id
    [line] = handler_lines(sup)
    assert line == {**line, "job_seq": seq, "job_delivery": 1, "job_subject": "jobs.new", "worker": 0,
                    "trace_id": TRACE_ID}


def test_a_crash_redelivered_jobs_second_span_names_the_crash(nats_server, supervisor_factory, receiver, tmp_path):
    """`supervisor publish` starts the trace (a PRODUCER span, its traceparent on the job). The
    first delivery kills its worker (os._exit): that span dies with it. The parent NAKs the job
    at once; its second delivery's span carries a `worker crash` event naming the death the
    parent's ledger recorded (its id in /status, the worker, the pid, the cause)."""
    sup = traced(supervisor_factory, nats_server, receiver)
    sup.wait_ready(1)
    [pid] = sup.worker_pids()
    out = publish(nats_server.url, count=1, data="crash-once", tmp=tmp_path,
                  extra=("--config", str(sup.config_path)))
    wait_until(lambda: any(r.delivery == 2 for r in sup.jobs.done()), what="the job done on its second delivery")
    sup.wait_event("worker_died", worker_pid=pid)
    [death] = sup.status()["crosscheck"]["recent_deaths"]
    sup.stop()
    [producer] = [s for s in receiver.all() if s.kind == "PRODUCER"]
    assert producer.name == "send jobs.new" and producer.trace_id in out
    [consumer] = [s for s in receiver.consumer_spans() if s.trace_id == producer.trace_id]
    assert consumer.parent_id == producer.span_id
    assert consumer.attributes["jetstream.delivery"] == 2 and consumer.attributes["supervisor.outcome"] == "ack"
    assert consumer.attributes["supervisor.redelivered_after"] == "crash"
    [event] = consumer.events
    assert event.name == "worker crash"
    assert event.attributes == {**event.attributes, "supervisor.crash.death": death["id"],
                                "supervisor.crash.worker": 0, "supervisor.crash.pid": pid,
                                "supervisor.crash.delivery": 1, "supervisor.crash.cause": death["cause"]}


def test_a_delayed_job_keeps_its_producers_trace(nats_server, supervisor_factory, receiver, tmp_path):
    """`publish --delay` (a message schedule the server fires later) with tracing on: the
    traceparent rides on the schedule, and the job the server fires is still a child of the
    PRODUCER span (the server copies the schedule's own headers onto the job it stores)."""
    sup = traced(supervisor_factory, nats_server, receiver)
    sup.wait_ready(1)
    out = publish(nats_server.url, count=1, data="0", tmp=tmp_path,
                  extra=("--config", str(sup.config_path), "--delay", "0.5"))
    wait_until(lambda: len(sup.jobs.done()) == 1, what="the delayed job done")
    sup.stop()
    [producer] = [s for s in receiver.all() if s.kind == "PRODUCER"]
    assert producer.trace_id in out
    [consumer] = receiver.consumer_spans()
    assert (consumer.trace_id, consumer.parent_id) == (producer.trace_id, producer.span_id)
    assert consumer.attributes["supervisor.outcome"] == "ack"


def test_otel_exporter_otlp_endpoint_wins_over_the_configured_endpoint(nats_server, supervisor_factory, receiver):
    """[tracing] endpoint names a port nobody listens on; OTEL_EXPORTER_OTLP_ENDPOINT in the
    supervisor's environment names the receiver: the worker's span arrives there."""
    sup = supervisor_factory(nats_server, args=JSON_LOGS, env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint},
                             workers={"count": 1, "handler": "tracehandlers:logs"},
                             tracing={"enabled": True, "endpoint": f"http://127.0.0.1:{free_port()}"})
    sup.wait_ready(1)
    [seq] = publish_now(nats_server.url, count=1)
    wait_until(lambda: len(sup.jobs.done()) == 1, what="the job done")
    sup.stop()
    [span] = receiver.consumer_spans()
    assert span.attributes["jetstream.stream_seq"] == seq


def test_the_console_exporter_prints_each_span(nats_server, supervisor_factory):
    """exporter = "console": the worker prints its spans (the SDK's JSON) to its stdout, which
    the supervisor's own stdout is; no collector needed."""
    sup = supervisor_factory(nats_server, workers={"count": 1, "handler": "tracehandlers:logs"},
                             tracing={"enabled": True, "exporter": "console"})
    sup.wait_ready(1)
    [seq] = publish_now(nats_server.url, count=1)
    wait_until(lambda: len(sup.jobs.done()) == 1, what="the job done")
    sup.stop()
    out = sup.log()
    assert '"name": "process jobs.new"' in out and '"kind": "SpanKind.CONSUMER"' in out
    assert f'"jetstream.stream_seq": {seq}' in out


def test_sighup_turns_tracing_on_in_the_replacement_workers(nats_server, supervisor_factory, receiver):
    """tracing.enabled reloads by replacing workers: the parent imports the SDK then (before the
    replacements fork), and the new workers' spans arrive; the old ones made none."""
    sup = supervisor_factory(nats_server, workers={"count": 1, "handler": "tracehandlers:logs"},
                             tracing={"enabled": False, "endpoint": receiver.endpoint})
    sup.wait_ready(1)
    [before] = publish_now(nats_server.url, count=1)
    wait_until(lambda: len(sup.jobs.done()) == 1, what="the first job done")
    old = sup.worker_pids()
    sup.config["tracing"]["enabled"] = True
    sup.config_path.write_text(tomli_w.dumps(sup.config))
    sup.signal(signal.SIGHUP)
    wait_until(lambda: not (sup.worker_pids() & old) and sup.wait_ready(1), what="the worker replaced")
    [after] = publish_now(nats_server.url, count=1)
    wait_until(lambda: len(sup.jobs.done()) == 2, what="the second job done")
    assert sup.stop() == 0
    assert [s.attributes["jetstream.stream_seq"] for s in receiver.consumer_spans()] == [after]
    assert after != before


def test_every_span_of_a_recycled_or_drained_worker_arrives(nats_server, supervisor_factory, receiver):
    """Workers recycled after 4 jobs, a 10 ms job each, concurrency 2; the batch processor never
    exports on its timer here (OTEL_BSP_SCHEDULE_DELAY: 10 minutes), so every span that arrives
    was flushed by its worker on its way out: by recycling, and the last one by the drain."""
    sup = traced(supervisor_factory, nats_server, receiver, env=NO_PERIODIC_EXPORT,
                 workers={"max_jobs": 4, "concurrency": 2})
    sup.wait_ready(1)
    jobs = 14
    publish(nats_server.url, count=jobs, data="0.01")
    wait_until(lambda: len(sup.jobs.done_seqs()) == jobs, what="every job done")
    ran = {r.pid for r in sup.jobs.done()}
    assert len(ran) >= 3                         # recycled at least twice
    assert sup.stop() == 0
    spans = receiver.consumer_spans()
    acked = {s.attributes["jetstream.stream_seq"] for s in spans if s.attributes["supervisor.outcome"] == "ack"}
    assert acked == sup.jobs.done_seqs()
    assert {s.resource["process.pid"] for s in spans} == ran
    assert len(spans) == len(sup.jobs.started())     # one span per delivery, none lost, none twice


def test_a_retired_workers_spans_arrive_when_it_exits(nats_server, supervisor_factory, receiver):
    """Scale down (SIGTTOU) retires a worker: with the batch timer off, its spans can only have
    come from its own flush on the way out, and they are there before the supervisor stops."""
    sup = traced(supervisor_factory, nats_server, receiver, env=NO_PERIODIC_EXPORT,
                 workers={"count": 2, "batch": 1})
    sup.wait_ready(2)
    publish(nats_server.url, count=20, data="0.05")
    wait_until(lambda: len(sup.jobs.done_seqs()) == 20, what="every job done")
    both = sup.worker_pids()
    sup.signal(signal.SIGTTOU)
    wait_until(lambda: len(sup.worker_pids()) == 1, what="a worker retired")
    [retired] = both - sup.worker_pids()
    ran = {r.seq for r in sup.jobs.done() if r.pid == retired}
    assert ran, "the retired worker ran jobs"
    wait_until(lambda: {s.attributes["jetstream.stream_seq"] for s in receiver.consumer_spans()
                        if s.resource.get("process.pid") == retired} == ran, what="the retired worker's spans")
    assert sup.stop() == 0


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_the_handlers_own_log_line_carries_its_job_without_tracing(nats_server, supervisor_factory, fmt):
    """Log context needs no tracing: the handler's `logging` call, in its handler thread, carries
    job_seq, job_delivery, job_subject and worker (JSON) or `[w0 seq=N #D]` (text); a record
    logged outside a job (the worker's start) carries none, and there is no trace_id."""
    sup = supervisor_factory(nats_server, args=("--log-format", fmt),
                             workers={"count": 1, "handler": "tracehandlers:logs", "retry_backoff": [0.1]})
    sup.wait_ready(1)
    seq = publish_with_headers(nats_server.url, "fail-once", {})
    wait_until(lambda: len(sup.jobs.done()) == 1, what="the job done on its second delivery")
    sup.stop()
    if fmt == "text":
        lines = [line for line in sup.log().splitlines() if " tracehandlers: " in line]
        assert [re.search(r"tracehandlers: (\[.*?\]) handling fail-once$", line).group(1) for line in lines] == \
            [f"[w0 seq={seq} #1]", f"[w0 seq={seq} #2]"]
        assert not [line for line in sup.log().splitlines() if "[w0 seq=" in line and " tracehandlers: " not in line]
        return
    lines = handler_lines(sup)
    assert [(r["job_seq"], r["job_delivery"], r["job_subject"], r["worker"]) for r in lines] == \
        [(seq, 1, "jobs.new", 0), (seq, 2, "jobs.new", 0)]
    assert not any("trace_id" in r for r in lines)
    others = [json.loads(line) for line in sup.log().splitlines() if line.startswith("{")]
    assert [r for r in others if r.get("logger") == "worker"] and \
        not [r for r in others if r.get("logger") != "tracehandlers" and "job_seq" in r]


# Runs `python -m supervisor ...` with the named modules made unimportable first: a None in
# sys.modules is how Python itself marks a module missing (its import raises ModuleNotFoundError,
# as a package that is not installed does), so the check sees the extra absent whatever this
# environment holds, and a module-level otel import anywhere on the way would be a traceback.
HIDE_THEN_RUN = ("import runpy, sys\n"
                 "for name in filter(None, sys.argv.pop(1).split(',')):\n"
                 "    sys.modules[name] = None\n"
                 "runpy.run_module('supervisor', run_name='__main__', alter_sys=True)\n")


@pytest.mark.parametrize("hidden, named", [("opentelemetry", "opentelemetry-sdk"),
                                           ("opentelemetry.exporter", "opentelemetry-exporter-otlp-proto-http")])
def test_tracing_without_the_otel_extra_is_a_config_error_naming_it(tmp_path, hidden, named):
    """With the otel packages (or only the exporter's) unimportable in the subprocess,
    `[tracing] enabled = true` is exit 2 naming the extra and the missing package, no traceback;
    the same config with nothing hidden checks fine (the extra is installed here: `.[test]`)."""
    config = tmp_path / "config.toml"
    config.write_text('[workers]\nhandler = "testhandlers:record"\n[tracing]\nenabled = true\n')

    def check(hide: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", HIDE_THEN_RUN, hide, "config", "check", "--config", str(config)],
                              capture_output=True, text=True, env=child_env(), cwd=tmp_path, timeout=60)

    ok = check("")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    r = check(hidden)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "tracing.enabled" in r.stderr and "otel extra" in r.stderr and named in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_drain_naks_what_has_not_started_and_its_spans_say_so(nats_server, supervisor_factory, receiver):
    """A sync handler, tracing on: a job the threads had not taken when SIGTERM came was NAKed
    (its [tracing] after_job heard of it on the loop); its span says retry, the running one ack."""
    sup = traced(supervisor_factory, nats_server, receiver, env=NO_PERIODIC_EXPORT,
                 workers={"batch": 4})
    sup.wait_ready(1)
    publish(nats_server.url, count=3, data="1.0")
    wait_until(lambda: sup.jobs.running(), what="the first job running")
    sup.signal(signal.SIGTERM)
    assert sup.wait() == 0
    outcomes = sorted(s.attributes["supervisor.outcome"] for s in receiver.consumer_spans())
    assert outcomes.count("ack") == len(sup.jobs.done()) >= 1
    assert len(outcomes) == len(sup.jobs.done()) + outcomes.count("retry")


def test_a_duplicate_the_guard_acks_unrun_has_its_span_too(nats_server, supervisor_factory, receiver):
    """[tracing] is outside the [idempotency] guard, both on the worker's loop for a sync handler
    (concurrency 3): a copy re-published after the duplicate window is acked unrun by the guard,
    and its delivery still has a span, outcome "duplicate", in the copy's own trace."""
    sup = traced(supervisor_factory, nats_server, receiver, env=NO_PERIODIC_EXPORT, workers={"concurrency": 3},
                 stream={"duplicate_window": 1.0}, idempotency={"enabled": True})
    sup.wait_ready(1)
    parent = f"00-{TRACE_ID}-{PARENT_ID}-01"
    original = publish_with_headers(nats_server.url, "0", {"traceparent": parent, "Nats-Msg-Id": "D"})
    wait_until(lambda: len(sup.jobs.done()) == 1, what="the job done")

    def copy() -> int | None:
        seq = publish_with_headers(nats_server.url, "0", {"traceparent": parent, "Nats-Msg-Id": "D"})
        return seq if seq != original else None
    copied = wait_until(copy, what="the copy stored once the window passed", interval=0.1)
    wait_until(lambda: sup.status()["jobs"]["duplicate"] == 1, what="the copy acked as a duplicate")
    assert sup.stop() == 0
    outcomes = {s.attributes["jetstream.stream_seq"]: s.attributes["supervisor.outcome"]
                for s in receiver.consumer_spans() if s.trace_id == TRACE_ID}
    assert outcomes == {original: "ack", copied: "duplicate"}
    assert len(sup.jobs.done()) == 1
