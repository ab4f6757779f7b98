"""9. [tracing]'s cost (issue 29): the same no-op drain with tracing off and on, sync and async
handlers, in the same run, each variant in turn per repeat (rotated). On: a span per delivery
through the SDK's batch processor and the OTLP/HTTP exporter, to a receiver in this process
that decodes every export request (as a collector would) and counts the spans, so a run also
says whether every span arrived (the workers flush on their way out when the drain stops them).
"""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..scenarios import Ctx, cost_row, fmt, measured_drain, median, rotated

VARIANTS = {"sync, off": ("supervisor-sync", False), "sync, on": ("supervisor-sync", True),
            "async, off": ("supervisor", False), "async, on": ("supervisor", True)}
SPANS_WAIT = 20.0            # seconds the spans of a drained run may take to arrive after it


class SpanSink:
    """POST /v1/traces: decode the ExportTraceServiceRequest, count its spans, answer 200."""

    def __init__(self) -> None:
        self.spans = 0
        self.lock = threading.Lock()
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:          # noqa: N802 (http.server's name)
                request = ExportTraceServiceRequest()
                request.ParseFromString(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                n = sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                with sink.lock:
                    sink.spans += n
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, name="span-sink", daemon=True).start()

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def spans_after(sink: SpanSink, before: int, wanted: int) -> int:
    deadline = time.monotonic() + SPANS_WAIT
    while sink.spans - before < wanted and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return sink.spans - before


async def tracing_cost(ctx: Ctx) -> dict:
    p = ctx.profile
    try:
        sink = SpanSink()
    except ImportError:
        ctx.say("  tracing: skipped (the otel extra is not installed: pip install '.[otel]')")
        return {"skipped": "the otel extra is not installed", "runs": [], "summary": []}
    runs = []
    try:
        for rep in range(p.repeats):
            for name in rotated(list(VARIANTS), rep):
                contender, traced = VARIANTS[name]
                sections = {"tracing": {"enabled": True, "endpoint": sink.endpoint}} if traced else {}
                before = sink.spans
                r = await measured_drain(ctx, contender, p.tracing_workers, p.tracing_jobs, b"x", sections=sections)
                spans = await spans_after(sink, before, p.tracing_jobs) if traced else 0
                r.extra.update(repeat=rep, variant=name, spans=spans)
                runs.append(r.as_dict())
                ctx.say(f"  tracing rep {rep + 1} N={p.tracing_workers} {name:10s} {fmt(r.jobs_per_s, '.0f')} jobs/s, "
                        f"{fmt(r.cpu_ms_per_1k_jobs, '.0f')} CPU ms/1k jobs" + (f", {spans} spans" if traced else ""))
    finally:
        sink.close()
    return {"jobs": p.tracing_jobs, "workers": p.tracing_workers, "runs": runs,
            "summary": summarize_tracing(runs, p.tracing_workers)}


def summarize_tracing(runs: list[dict], n: int) -> list[dict]:
    """Per variant, against tracing off (same handler kind, same repeat: cost_row); spans received."""
    rows = []
    for name in VARIANTS:
        row = cost_row(runs, name, name.split(",")[0] + ", off", n, "vs_off")
        row["spans_per_job"] = median([r["extra"]["spans"] / r["jobs"] for r in row.pop("runs") if r["jobs"]])
        rows.append(row)
    return rows


def resummarize(results: dict) -> None:
    if results.get("tracing", {}).get("runs"):
        results["tracing"]["summary"] = summarize_tracing(results["tracing"]["runs"], results["tracing"]["workers"])
