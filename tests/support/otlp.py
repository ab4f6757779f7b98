"""An OTLP/HTTP trace receiver of our own: what a collector would get from the workers.

A ThreadingHTTPServer on 127.0.0.1 (a port of its own) that takes POST /v1/traces, decodes the
protobuf ExportTraceServiceRequest with the opentelemetry-proto package the exporter brings,
and keeps every span as a plain `Span` (ids in hex, attributes as Python values, the resource's
attributes beside them). No collector binary, no mock: the real exporter in real workers sends
real requests here."""

from __future__ import annotations

import gzip
import threading
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

KINDS = {v: k.removeprefix("SPAN_KIND_") for k, v in PbSpan.SpanKind.items()}


@dataclass(frozen=True)
class Event:
    name: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class Span:
    name: str
    kind: str                       # CONSUMER, PRODUCER, INTERNAL, ...
    trace_id: str                   # 32 hex digits
    span_id: str                    # 16
    parent_id: str                  # "" for a root
    attributes: dict[str, Any]
    resource: dict[str, Any]
    events: tuple[Event, ...] = ()
    links: tuple[tuple[str, str], ...] = ()      # (trace id, span id)
    status: str = "UNSET"           # UNSET | OK | ERROR
    status_message: str = ""


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in kvs}


def decode(body: bytes) -> list[Span]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for rs in request.resource_spans:
        resource = attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(Span(s.name, KINDS.get(s.kind, str(s.kind)), s.trace_id.hex(), s.span_id.hex(),
                                s.parent_span_id.hex(), attrs(s.attributes), resource,
                                tuple(Event(e.name, attrs(e.attributes)) for e in s.events),
                                tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
                                ("UNSET", "OK", "ERROR")[s.status.code], s.status.message))
    return out


@dataclass
class Receiver:
    spans: list[Span] = field(default_factory=list)
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        """The base URL ([tracing] endpoint, OTEL_EXPORTER_OTLP_ENDPOINT): /v1/traces is added."""
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:          # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                spans = decode(body)
                with receiver.lock:
                    receiver.spans.extend(spans)
                    receiver.requests += 1
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def all(self) -> list[Span]:
        with self.lock:
            return list(self.spans)

    def consumer_spans(self) -> list[Span]:
        return [s for s in self.all() if s.kind == "CONSUMER"]
