"""A worker's way out (workers/runtime/shutdown.py) with a fake worker: what arrives while the
drain's NAKs go out is NAKed too, at once, not at graceful_timeout."""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace

from workers import Job
from workers.protocol import slots
from workers.protocol.modes import STOPPING
from workers.runtime.shutdown import Shutdown


def test_a_job_queued_while_the_drain_naks_is_naked_at_once():
    """The interleaving: a drain NAKs the queued job; while that NAK's publish awaits, a message
    arrives (or a parked job's key turn comes) and is queued, setting `changed`. The loop then
    found it busy and cleared `changed` before waiting on it, so the job sat in hand until
    graceful_timeout (60 s here; 30 s by default: seen in tests/integration/test_ordering.py's
    drain beside recycling, about 1 run in 10). Red before the fix: the wait below times out."""
    async def run() -> list[int]:
        naked: list[int] = []
        host = SimpleNamespace(mode=STOPPING, grace=60.0, running=0, runners=[], chain=SimpleNamespace(outer=()),
                               table=slots.SlotTable(4, 64), changed=asyncio.Event(), queue=deque())

        async def settle(i: int, job: Job, payload: bytes, outcome: str, reason: str) -> None:
            naked.append(job.stream_seq)
            if job.stream_seq == 1:          # the second job arrives while the first one's NAK goes out
                host.queue.append((None, 1, Job(data=b"", subject="jobs.a", headers={}, stream_seq=2)))
                host.changed.set()
            await asyncio.sleep(0)

        async def unsubscribe() -> None:
            pass
        host.settler = SimpleNamespace(settle=settle)
        host.sub = SimpleNamespace(unsubscribe=unsubscribe)
        host.pulls = SimpleNamespace(credits=0, forget=lambda: None)
        host.threads = SimpleNamespace(take_unstarted=list)
        host.parked, host.take_parked, host.release_limits = (lambda: 0), list, (lambda job: None)
        host.queue.append((None, 0, Job(data=b"", subject="jobs.a", headers={}, stream_seq=1)))
        await asyncio.wait_for(Shutdown(host, 0).wind_down(), 10)
        return naked
    assert asyncio.run(run()) == [1, 2]

