"""The supervisor's HTTP endpoint (monitor.http), on the parent's loop: no threads.

    GET /         the dashboard: one self-contained page (dashboard.html) drawing /status and /history
    GET /healthz  200 ok | 503 <reason>
    GET /status   JSON (docs/CONTRACT.md)
    GET /history  JSON: the last monitor.lag_window of ConsumerInfo samples and crash moments
                  (?pool=NAME: that pool's; the first pool's without)
    GET /metrics  Prometheus text
    POST /scale?workers=N[&pool=NAME]   loopback clients only; with several pools, pool= is needed

A deliberately small HTTP/1.0-style server: one request per connection, bounded reads, a
timeout; anything malformed gets a 4xx and the connection is closed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from importlib import resources
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from supervisor.observe import metrics
from supervisor.observe.snapshot import Snapshot
from supervisor.observe.status import build_status, health

log = logging.getLogger("supervisor.http")

MAX_HEAD = 16 * 1024
READ_TIMEOUT = 5.0
MAX_WORKERS = 1024
# The dashboard may talk to this server and nothing else: the browser enforces it.
PAGE_HEADERS = ("Content-Security-Policy: default-src 'none'; connect-src 'self'; script-src 'unsafe-inline'; "
                "style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'; "
                "frame-ancestors 'none'\r\nX-Content-Type-Options: nosniff\r\n")
REASONS = {200: "OK", 202: "Accepted", 400: "Bad Request", 403: "Forbidden", 404: "Not Found",
           405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict", 413: "Payload Too Large",
           500: "Internal Server Error", 503: "Service Unavailable"}
STOPPING = "supervisor is stopping"         # the one refusal of a scale that is no client's error


class Commands(Protocol):
    """What the endpoint may ask of the supervisor: read its picture, its lag window, or ask it
    to scale. Everything else about the supervisor is out of the endpoint's reach."""

    def snapshot(self) -> Snapshot: ...

    def history(self, after: int, pool: str | None = None) -> dict[str, Any] | None:
        """/history's body (samples newer than `after`) of a pool, or None while not monitoring yet."""

    def pools(self) -> tuple[str, ...]:
        """The pools that run (config/pools.py; `default` without [pools.*])."""

    def scale(self, n: int, source: str, pool: str | None = None) -> str | None:
        """Ask for n workers in a pool (the loop applies it); None when accepted, else why not."""


class HttpServer:
    def __init__(self, commands: Commands, host: str, port: int):
        self.commands = commands
        self.host, self.port = host, port
        self.server: asyncio.AbstractServer | None = None
        self.page = resources.files("supervisor.observe").joinpath("dashboard.html").read_bytes()

    async def start(self) -> None:
        self.server = await asyncio.start_server(self.handle, self.host, self.port, limit=MAX_HEAD)
        self.port = self.server.sockets[0].getsockname()[1]        # monitor.http "HOST:0": the one it got
        log.info("status on http://%s:%d (/ /status /history /metrics /healthz)", self.host, self.port,
                 extra={"event": "http_listening", "url": f"http://{self.host}:{self.port}"})

    async def close(self) -> None:
        if self.server:
            self.server.close()
            await self.server.wait_closed()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, ctype, body = await self.respond(reader, writer)
        except Exception:
            log.exception("HTTP handler failed")
            status, ctype, body = 500, "text/plain", b"internal error\n"
        head = (f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\nCache-Control: no-store\r\n"
                f"{PAGE_HEADERS if ctype.startswith('text/html') else ''}\r\n")
        try:
            writer.write(head.encode() + body)
            await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def respond(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[int, str, bytes]:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
        except TimeoutError:
            return 408, "text/plain", b"request timeout\n"
        except asyncio.LimitOverrunError:
            return 413, "text/plain", b"request head too large\n"
        except asyncio.IncompleteReadError:
            return 400, "text/plain", b"incomplete request\n"
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, "text/plain", b"malformed request line\n"
        method, target = parts[0], urlsplit(parts[1])
        route = ROUTES.get(target.path)
        if route is None:
            return 404, "text/plain", b"not found: try / /status /history /metrics /healthz\n"
        allowed, fn = route
        if method not in allowed:
            return 405, "text/plain", f"use {' or '.join(allowed)}\n".encode()
        return fn(self, target.query, writer.get_extra_info("peername"))

    def get_status(self, query: str, peer: Any) -> tuple[int, str, bytes]:
        return 200, "application/json", json.dumps(build_status(self.commands.snapshot()), indent=1).encode() + b"\n"

    def get_dashboard(self, query: str, peer: Any) -> tuple[int, str, bytes]:
        return 200, "text/html; charset=utf-8", self.page

    def get_history(self, query: str, peer: Any) -> tuple[int, str, bytes]:
        """/history[?after=SEQ]: the samples of the window newer than SEQ (all without it)."""
        q = parse_qs(query)
        values = q.get("after", ["0"])
        if len(values) != 1 or not (values[0].isascii() and values[0].isdigit()):
            return 400, "text/plain", b"expected /history or /history?after=SEQ with SEQ a sample number >= 0\n"
        pool, bad = self.pool_of(q, required=False)
        if bad:
            return 400, "text/plain", bad
        body = self.commands.history(int(values[0]), pool)
        if body is None:
            return 503, "text/plain", b"not monitoring yet\n"
        return 200, "application/json", json.dumps(body, separators=(",", ":")).encode() + b"\n"

    def get_metrics(self, query: str, peer: Any) -> tuple[int, str, bytes]:
        return 200, "text/plain; version=0.0.4; charset=utf-8", metrics.render(self.commands.snapshot())

    def get_healthz(self, query: str, peer: Any) -> tuple[int, str, bytes]:
        ok, reason = health(self.commands.snapshot())
        return (200 if ok else 503), "text/plain", (reason + "\n").encode()

    def post_scale(self, query: str, peer: Any) -> tuple[int, str, bytes]:
        if not is_loopback(peer):
            return 403, "text/plain", b"/scale is accepted from loopback only\n"
        q = parse_qs(query)
        values = q.get("workers", [])
        if len(values) != 1 or not values[0].isdigit() or int(values[0]) > MAX_WORKERS:
            return 400, "text/plain", f"expected /scale?workers=N with 0 <= N <= {MAX_WORKERS}\n".encode()
        pool, bad = self.pool_of(q, required=True)
        if bad:
            return 400, "text/plain", bad
        refused = self.commands.scale(int(values[0]), source="POST /scale", pool=pool)
        if refused:
            return (503 if refused == STOPPING else 409), "text/plain", f"{refused}\n".encode()
        return 202, "application/json", json.dumps({"target": int(values[0]), **({"pool": pool} if pool else {})}
                                                   ).encode() + b"\n"

    def pool_of(self, q: dict[str, list[str]], required: bool) -> tuple[str | None, bytes]:
        """The `pool=NAME` of a request (None: none named), or why it will not do: a name that is
        not one of the pools, or none named (`required`) while several pools run."""
        pools, names = self.commands.pools(), q.get("pool", [])
        if len(names) > 1:
            return None, b"name one pool: pool=NAME once\n"
        if names and names[0] not in pools:
            return None, f"no pool {names[0]!r} runs here; pools: {', '.join(pools)}\n".encode()
        if not names and required and len(pools) > 1:
            return None, f"several pools run here ({', '.join(pools)}): add pool=NAME\n".encode()
        return (names[0] if names else None), b""


def is_loopback(peer: Any) -> bool:
    try:
        return ipaddress.ip_address(peer[0]).is_loopback
    except (TypeError, ValueError, IndexError):
        return False


ROUTES = {"/": (("GET",), HttpServer.get_dashboard), "/status": (("GET",), HttpServer.get_status),
          "/history": (("GET",), HttpServer.get_history), "/metrics": (("GET",), HttpServer.get_metrics),
          "/healthz": (("GET",), HttpServer.get_healthz), "/scale": (("POST",), HttpServer.post_scale)}
