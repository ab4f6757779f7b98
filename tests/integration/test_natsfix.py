"""The premises supervisor/nats/fix.py rests on, checked against the installed nats-py and a real
nats-server: if an upgrade breaks one, this file says which, before the supervisor misbehaves."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client as NatsClient

from supervisor.nats import fix as natsfix
from supervisor.nats.fix import Client


def test_pinned_version_is_installed():
    natsfix.check_version()


@pytest.mark.parametrize("name", ["_flush_pending", "_process_pong", "_send_ping"])
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

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.relay, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def relay(self, reader, writer):
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.port)

        async def pump(src, dst, record):
            while data := await src.read(65536):
                if record:
                    self.sent += data
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_w, True), pump(up_r, writer, False), return_exceptions=True)


async def wire_order(nats_port: int, fenced: bool) -> tuple[int, int]:
    tap = Tap(nats_port)
    port = await tap.start()
    nc = Client()
    await nc.connect(f"nats://127.0.0.1:{port}")
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
    pub, ping = asyncio.run(wire_order(nats_server.port, fenced=False))
    assert 0 <= ping < pub, "nats-py flush() no longer overtakes queued publishes: fence() could be a flush()"


def test_fence_writes_queued_publishes_before_its_ping(nats_server):
    pub, ping = asyncio.run(wire_order(nats_server.port, fenced=True))
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


@pytest.mark.parametrize("ours", [False, True], ids=["nats-py", "natsfix"])
def test_a_flush_while_reconnecting_needs_a_pong(nats_server, ours):
    """The premise: nats-py's flush() returns at once, PONG or not, while it reconnects (a
    reconnect cancels the read and flusher tasks, and flush() then falls back to a write that
    does nothing unconnected). Ours raises instead, so no fence "proves" an ack mid-outage; once
    the server is back both flush for real."""
    async def run():
        nc = Client() if ours else NatsClient()
        disconnected = asyncio.Event()

        async def on_disconnect():
            disconnected.set()

        await nc.connect(nats_server.url, disconnected_cb=on_disconnect, reconnect_time_wait=0.1,
                         max_reconnect_attempts=-1)
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
