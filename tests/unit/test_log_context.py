"""Log context by itself: the formatters (supervisor/logs.py) read the job a record belongs to
(supervisor/logcontext.py), set by the innermost built-in middleware (workers/middleware/joblog.py)
in the job's own handler thread or task, so concurrent jobs never see each other's, and a
record outside a job carries nothing. And the crash board (workers/protocol/crashes.py) the
parent writes at a death and a worker reads for a redelivery's span."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

from supervisor.logcontext import CURRENT, JobFields
from supervisor.logs import JsonFormatter, TextFormatter
from workers import Context, Job
from workers.middleware.chain import Chain
from workers.middleware.joblog import JobLog
from workers.protocol.crashes import LAYOUT, Crash, CrashBoard


def record(message: str = "charging card") -> logging.LogRecord:
    return logging.LogRecord("handlers", logging.INFO, __file__, 1, message, None, None)


def test_a_record_in_a_job_carries_it_and_one_outside_carries_nothing():
    text, js = TextFormatter(journald=True), JsonFormatter(journald=True)
    assert text.format(record()) == "<6>info    handlers: charging card"
    assert "job_seq" not in json.loads(js.format(record()))
    token = CURRENT.set(JobFields(2, 42, 1, "jobs.new", "ab" * 16))
    try:
        assert text.format(record()) == "<6>info    handlers: [w2 seq=42 #1] charging card"
        out = json.loads(js.format(record()))
    finally:
        CURRENT.reset(token)
    assert out == {**out, "job_seq": 42, "job_delivery": 1, "job_subject": "jobs.new", "worker": 2,
                   "trace_id": "ab" * 16, "message": "charging card"}
    assert "trace_id" not in JobFields(0, 1, 1, "x").fields()


def chain_with_joblog(handler, loop, is_async: bool) -> Chain:
    chain = Chain(handler)
    ctx = Context(3, 1, None, loop, None, is_async)   # type: ignore[arg-type]  # no config needed here
    setup = chain.setup([("[log context]", JobLog())], ctx)
    if is_async:
        loop.run_until_complete(setup)
    else:
        asyncio.run_coroutine_threadsafe(setup, loop).result(5)
    return chain


def test_concurrent_sync_jobs_each_see_their_own_in_their_thread_and_none_after():
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    both_in = threading.Barrier(2)
    seen: dict[int, JobFields | None] = {}

    def handler(job: Job) -> None:
        both_in.wait(5)                   # the two jobs run at once
        seen[job.stream_seq] = CURRENT.get()

    chain = chain_with_joblog(handler, loop, is_async=False)
    after: list[JobFields | None] = []

    def thread(seq: int) -> None:
        chain.run_sync(Job(b"", f"jobs.{seq}", stream_seq=seq, delivery=seq + 1), lambda: None)
        after.append(CURRENT.get())

    threads = [threading.Thread(target=thread, args=(seq,)) for seq in (5, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    loop.call_soon_threadsafe(loop.stop)
    assert seen == {5: JobFields(3, 5, 6, "jobs.5"), 6: JobFields(3, 6, 7, "jobs.6")}
    assert after == [None, None]


def test_concurrent_async_jobs_each_see_their_own_and_so_do_their_tasks():
    loop = asyncio.new_event_loop()
    seen: dict[int, tuple] = {}

    async def handler(job: Job) -> None:
        mine = CURRENT.get()
        await asyncio.sleep(0.01)         # the other job runs meanwhile
        seen[job.stream_seq] = (mine, CURRENT.get(), await asyncio.create_task(asyncio.sleep(0, CURRENT.get())))

    chain = chain_with_joblog(handler, loop, is_async=True)

    async def runner(seq: int) -> JobFields | None:    # a worker's runner task: jobs one after another
        await chain.run_async(Job(b"", "jobs.x", stream_seq=seq), lambda: None)
        return CURRENT.get()

    async def main():
        return await asyncio.gather(runner(1), runner(2))

    assert loop.run_until_complete(main()) == [None, None]
    loop.close()
    for seq in (1, 2):
        assert seen[seq] == (JobFields(3, seq, 1, "jobs.x"),) * 3


def test_the_crash_board_names_the_last_death_that_held_a_job():
    board = CrashBoard(capacity=8)
    assert board.lookup(3) is None                       # nothing posted (and seq 0 is no job)
    first = Crash(3, 1, 1, 0, 100, 1.5, "killed by SIGKILL")
    board.post(first)
    assert board.lookup(3) == first and board.lookup(11) is None   # 11 shares the slot, not the job
    board.post(Crash(3, 2, 2, 1, 101, 2.5, "exit code 13"))
    assert board.lookup(3).death == 2
    board.post(Crash(11, 1, 3, 0, 102, 3.5, "x" * 300))              # same slot: replaces seq 3
    assert board.lookup(3) is None and board.lookup(11).cause == "x" * 80


def test_a_reader_never_takes_an_entry_being_written():
    board = CrashBoard(capacity=8)
    board.post(Crash(5, 1, 1, 0, 100, 1.5, "exit code 13"))
    at = 5 * LAYOUT.size                                            # seq 5's slot
    version = int.from_bytes(board.mm[at:at + 8], "little")
    board.mm[at:at + 8] = (version + 1).to_bytes(8, "little")        # odd: the parent is mid-write
    assert board.lookup(5) is None
    board.mm[at:at + 8] = (version + 2).to_bytes(8, "little")
    assert board.lookup(5) is not None
