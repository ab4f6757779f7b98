"""Everything this project relies on inside nats-py, in one place, checked against the pinned version.

`Client` is nats-py's client with these changes and two additions; `supervisor.nats.connect`
is the one place clients are made, so every connection of ours (parent, workers, one-shot
commands) gets them:

- `fence()`: returns once the server has read everything published before the call. nats-py's
  `flush()` writes its PING straight to the socket while `publish()` queues its bytes for the
  flusher task, so `publish(); flush()` can put `PING, PUB` on the wire and the PONG proves
  nothing about the PUB (docs/DESIGN.md). `fence()` makes the flusher write the queue first.
- `_process_pong`: a `flush()` that times out, or whose task is cancelled, leaves its future in
  the client's PONG queue. When that PING's PONG arrives, nats-py calls set_result() on the
  cancelled future, raises InvalidStateError inside the protocol parser, drops the rest of the
  chunk it was parsing (messages included), and every later flush() waits for the wrong PONG
  (seen here: a worker's connection drain hung for 10 s). Each PONG still answers exactly one
  PING, in order; we just never resolve a future twice. Cf. nats-io/nats.py#624.
- `flush()` never succeeds without a PONG. nats-py's falls back to a plain write, and returns at
  once, when its read or flusher task is done; a reconnect cancels both, and unconnected that
  write does nothing. So mid-reconnect `flush()`, and `fence()` with it, "proved" the server had
  read acks it never saw (a settle entry released on no evidence; a worker's liveness PING taken
  for an answer), and the settler spun re-sending a refused ack every 2 ms. Here it raises
  ConnectionReconnectingError instead, as a publish does when it cannot be taken. The same
  fallback runs while nats-py calls itself CONNECTED with its read task dead: `_read_loop` ends
  on any unexpected exception from the parser ("nats: encountered error"), and nothing reads
  the socket until the ping timer calls the link stale (PING_INTERVAL x 3, 15 s). No PONG can
  be read then, so ours raises StaleConnectionError and starts nats-py's own reconnect at once
  (what the ping timer would do later); the settler sends its acks again on the new link.
- `fence()` bounds both phases. nats-py's `_flush_pending` swallows the CancelledError of a
  timeout, so `asyncio.wait_for` around it returns normally at the deadline (Python 3.11), and
  the PING went out with 1 ms left, overtaking bytes still queued. Now the deadline raises
  FlushTimeoutError and no PING is written after it.

- Two additions for a worker's hot path, both through nats-py's own internals: `deliver_directly`
  hands a subscription's messages to a callback from the read loop (`_process_msg`, called by
  the parser for each MSG), not through the subscription's queue and its task; `publish_each`
  puts a batch of acks into the write buffer as one command (`_send_command`), with publish()'s
  checks made once (what each saves: docs/BENCHMARKS.md, issue 25).

The other private attributes we read (server INFO, the transport, the current server) are
wrapped below too, and tests/integration/test_natsfix.py checks each premise against the installed nats-py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from importlib.metadata import version
from typing import Any, NoReturn

import nats.errors
from nats.aio.client import Client as _NatsClient
from nats.aio.subscription import Subscription

from supervisor.errors import SupervisorError

log = logging.getLogger("supervisor.nats")

# A deliver_directly callback: (subject, reply, data, headers or None).
Delivery = Callable[[str, str, bytes, "dict[str, str] | None"], Awaitable[None]]

PINNED_NATS_PY = "2.16.0"      # pyproject pins it; the premises below were read in this version


class NatsPyVersionError(SupervisorError):
    """Exit 1: an installation problem, not a config one."""


@functools.cache
def check_version() -> None:
    """Refuse to run on a nats-py whose internals we have not checked."""
    installed = version("nats-py")
    if installed != PINNED_NATS_PY:
        raise NatsPyVersionError(f"nats-py {installed} is installed; this supervisor was checked against "
                                 f"{PINNED_NATS_PY} (pyproject pins it): reinstall with pip install .")


class Client(_NatsClient):
    def __init__(self) -> None:
        super().__init__()
        self._direct: dict[int, Delivery] = {}    # sid -> deliver_directly's callback

    def deliver_directly(self, sub: Subscription, callback: Delivery) -> None:
        """Hand each message of `sub` (subscribed without a callback) to `callback(subject, reply,
        data, headers)` from the read loop, as the parser meets it, in order: not through the
        subscription's queue and the task that empties it (nats-py's `cb=`), whose hand-over cost
        a worker as much per message as holding the job did, and with no Msg object made. The
        headers are parsed by nats-py (a status line too: "Status", "Description"), None when
        there are none. The callback must not wait long: nothing else is read meanwhile. An
        exception from it goes to the error callback, as one from `cb=` does."""
        self._direct[sub._id] = callback

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes,  # type: ignore[override]
                           headers: bytes) -> None:
        deliver = self._direct.get(sid)
        if deliver is None:
            return await super()._process_msg(sid, subject, reply, data, headers)
        if sid not in self._subs:        # unsubscribed: what the server sent before it heard is dropped
            return
        self.stats["in_msgs"] += 1       # type: ignore[operator]
        self.stats["in_bytes"] += len(data)  # type: ignore[operator]
        parsed = await self._process_headers(headers) if headers else None
        try:
            await deliver(subject.decode(), reply.decode(), data, parsed)
        except Exception as exc:
            await self._error_cb(exc)

    async def flush(self, timeout: float = 10.0) -> None:  # type: ignore[override]   # nats-py types it int
        """A PING and its PONG, or an error: never nats-py's no-op fallback (see above)."""
        if self.is_reconnecting:     # no PONG can come back on the old socket, and nats-py drops the PING's future
            raise nats.errors.ConnectionReconnectingError
        if self.is_connected and not self.tasks_alive():
            await self.reconnect_deaf()
        await super().flush(timeout)  # type: ignore[arg-type]

    def tasks_alive(self) -> bool:
        """The read and flusher tasks both run: what a PONG needs (nats-py falls back without it)."""
        return all(task is not None and not task.done() for task in (self._reading_task, self._flusher_task))

    async def reconnect_deaf(self) -> NoReturn:
        """CONNECTED, yet the read (or flusher) task has ended: nothing can prove anything on this
        link. Reconnect now, as nats-py's ping timer would in PING_INTERVAL x 3, and refuse."""
        log.warning("NATS connection no longer reads (its read or flusher task ended); reconnecting",
                    extra={"event": "nats_deaf"})
        await self._process_op_err(nats.errors.StaleConnectionError())
        raise nats.errors.StaleConnectionError

    async def publish_each(self, subjects: Sequence[str], payload: bytes) -> None:
        """`payload` published to each subject, all or none: one command in nats-py's write
        buffer for them all, with publish()'s checks made once (a worker acks a batch of jobs
        this way; per message, publish() cost more than the rest of an ack's path). The
        subjects are not validated: they are the server's own reply subjects."""
        if self.is_closed:
            raise nats.errors.ConnectionClosedError
        if self.is_draining_pubs:
            raise nats.errors.ConnectionDrainingError
        size = len(payload)
        tail = b" %d\r\n%s\r\n" % (size, payload)
        command = b"".join([b"PUB " + subject.encode() + tail for subject in subjects])
        if not self.is_connected and (self._max_pending_size <= 0
                                      or len(command) + self._pending_data_size > self._max_pending_size):
            raise nats.errors.OutboundBufferLimitError    # publish()'s refusal while it reconnects
        self.stats["out_msgs"] += len(subjects)
        self.stats["out_bytes"] += size * len(subjects)
        await self._send_command(command)
        if self._flush_queue is not None and self._flush_queue.empty():
            await self._flush_pending()

    async def fence(self, timeout: float = 5.0) -> None:
        """The server has read every command this client published before the call; `timeout`
        bounds the whole (a stopping worker's deadline counts on it)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        # The queued PUBs reach the socket first (bounded: nats-py's flush_timeout is None) ...
        pending = asyncio.ensure_future(self._flush_pending(force_flush=True))
        done, _ = await asyncio.wait({pending}, timeout=timeout)    # it swallows a cancel: never wait_for it
        if not done:
            pending.cancel()
            raise nats.errors.FlushTimeoutError
        pending.result()
        await self.flush(max(0.001, until - loop.time()))  # ... then PING, PONG

    async def _process_pong(self) -> None:
        if self._pongs:
            future = self._pongs.pop(0)
            if not future.done():
                future.set_result(True)
            self._pongs_received += 1
            self._pings_outstanding = 0


def server_info(nc: _NatsClient) -> dict[str, Any]:
    """The INFO the server sent at connect (tls_required, server_name, ...)."""
    return nc._server_info or {}


def current_server_uri(nc: _NatsClient) -> Any:
    """The parsed URL of the server the client is (re)connecting to, or None."""
    srv = getattr(nc, "_current_server", None)
    return getattr(srv, "uri", None) if srv is not None else None


def abandon(nc: _NatsClient) -> None:
    """Drop a client whose first connect failed: nats-py leaves its socket open then.

    Not `nc.close()`: after a failed TLS upgrade it awaits `wait_closed()` on a stream whose
    protocol asyncio's start_tls has replaced, which never completes. No task of the client
    runs yet at this point (they start after the first PONG), so closing the socket is all.
    """
    transport = nc._transport
    if transport:
        transport.close()
    nc._status = _NatsClient.CLOSED
