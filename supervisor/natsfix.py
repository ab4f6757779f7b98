"""One fix to nats-py 2.16, applied on import.

A flush() that times out or whose task is cancelled leaves its future, cancelled, in the
client's PONG queue. When that PING's PONG arrives, nats-py calls set_result() on it, raises
InvalidStateError inside the protocol parser and drops the rest of the chunk it was parsing
(messages included), and every later flush() waits for the wrong PONG and times out (seen
here: a worker's connection drain hung for 10 s). Cf. nats-io/nats.py#624 and nats.py2#36.
Each PONG still answers exactly one PING, in order; we just don't resolve a future twice.
"""

from nats.aio.client import Client


async def _process_pong(self: Client) -> None:
    if self._pongs:
        future = self._pongs.pop(0)
        if not future.done():
            future.set_result(True)
        self._pongs_received += 1
        self._pings_outstanding = 0


Client._process_pong = _process_pong
