"""[tracing]: one OpenTelemetry CONSUMER span per delivery, in its producer's trace.

The span is `process <subject>`, a child of the W3C `traceparent` header the job was published
with (a root when it has none), with the messaging conventions (messaging.system = "nats",
messaging.destination.name, messaging.message.id, messaging.operation.type = "process",
messaging.consumer.group.name: the durable) and ours: jetstream.stream, jetstream.stream_seq,
jetstream.delivery, supervisor.worker, supervisor.outcome ("ack", "retry", "reject", "fail",
"duplicate", or "abandoned": still running when the worker exited). A failure records its
exception and sets the span's status to ERROR; so does a Reject.

Where it sits: the outermost built-in (outside workers.middleware and the [idempotency] guard),
so a delivery the guard acks unrun or a hook retries gets its span too, with the outcome the
whole chain settled on. Its hooks are `async def` with no around: for a sync handler they run on
the worker's loop (Chain.enter / leave) beside the guard's, no thread waits for them. The span
is made current in the job's own context by the innermost built-in (joblog.py: `current`), so
the handler's own spans are its children and its log records carry the trace_id.

A redelivery after a crash names the crash: the parent put the death on the crash board before
its NAK brought the job back (workers/protocol/crashes.py), and the span gets a `worker crash`
event (the death's id in /status, the worker, pid, cause, the delivery it held) and the
attribute supervisor.redelivered_after = "crash". Not a link: the crashed delivery's span died
with its worker, unexported, so a link would point at a span no collector has.

Exporters start after fork: the provider and its batch processor (a thread) are made in
`setup`, in the worker; the parent never makes one (its fork would copy a processor's queue and
lock into every child). A worker that exits by recycling, retiring or draining flushes what it
holds in `close`, after its last ack (bounded by FLUSH_TIMEOUT: an unreachable collector must
not hold a drain past the parent's patience). A worker that crashes loses the spans its batch still held: at most the
schedule delay's worth (OTEL_BSP_SCHEDULE_DELAY, 5 s by default).

This module imports the OpenTelemetry SDK: it is loaded only with [tracing] enabled (builtin.py,
and `supervisor publish`), and config loading checks the otel extra is installed first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from supervisor.config import Config
from supervisor.config.keys import TracingConfig
from workers import Job, Reject, Retry
from workers.middleware.base import Context, Middleware
from workers.protocol.crashes import CrashBoard

log = logging.getLogger("worker")

# Seconds a worker's exit waits for its last spans to be exported: a live collector takes
# milliseconds; a dead one would hold the exit for the exporter's own 10 s of retries, past the
# parent's DRAIN_MARGIN (5 s after graceful_timeout, shared with the fence of the last acks).
FLUSH_TIMEOUT = 2.0
TRACER = "jetstream-supervisor"


class HeaderGetter(Getter[Mapping[str, str]]):
    """NATS header names are case-sensitive; W3C's are lowercase, but a producer may send `Traceparent`."""

    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            value = next((v for k, v in carrier.items() if k.lower() == key), None)
        return None if value is None else [value]

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return list(carrier)


HEADERS = HeaderGetter()


def preload() -> None:
    """In the parent, before any fork: import the exporter (it brings requests and protobuf), so
    a worker's start does not pay for it. Over a second on a loaded 2-core box with a few
    workers starting at once, and a worker's start must fit in workers.heartbeat_timeout (chaos
    seed 0: every worker killed before ready at 2.4 s). An import starts no thread and no
    exporter (checked: no thread, no at-fork hook of the SDK's)."""
    from opentelemetry.exporter.otlp.proto.http import trace_exporter  # noqa: F401


def exporter(tcfg: TracingConfig) -> SpanExporter:
    if tcfg.exporter == "console":
        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # preloaded by the parent
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return OTLPSpanExporter()         # it reads them itself (a base URL gets /v1/traces)
    return OTLPSpanExporter(endpoint=tcfg.endpoint.rstrip("/") + "/v1/traces")


def make_provider(tcfg: TracingConfig, **resource: Any) -> TracerProvider:
    """A provider with a batch processor (its export thread starts now: call it after fork),
    made the process's global one unless something (a workers.init hook) set one already."""
    provider = TracerProvider(resource=Resource.create({"service.name": tcfg.service_name, **resource}))
    provider.add_span_processor(BatchSpanProcessor(exporter(tcfg)))
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        trace.set_tracer_provider(provider)
    return provider


def trace_id_of(span: Any) -> str:
    return format(span.get_span_context().trace_id, "032x")


def shut_down(provider: TracerProvider, timeout: float) -> bool:
    """Export what the provider's batch holds and stop it, waiting `timeout` at most (the SDK's
    own shutdown waits 30 s, and its force_flush ignores its timeout); False if it did not end."""
    done = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
    done.start()
    done.join(timeout)
    return not done.is_alive()


@contextlib.contextmanager
def producer_span(tcfg: TracingConfig, subject: str, count: int) -> Iterator[tuple[dict[str, str], str]]:
    """`supervisor publish` with [tracing] on: one PRODUCER span `send <subject>` over the whole
    command, its traceparent on every job (their CONSUMER spans are its children), exported
    before the command exits. Yields the headers to add and the trace id."""
    provider = make_provider(tcfg, **{"process.pid": os.getpid()})
    tracer = provider.get_tracer(TRACER)
    try:
        with tracer.start_as_current_span(f"send {subject}", kind=SpanKind.PRODUCER, attributes={
                "messaging.system": "nats", "messaging.destination.name": subject,
                "messaging.operation.type": "send", "messaging.operation.name": "send",
                "messaging.batch.message_count": count}) as span:
            headers: dict[str, str] = {}
            propagate.inject(headers)
            yield headers, trace_id_of(span)
    finally:
        if not shut_down(provider, FLUSH_TIMEOUT):
            log.warning("tracing: the publish span was not exported within %gs", FLUSH_TIMEOUT)


class Tracing(Middleware):
    def __init__(self, crashes: CrashBoard | None = None):
        self.crashes = crashes
        self.spans: dict[int, Any] = {}          # id(job) -> its span, from before_job to after_job
        self.provider: TracerProvider | None = None
        self.tracer: Any = None
        self.static: dict[str, Any] = {}

    def setup(self, ctx: Context) -> None:
        cfg: Config = ctx.cfg
        self.provider = make_provider(cfg.tracing, **{"supervisor.worker": ctx.slot, "process.pid": ctx.pid})
        self.tracer = self.provider.get_tracer(TRACER)
        # Few attributes: each costs the SDK's checks and the exporter's encoding on every span.
        self.static = {"messaging.system": "nats", "messaging.operation.type": "process",
                       "messaging.consumer.group.name": cfg.consumer.name, "supervisor.worker": ctx.slot}

    async def before_job(self, job: Job) -> None:
        self.start(job)

    async def after_job(self, job: Job, outcome: str, error: BaseException | None) -> None:
        self.end(job, outcome, error)

    def start(self, job: Job) -> None:
        parent = propagate.extract(job.headers, getter=HEADERS) if job.headers else otel_context.Context()
        span = self.tracer.start_span(f"process {job.subject}", context=parent, kind=SpanKind.CONSUMER, attributes={
            **self.static, "messaging.destination.name": job.subject, "messaging.message.id": job.key,
            "jetstream.stream": job.stream, "jetstream.stream_seq": job.stream_seq, "jetstream.delivery": job.delivery})
        if job.delivery > 1 and self.crashes is not None:
            crash = self.crashes.lookup(job.stream_seq)
            if crash is not None and crash.delivery == job.delivery - 1:    # not a later retry's delivery
                span.set_attribute("supervisor.redelivered_after", "crash")
                span.add_event("worker crash", {
                    "supervisor.crash.death": crash.death, "supervisor.crash.worker": crash.slot,
                    "supervisor.crash.pid": crash.pid, "supervisor.crash.cause": crash.cause,
                    "supervisor.crash.delivery": crash.delivery, "supervisor.crash.time_unix": crash.at})
        self.spans[id(job)] = span

    def end(self, job: Job, outcome: str, error: BaseException | None) -> None:
        span = self.spans.pop(id(job), None)
        if span is None:
            return
        span.set_attribute("supervisor.outcome", outcome)
        if isinstance(error, Retry):
            span.set_attribute("supervisor.retry_delay_s", error.delay)
        elif isinstance(error, Reject):
            span.set_status(Status(StatusCode.ERROR, f"rejected: {error.reason}"))
        elif outcome == "fail" and error is not None:
            cause = getattr(error, "error", error)       # a middleware's HookFailed: what its hook raised
            span.record_exception(cause)
            span.set_attribute("error.type", type(cause).__name__)
            span.set_status(Status(StatusCode.ERROR, f"{error}"[:200]))
        span.end()

    # -- for the innermost built-in (joblog.py), in the job's own thread or task

    def current(self, job: Job) -> tuple[str, Any]:
        """Make the job's span the current one here: (its trace id, the token to `release`)."""
        span = self.spans.get(id(job))
        if span is None:
            return "", None
        return trace_id_of(span), otel_context.attach(trace.set_span_in_context(span))

    def release(self, token: Any) -> None:
        otel_context.detach(token)

    # -- once, when the worker exits

    async def close(self) -> None:
        for span in self.spans.values():       # past graceful_timeout: NAKed, its outcome never came
            span.set_attribute("supervisor.outcome", "abandoned")
            span.set_status(Status(StatusCode.ERROR, "still running when the worker exited; NAKed"))
            span.end()
        self.spans.clear()
        if self.provider is None:
            return
        if not await asyncio.to_thread(shut_down, self.provider, FLUSH_TIMEOUT):     # the loop stays free meanwhile
            log.warning("tracing: the last spans were not exported within %gs; exiting without them", FLUSH_TIMEOUT,
                        extra={"event": "spans_not_flushed"})
