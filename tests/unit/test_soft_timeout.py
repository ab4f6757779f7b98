"""workers.soft_timeout's mechanism by itself (workers/middleware/timeouts.py): SoftTimeout raised
in a thread running a pure-Python loop, and in an async job asleep on the loop; nothing raised
in jobs that finish in time; a deadline passing just as the handler returned comes out of the
middleware's around (the job's outcome), never later in the thread; a handler's own TimeoutError
left as it is."""

from __future__ import annotations

import asyncio

import pytest

from workers import Job, SoftTimeout
from workers.middleware.timeouts import SoftTimeoutAsync, SoftTimeoutSync, Watchdog, raise_in

JOB = Job(data=b"", subject="jobs.x")


def test_a_runaway_pure_python_loop_gets_soft_timeout_in_its_thread():
    mw = SoftTimeoutSync(0.1)
    mw.setup(None)          # type: ignore[arg-type]  # the watchdog needs no context
    spins = []

    def runaway():
        while True:
            spins.append(1) if len(spins) < 10 else None

    try:
        with pytest.raises(SoftTimeout):
            mw.around(JOB, runaway)
        assert mw.watchdog.fired == 1 and not mw.watchdog.armed
        assert mw.around(JOB, lambda: "in time") == "in time"     # the thread goes on with its next job
    finally:
        mw.close()


def test_jobs_that_finish_in_time_are_never_interrupted_and_only_the_earliest_deadline_wakes_it():
    mw = SoftTimeoutSync(5.0)
    mw.setup(None)          # type: ignore[arg-type]
    try:
        for _ in range(200):
            assert mw.around(JOB, lambda: 1) == 1
        assert mw.watchdog.fired == 0 and not mw.watchdog.armed
    finally:
        mw.close()


def test_a_deadline_passing_as_the_handler_returns_surfaces_in_the_around_not_after_it():
    """The watchdog fires just as the handler returned (this thread in disarm, before it takes the
    token back): SoftTimeout comes out of around, as the job's outcome, and nowhere later."""
    class FiresAtDisarm(Watchdog):
        def disarm(self, token: int) -> None:
            with self.cond:              # what run() does at the deadline, at the worst moment
                _, thread_id, _ = self.armed.pop(token)
                raise_in(thread_id, SoftTimeout)
            super().disarm(token)

    mw = SoftTimeoutSync(60.0)
    mw.watchdog = FiresAtDisarm()
    ran = []
    with pytest.raises(SoftTimeout):
        mw.around(JOB, lambda: ran.append("the handler returned"))
    for _ in range(10_000):              # this thread's next work: nothing is raised in it
        pass
    assert ran == ["the handler returned"]


def test_an_async_job_asleep_is_cancelled_and_its_outcome_is_soft_timeout():
    cleaned = []

    async def sleeper():
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.append("finally ran")

    async def own_timeout():
        raise TimeoutError("the handler's own")

    async def main():
        mw = SoftTimeoutAsync(0.1)
        with pytest.raises(SoftTimeout):
            await mw.around(JOB, sleeper)
        with pytest.raises(TimeoutError, match="the handler's own"):
            await mw.around(JOB, own_timeout)
        return await mw.around(JOB, lambda: asyncio.sleep(0))       # in time: its result
    assert asyncio.run(main()) is None and cleaned == ["finally ran"]


def test_a_soft_timeout_raised_as_the_handler_disarms_leaves_no_lock_held():
    """The worst moment, forced: the watchdog, holding its lock, raises for a job whose handler has
    just returned and is disarming. Before, the handler thread waited for that lock with the
    SoftTimeout pending, got it inside the lock's acquire and never released it (every other
    handler thread then stuck in arm, the watchdog and the worker's exit with them). Now it takes
    no lock until nothing can be pending: the SoftTimeout lands in disarm, and the lock is free."""
    import threading
    import time

    w = Watchdog()
    out: dict = {}
    armed, go = threading.Event(), threading.Event()

    def handler_thread() -> None:
        out["token"] = w.arm(60.0, 7)
        armed.set()
        go.wait()
        try:
            w.disarm(out["token"])
            out["result"] = "disarmed"
        except SoftTimeout:
            out["result"] = "SoftTimeout"

    t = threading.Thread(target=handler_thread)
    t.start()
    armed.wait()
    with w.cond:                                  # run() at the deadline, as it fires
        w.armed.pop(out["token"])
        w.firing = out["token"]
        go.set()                                  # the handler returns now and disarms
        deadline = time.monotonic() + 5
        while out["token"] not in w.done:
            assert time.monotonic() < deadline, "the handler thread never said it was done"
            time.sleep(0.001)
        raise_in(t.ident, SoftTimeout)            # decided before it read done: under way all the same
        w.firing = 0
    t.join(5)
    assert not t.is_alive() and out["result"] == "SoftTimeout"
    assert w.cond.acquire(timeout=1), "the handler thread left the watchdog's lock held"
    w.cond.release()
    assert not w.done and not w.armed
