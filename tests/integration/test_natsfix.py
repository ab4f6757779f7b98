"""The premises supervisor/nats/fix.py rests on, checked against the installed nats-py and a real
nats-server: if an upgrade breaks one, this file says which, before the supervisor misbehaves."""

from __future__ import annotations

import asyncio

import pytest
from harness import NatsServer
from nats.aio.client import Client as NatsClient

from supervisor.nats import fix as natsfix
from supervisor.nats.fix import Client


def test_pinned_version_is_installed():
    natsfix.check_version()


@pytest.mark.parametrize("name", ["_flush_pending", "_process_pong", "_send_ping", "_process_msg", "_process_headers",
                                  "_send_command"])
def test_private_methods_exist(name):
    assert callable(getattr(NatsClient, name))


def test_private_state_exists_on_a_fresh_client():
    nc = NatsClient()
    assert isinstance(nc._pongs, list) and nc._pongs_received == 0 and nc._pings_outstanding == 0
    assert nc._server_info == {} and nc._transport is None and nc._current_server is None
    assert isinstance(NatsClient.CLOSED, int)


class Tap:
    """A TCP relay in front of the server that records what the client writes, in order."""

    def __init__(self, port: int):
        self.port, self.sent = port, bytearray()
        self.flowing = asyncio.Event()      # cleared: the relay stops reading what the client writes
        self.flowing.set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.relay, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def relay(self, reader, writer):
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.port)

        async def pump(src, dst, record):
            while (not record or await self.flowing.wait()) and (data := await src.read(65536)):
                if record:
                    self.sent += data
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_w, True), pump(up_r, writer, False), return_exceptions=True)


async def wire_order(server: NatsServer, fenced: bool) -> tuple[int, int]:
    tap = Tap(server.port)
    port = await tap.start()
    nc = Client()
    await nc.connect(server.url_at(port))
    try:
        tap.sent.clear()
        await nc.publish("fence.probe", b"ack")
        await (nc.fence() if fenced else nc.flush())
        await nc.flush()            # let everything reach the tap before we read it
        wire = bytes(tap.sent)
        return wire.find(b"PUB fence.probe"), wire.find(b"PING")
    finally:
        await nc.close()
        tap.server.close()


def test_flush_puts_its_ping_ahead_of_queued_publishes(nats_server):
    """The premise that makes fence() necessary: a bare flush() can overtake a publish."""
    pub, ping = asyncio.run(wire_order(nats_server, fenced=False))
    assert 0 <= ping < pub, "nats-py flush() no longer overtakes queued publishes: fence() could be a flush()"


def test_fence_writes_queued_publishes_before_its_ping(nats_server):
    pub, ping = asyncio.run(wire_order(nats_server, fenced=True))
    assert 0 <= pub < ping


def test_a_cancelled_flush_does_not_break_the_next_one(nats_server):
    async def run():
        nc = Client()
        await nc.connect(nats_server.url)
        try:
            task = asyncio.ensure_future(nc.flush(timeout=5))
            await asyncio.sleep(0)
            task.cancel()                       # its future stays queued for the next PONG
            await asyncio.gather(task, return_exceptions=True)
            sub = await nc.subscribe("after.cancel")
            await nc.publish("after.cancel", b"x")
            await nc.fence(timeout=2)           # must get its own PONG, not hang or raise
            msg = await sub.next_msg(timeout=2)
            return msg.data
        finally:
            await nc.close()

    assert asyncio.run(run()) == b"x"


def test_deliver_directly_hands_every_message_over_in_order_and_survives_a_failing_callback(nats_server):
    """A worker's pull inbox (workers/runtime/worker.py): each message to the callback from the
    read loop, in the order sent, headers and status lines parsed as nats-py does; a callback
    that raises goes to the error callback and the next message still comes; other
    subscriptions keep nats-py's own path."""
    async def run():
        nc = Client()
        errors: list[BaseException] = []

        async def on_error(exc):
            errors.append(exc)

        await nc.connect(nats_server.url, error_cb=on_error)
        got: list[tuple[str, str, bytes, dict | None]] = []

        async def deliver(subject, reply, data, headers):
            if data == b"boom":
                raise RuntimeError("boom")
            got.append((subject, reply, data, headers))

        try:
            sub = await nc.subscribe("direct.>")
            nc.deliver_directly(sub, deliver)
            other = await nc.subscribe("other")
            before = nc.stats["in_msgs"]
            await nc.publish("direct.a", b"1")
            await nc.publish("direct.b", b"2", reply="r.2", headers={"Nats-Msg-Id": "k"})
            await nc.publish("direct.c", b"boom")
            await nc.publish("direct.d", b"3")
            await nc.publish("other", b"o")
            await nc.fence(timeout=5)
            await nc.flush(timeout=5)            # its PONG comes after everything published before it
            assert (await other.next_msg(timeout=2)).data == b"o"
            counted = nc.stats["in_msgs"] - before
            js = nc.jetstream()                  # a pull request that expires: the status a worker's inbox gets
            await js.add_stream(name="DIRECT", subjects=["directjobs"])
            await js.add_consumer("DIRECT", durable_name="c", ack_policy="explicit")
            await nc.publish("$JS.API.CONSUMER.MSG.NEXT.DIRECT.c", b'{"batch":1,"expires":100000000}', reply="direct.inbox")
            for _ in range(100):
                if len(got) == 4:
                    break
                await asyncio.sleep(0.05)
            return got, errors, counted
        finally:
            await nc.close()

    got, errors, counted = asyncio.run(run())
    assert got[:3] == [("direct.a", "", b"1", None), ("direct.b", "r.2", b"2", {"Nats-Msg-Id": "k"}),
                       ("direct.d", "", b"3", None)]
    subject, reply, _, headers = got[3]
    assert (subject, reply, headers["Status"]) == ("direct.inbox", "", "408"), got[3]
    assert [str(e) for e in errors] == ["boom"] and counted == 5


async def connect_watching(nc, url: str, callback: str, **options) -> asyncio.Event:
    """Connect `nc` (reconnecting every 0.1 s) with an event that nats-py's `callback`
    (disconnected_cb, reconnected_cb) sets."""
    happened = asyncio.Event()

    async def on_it():
        happened.set()

    await nc.connect(url, reconnect_time_wait=0.1, **{callback: on_it}, **options)
    return happened


def test_publish_each_sends_every_message_in_order_and_is_refused_whole_while_reconnecting(nats_server):
    """A worker's batch of acks (workers/runtime/settle.py ack_all): one command for them all,
    each a PUB the server delivers; while nats-py reconnects with no room in its buffer, the
    whole batch raises what publish() raises (settle.REFUSED), nothing of it queued."""
    async def run():
        nc = Client()
        disconnected = await connect_watching(nc, nats_server.url, "disconnected_cb", max_reconnect_attempts=-1,
                                              pending_size=64)
        try:
            sub = await nc.subscribe("each.>")
            await nc.publish_each([f"each.{k}" for k in range(5)], b"+ACK")
            await nc.fence(timeout=5)
            got = [(m.subject, m.data) for m in [await sub.next_msg(timeout=2) for _ in range(5)]]
            await asyncio.to_thread(nats_server.stop)
            await asyncio.wait_for(disconnected.wait(), 10)
            pending = nc._pending_data_size
            try:
                await nc.publish_each([f"each.{k}" for k in range(5)], b"+ACK")
                outcome = "queued"
            except Exception as exc:
                outcome = type(exc).__name__
            return got, outcome, nc._pending_data_size - pending
        finally:
            await asyncio.to_thread(nats_server.start)
            await nc.close()

    got, outcome, queued = asyncio.run(run())
    assert got == [(f"each.{k}", b"+ACK") for k in range(5)]
    assert outcome == "OutboundBufferLimitError" and queued == 0


@pytest.mark.parametrize("ours", [False, True], ids=["nats-py", "natsfix"])
def test_a_flush_while_reconnecting_needs_a_pong(nats_server, ours):
    """The premise: nats-py's flush() returns at once, PONG or not, while it reconnects (a
    reconnect cancels the read and flusher tasks, and flush() then falls back to a write that
    does nothing unconnected). Ours raises instead, so no fence "proves" an ack mid-outage; once
    the server is back both flush for real."""
    async def run():
        nc = Client() if ours else NatsClient()
        disconnected = await connect_watching(nc, nats_server.url, "disconnected_cb", max_reconnect_attempts=-1)
        try:
            await asyncio.to_thread(nats_server.stop)
            await asyncio.wait_for(disconnected.wait(), 10)
            assert nc.is_reconnecting or not nc.is_connected
            try:
                await nc.flush(timeout=2)
                outcome = "returned"
            except Exception as exc:
                outcome = type(exc).__name__
            await asyncio.to_thread(nats_server.start)
            for _ in range(200):                 # up to 20 s for the reconnect
                if nc.is_connected:
                    break
                await asyncio.sleep(0.1)
            await nc.flush(timeout=5)
            return outcome
        finally:
            await nc.close()

    assert asyncio.run(run()) == ("ConnectionReconnectingError" if ours else "returned")


# ---------------------------------------------------------------- R13: flush and fence on a link that cannot prove

async def deaf_read_loop(nc) -> None:
    """Kill the client's read task the way nats-py's own `_read_loop` ends on an unexpected
    exception: the next PONG's processing raises (for plain nats-py, the InvalidStateError of a
    cancelled flush's future, which is real; for ours, an exception put there on purpose)."""
    task = asyncio.ensure_future(nc.flush(timeout=5))
    await asyncio.sleep(0)
    task.cancel()                          # its future stays queued; its PONG is on its way
    await asyncio.gather(task, return_exceptions=True)
    for _ in range(200):
        if nc._reading_task.done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the read task survived")


class Brittle(Client):
    """Ours, with one unexpected parser exception to come (any bug in a parse path would do)."""
    broken = True

    async def _process_pong(self) -> None:
        if self.broken:
            self.broken = False
            raise RuntimeError("an unexpected exception in the parser, on purpose")
        await super()._process_pong()


def test_premise_nats_py_flush_returns_without_a_pong_once_its_read_task_died(nats_server):
    """R13 (a), nats-py's side: after an unexpected exception in `_read_loop` the client stays
    CONNECTED, nothing reads the socket, and flush() falls back to a plain write and returns."""
    async def run():
        nc = NatsClient()
        await nc.connect(nats_server.url)
        try:
            await deaf_read_loop(nc)
            assert nc.is_connected, "nats-py no longer stays CONNECTED with a dead read task"
            await nc.flush(timeout=2)      # returns: no PONG could have been read
            return nc._reading_task.done()
        finally:
            await nc.close()

    assert asyncio.run(run()), "flush() restarted the read task?"


def test_a_flush_on_a_link_whose_read_task_died_raises_and_reconnects(nats_server):
    """R13 (a), ours: no fence or liveness PING "succeeds" on a link nobody reads; the client
    reconnects at once (nats-py's ping timer would take PING_INTERVAL x 3), and fences again."""
    async def run():
        nc = Brittle()
        reconnected = await connect_watching(nc, nats_server.url, "reconnected_cb",
                                             ping_interval=3600)          # so only our check can notice
        try:
            await deaf_read_loop(nc)
            assert nc.is_connected and nc._reading_task.done()
            outcomes = []
            for attempt in (nc.flush(timeout=2), nc.fence(timeout=2)):
                try:
                    await attempt
                    outcomes.append("returned")
                except Exception as exc:
                    outcomes.append(type(exc).__name__)
            if outcomes[0] != "StaleConnectionError":
                return outcomes, None            # "proved" on a link nobody reads
            await asyncio.wait_for(reconnected.wait(), 20)
            sub = await nc.subscribe("after.deaf")
            await nc.publish("after.deaf", b"x")
            await nc.fence(timeout=5)
            return outcomes, (await sub.next_msg(timeout=2)).data
        finally:
            await nc.close()

    outcomes, data = asyncio.run(run())
    assert outcomes[0] == "StaleConnectionError", outcomes
    assert outcomes[1] in ("StaleConnectionError", "ConnectionReconnectingError"), outcomes
    assert data == b"x"


def stuck_writes(nc) -> int:
    return nc._transport._io_writer.transport.get_write_buffer_size()


async def congested(server: NatsServer, probe):
    """A client whose relay stops reading what it writes, fed until the kernel's buffers are full
    and its flusher task is stuck in `drain()`, with one more publish queued behind; then
    `probe(nc)`. Returns (probe's outcome, the PINGs the server got from the client once the
    relay reads again)."""
    tap = Tap(server.port)
    port = await tap.start()
    nc = Client()
    await nc.connect(server.url_at(port), ping_interval=3600)
    try:
        tap.flowing.clear()
        sent_before = len(tap.sent)
        for _ in range(400):                 # at most 200 MB; loopback buffers take a few
            if stuck_writes(nc) > 0:
                break
            await nc.publish("fence.congested", b"x" * 500_000)    # under nats-py's 2 MB pending cap
            await asyncio.sleep(0.01)
        assert stuck_writes(nc) > 0, "the relay's socket never filled"
        await nc.publish("fence.congested", b"queued behind")
        await asyncio.sleep(0.05)
        assert nc._pending_data_size > 0, "the flusher took the last publish: it is not stuck"
        try:
            outcome = repr(await probe(nc))
        except Exception as exc:
            outcome = type(exc).__name__
        tap.flowing.set()
        await nc.flush(timeout=30)           # everything queued reaches the server, then one PING of ours
        return outcome, bytes(tap.sent[sent_before:]).count(b"PING\r\n") - 1
    finally:
        await nc.close()
        tap.server.close()


def test_premise_nats_py_flush_pending_swallows_the_timeout_of_a_wait_for(nats_server):
    """R13 (b), the premise: `_flush_pending` catches CancelledError, so Python 3.11's wait_for
    around it returns normally at its deadline instead of raising TimeoutError."""
    outcome, _ = asyncio.run(asyncio.wait_for(congested(
        nats_server, lambda nc: asyncio.wait_for(nc._flush_pending(force_flush=True), 0.3)), 60))
    assert outcome == "None", outcome


def test_a_fence_past_its_deadline_raises_and_writes_no_ping(nats_server):
    """R13 (b), ours: a fence whose queued bytes cannot reach the socket before its deadline
    raises FlushTimeoutError then and sends nothing more. It used to go on and write its PING
    with 1 ms left, ahead of bytes still queued (a PONG within that 1 ms would have "proved" them)."""
    outcome, late_pings = asyncio.run(asyncio.wait_for(congested(nats_server,
                                                                 lambda nc: nc.fence(timeout=0.5)), 60))
    assert outcome == "FlushTimeoutError", outcome
    assert late_pings == 0, "the fence wrote a PING after its deadline"
