"""The middleware chain by itself (workers/middleware/chain.py): the order of the hooks, what a
hook that raises does to the outcome, a job never acked unrun, and where hooks run (a sync
chain's async hooks on the worker's loop, here a loop in a thread of its own)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from workers import Context, Duplicate, Job, Middleware, Reject, Retry
from workers.middleware.chain import Chain, HookFailed, around_mismatch

JOB = Job(data=b"x", subject="jobs.x", stream_seq=7)


class Recorder(Middleware):
    """Journals its calls into `calls`; raises what `raises` maps a hook name to."""

    def __init__(self, name: str, calls: list, raises: dict | None = None, asynchronous: bool = False):
        self.name, self.calls, self.raises, self.asynchronous = name, calls, raises or {}, asynchronous

    def hit(self, hook: str) -> None:
        self.calls.append(f"{self.name}.{hook}")
        if hook in self.raises:
            raise self.raises[hook]

    def before_job(self, job):
        if self.asynchronous:
            return self._async("before")
        self.hit("before")

    def after_job(self, job, outcome, error):
        if self.asynchronous:
            return self._async(f"after:{outcome}")
        self.hit(f"after:{outcome}")

    async def _async(self, hook: str) -> None:
        self.calls.append(f"{self.name}.{hook}@{threading.current_thread().name}")
        if hook.split(":")[0] in self.raises:
            raise self.raises[hook.split(":")[0]]


class Around(Recorder):
    def around(self, job, call_next):
        self.hit("around-in")
        call_next()
        self.calls.append(f"{self.name}.around-out")


class AsyncAround(Recorder):
    async def around(self, job, call_next):
        self.hit("around-in")
        await call_next()
        self.calls.append(f"{self.name}.around-out")


class Skipper(Middleware):
    def around(self, job, call_next):
        return None


class Swallower(Middleware):
    def around(self, job, call_next):
        try:
            call_next()
        except Exception:
            pass


@pytest.fixture(scope="module")
def loop():
    """The worker's loop, in a thread of its own (named "loop"), as a sync handler's hooks see it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="loop", daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def sync_chain(loop, calls, *middleware, handler_raises: BaseException | None = None) -> Chain:
    def handler(job):
        calls.append("handler")
        if handler_raises is not None:
            raise handler_raises
    chain = Chain(handler)
    ctx = Context(0, 1, None, loop, None, False)   # type: ignore[arg-type]  # no config needed here
    asyncio.run_coroutine_threadsafe(chain.setup([(m.name if hasattr(m, "name") else type(m).__name__, m)
                                                  for m in middleware], ctx), loop).result(5)
    return chain


def run_sync(loop, calls, *middleware, **kw):
    return sync_chain(loop, calls, *middleware, **kw).run_sync(JOB, lambda: calls.append("started"))


def test_the_hooks_run_as_an_onion_outermost_first(loop):
    calls: list[str] = []
    ran = run_sync(loop, calls, Around("A", calls), Recorder("B", calls))
    assert ran.exc is None and ran.started
    assert calls == ["A.before", "A.around-in", "B.before", "started", "handler", "B.after:ack", "A.around-out",
                     "A.after:ack"]


@pytest.mark.parametrize("exc, outcome", [(Retry(2), "retry"), (Reject("no"), "reject"), (Duplicate(), "duplicate")])
def test_a_before_job_that_decides_skips_the_handler_and_what_is_inside(loop, exc, outcome):
    calls: list[str] = []
    ran = run_sync(loop, calls, Recorder("A", calls), Recorder("B", calls, {"before": exc}), Recorder("C", calls))
    assert ran.exc is exc and not ran.started
    assert calls == ["A.before", "B.before", f"A.after:{outcome}"]   # B's own after_job: its before did not return


def test_a_hook_that_fails_is_a_hook_failed_and_the_job_is_retried(loop):
    calls: list[str] = []
    boom = ValueError("boom")
    ran = run_sync(loop, calls, Recorder("A", calls), Recorder("B", calls, {"before": boom}))
    assert isinstance(ran.exc, HookFailed) and ran.exc.where == "B.before_job" and ran.exc.error is boom
    assert calls == ["A.before", "B.before", "A.after:fail"] and not ran.started


def test_every_after_job_runs_and_sees_the_outcome_as_the_inner_ones_left_it(loop):
    calls: list[str] = []
    ran = run_sync(loop, calls, Recorder("A", calls), Recorder("B", calls, {"after:ack": Retry(1)}),
                   Recorder("C", calls, {"after:ack": RuntimeError("C fails")}))
    assert calls == ["A.before", "B.before", "C.before", "started", "handler", "C.after:ack", "B.after:fail",
                     "A.after:fail"]
    assert isinstance(ran.exc, HookFailed) and ran.exc.where == "C.after_job" and ran.started
    calls.clear()
    ran = run_sync(loop, calls, Recorder("A", calls), Recorder("B", calls, {"after:fail": Reject("B says")}),
                   handler_raises=KeyError("k"))
    assert calls[-2:] == ["B.after:fail", "A.after:reject"] and isinstance(ran.exc, Reject)


@pytest.mark.parametrize("middleware", [Skipper(), Swallower()], ids=["returns-without-call_next", "swallows"])
def test_a_job_whose_handler_never_ran_is_never_acked(loop, middleware):
    calls: list[str] = []
    ran = run_sync(loop, calls, middleware, Recorder("B", calls, {"before": Duplicate()}))
    assert isinstance(ran.exc, HookFailed) and not ran.started and "handler" not in calls


def test_a_handlers_error_and_a_crash_pass_through(loop):
    calls: list[str] = []
    error = RuntimeError("handler")
    ran = run_sync(loop, calls, Around("A", calls), handler_raises=error)
    assert ran.exc is error and calls[-1] == "A.after:fail" and "A.around-out" not in calls
    calls.clear()
    ran = run_sync(loop, calls, Around("A", calls), handler_raises=SystemExit(3))
    assert isinstance(ran.exc, SystemExit) and calls == ["A.before", "A.around-in", "started", "handler"]


def test_a_sync_handlers_async_hooks_run_on_the_loop(loop):
    calls: list[str] = []
    ran = run_sync(loop, calls, Recorder("A", calls, asynchronous=True))
    assert ran.exc is None and calls == ["A.before@loop", "started", "handler", "A.after:ack@loop"]


def test_an_async_chain_awaits_async_hooks_and_calls_plain_ones():
    calls: list[str] = []

    async def handler(job):
        calls.append("handler")

    async def main():
        chain = Chain(handler)
        ctx = Context(0, 1, None, asyncio.get_running_loop(), None, True)   # type: ignore[arg-type]
        await chain.setup([("A", AsyncAround("A", calls)), ("B", Recorder("B", calls, asynchronous=True)),
                           ("C", Recorder("C", calls, {"before": Retry(3)}))], ctx)
        ok = await chain.run_async(JOB, lambda: calls.append("started"))
        return ok
    ran = asyncio.run(main())
    assert isinstance(ran.exc, Retry) and not ran.started
    assert calls == ["A.before", "A.around-in", "B.before@MainThread", "C.before", "B.after:retry@MainThread",
                     "A.after:retry"]


def test_around_must_match_the_handlers_kind():
    assert around_mismatch(Around, is_async=False) == "" and around_mismatch(AsyncAround, is_async=True) == ""
    assert around_mismatch(Recorder, is_async=True) == ""          # no around of its own
    assert "plain function" in around_mismatch(Around, is_async=True)
    assert "`async def` but workers.handler is a plain function" in around_mismatch(AsyncAround, is_async=False)


class LoopOnly(Middleware):
    """Only `async def` hooks, no around: a sync handler's chain runs it on the loop (enter/leave)."""

    def __init__(self, name: str, calls: list, raises: dict | None = None):
        self.name, self.calls, self.raises = name, calls, raises or {}

    async def before_job(self, job):
        self.calls.append(f"{self.name}.before@{threading.current_thread().name}")
        if "before" in self.raises:
            raise self.raises["before"]

    async def after_job(self, job, outcome, error):
        self.calls.append(f"{self.name}.after:{outcome}")
        if "after" in self.raises:
            raise self.raises["after"]


def test_a_sync_chains_outer_async_only_layers_run_on_the_loop_without_a_thread_waiting(loop):
    calls: list[str] = []
    chain = sync_chain(loop, calls, LoopOnly("A", calls), LoopOnly("B", calls, {"after": ValueError("B")}),
                       Recorder("C", calls), LoopOnly("D", calls))
    assert chain.outer == 2                      # C has plain hooks: it and everything inside run in the thread

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(5)
    entered, stop = on_loop(chain.enter(JOB))
    assert (entered, stop) == (2, None) and calls == ["A.before@loop", "B.before@loop"]
    ran = chain.run_sync(JOB, lambda: calls.append("started"))
    assert ran.exc is None and ran.started
    exc = on_loop(chain.leave(JOB, entered, ran.exc))
    assert isinstance(exc, HookFailed) and exc.where == "B.after_job"
    assert calls[2:] == ["C.before", "D.before@loop", "started", "handler", "D.after:ack", "C.after:ack",
                         "B.after:ack", "A.after:fail"]


def test_a_loop_side_before_job_stops_the_job_before_any_thread_takes_it(loop):
    calls: list[str] = []
    chain = sync_chain(loop, calls, LoopOnly("A", calls), LoopOnly("B", calls, {"before": Retry(5)}))
    entered, stop = asyncio.run_coroutine_threadsafe(chain.enter(JOB), loop).result(5)
    assert entered == 1 and isinstance(stop, Retry)
    exc = asyncio.run_coroutine_threadsafe(chain.leave(JOB, entered, stop), loop).result(5)
    assert exc is stop and calls == ["A.before@loop", "B.before@loop", "A.after:retry"]


def test_a_logged_traceback_starts_in_the_users_code(loop):
    import traceback

    from workers.middleware.chain import user_traceback
    calls: list[str] = []
    ran = run_sync(loop, calls, Around("A", calls), Recorder("B", calls), handler_raises=KeyError("k"))
    shown = "".join(traceback.format_tb(user_traceback(ran.exc)))
    assert "middleware/chain.py" not in shown and "test_middleware_chain.py" in shown and "raise handler_raises" in shown
    assert "middleware/chain.py" in "".join(traceback.format_tb(ran.exc.__traceback__))   # the exception untouched


class RedeliveriesOnly(LoopOnly):
    """A built-in's way to say its before_job has nothing to do for a first delivery ([retry]'s copies)."""
    redeliveries_only = True
    after_job = Middleware.after_job            # no after_job hook of its own


def test_a_redeliveries_only_before_job_is_not_called_for_a_first_delivery(loop):
    calls: list[str] = []
    chain = sync_chain(loop, calls, RedeliveriesOnly("A", calls))
    assert chain.outer == 1 and not chain.outer_after      # nothing for leave() to do: the finisher skips it
    first, again = JOB, Job(data=b"x", subject="jobs.x", stream_seq=7, delivery=2)
    assert asyncio.run_coroutine_threadsafe(chain.enter(first), loop).result(5) == (1, None) and calls == []
    assert asyncio.run_coroutine_threadsafe(chain.enter(again), loop).result(5) == (1, None)
    assert calls == ["A.before@loop"]
