"""A worker's way out (workers/runtime/shutdown.py) with a fake worker: what arrives while the
drain's NAKs go out is NAKed too, at once, not at graceful_timeout; and the subscription stays
until every credit of the worker's pull requests is accounted for (F8), no longer."""

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
        host.pulls = SimpleNamespace(credits=0, forget=lambda left_live=False: None)
        host.threads = SimpleNamespace(take_unstarted=list)
        host.parked, host.take_parked, host.release_limits = (lambda: 0), list, (lambda job: None)
        host.queue.append((None, 0, Job(data=b"", subject="jobs.a", headers={}, stream_seq=1)))
        await asyncio.wait_for(Shutdown(host, 0).wind_down(), 10)
        return naked
    assert asyncio.run(run()) == [1, 2]


def test_a_drain_naks_what_its_credits_bring_at_once_and_leaves_when_they_are_accounted_for():
    """Both changes to wind_down together. STOPPING, one credit still out: the first job's NAK
    awaits while the server fills that credit with a second job (queued, `changed` set); that
    job's NAK is out, the last credit ends (a 408: credits 0, `changed` set) at the drain's next
    await, when nothing is left to run. The drain must
    NAK the second job without waiting for graceful_timeout (`changed` cleared before the NAKs,
    not after), and unsubscribe only once the credits are 0 (F8: not when nothing is left to run),
    then at once. Red with the clear after the NAKs (times out); red with the exit on an empty
    queue alone (unsubscribes with a credit out)."""
    async def run() -> tuple[list[int], list[int]]:
        naked: list[int] = []
        credits_at_unsub: list[int] = []
        host = SimpleNamespace(mode=STOPPING, grace=60.0, running=0, runners=[], chain=SimpleNamespace(outer=()),
                               table=slots.SlotTable(4, 64), changed=asyncio.Event(), queue=deque())
        host.pulls = SimpleNamespace(credits=2, forget=lambda left_live=False: None)

        def last_credit_ends() -> None:
            host.pulls.credits = 0
            host.changed.set()

        async def settle(i: int, job: Job, payload: bytes, outcome: str, reason: str) -> None:
            naked.append(job.stream_seq)
            if job.stream_seq == 1:          # a credit filled while this NAK goes out
                host.pulls.credits -= 1
                host.queue.append((None, 1, Job(data=b"", subject="jobs.a", headers={}, stream_seq=2)))
                host.changed.set()
            await asyncio.sleep(0)
            if job.stream_seq == 2:          # the last credit's request ends (408) at the drain's next await
                asyncio.get_running_loop().call_soon(last_credit_ends)

        async def unsubscribe() -> None:
            credits_at_unsub.append(host.pulls.credits)
        host.settler = SimpleNamespace(settle=settle)
        host.sub = SimpleNamespace(unsubscribe=unsubscribe)
        host.threads = SimpleNamespace(take_unstarted=list)
        host.parked, host.take_parked, host.release_limits = (lambda: 0), list, (lambda job: None)
        host.queue.append((None, 0, Job(data=b"", subject="jobs.a", headers={}, stream_seq=1)))
        await asyncio.wait_for(Shutdown(host, 0).wind_down(), 10)
        return naked, credits_at_unsub
    assert asyncio.run(run()) == ([1, 2], [0])


def test_a_request_still_live_at_the_deadline_leaves_its_credits_in_the_table(caplog):
    """F20: graceful_timeout runs out with a pull request live (its 408, or what the server
    filled into it, held up by a stall). The worker stops listening then, so what the request
    brings is read by nobody: the credits given up stay in the table (the parent's in-transit
    check at the exit reads them) and the log says so. A drain whose credits ended gives them
    up as before. Red with forget() zeroing the table at the deadline."""
    async def run(credits: int) -> tuple[int, list[int]]:
        from workers.runtime.puller import Puller
        table = slots.SlotTable(4, 64)
        host = SimpleNamespace(mode=STOPPING, grace=0.05, running=0, runners=[], chain=SimpleNamespace(outer=()),
                               table=table, changed=asyncio.Event(), queue=deque())
        host.pulls = Puller.__new__(Puller)          # its credits and forget() alone
        host.pulls.owner, host.pulls.credits = host, credits
        table.set_credits(credits)
        unsubscribed: list[int] = []

        async def unsubscribe() -> None:
            unsubscribed.append(table.header(slots.CREDITS))
        host.settler = SimpleNamespace()
        host.sub = SimpleNamespace(unsubscribe=unsubscribe)
        host.threads = SimpleNamespace(take_unstarted=list)
        host.parked, host.take_parked, host.release_limits = (lambda: 0), list, (lambda job: None)
        await asyncio.wait_for(Shutdown(host, 0).wind_down(), 10)
        return host.pulls.credits, unsubscribed
    with caplog.at_level("WARNING", logger="worker"):
        assert asyncio.run(run(2)) == (0, [2])
    assert [r.credits for r in caplog.records if getattr(r, "event", "") == "pull_request_given_up"] == [2]
    caplog.clear()
    with caplog.at_level("WARNING", logger="worker"):
        assert asyncio.run(run(0)) == (0, [0])
    assert not [r for r in caplog.records if getattr(r, "event", "") == "pull_request_given_up"]
